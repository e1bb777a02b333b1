"""Decode attention on the GPU: the Triton kernel vs its torch twin in bf16 (error) and time, at
E4B shapes: sliding ring (D=256, S=window+16) and full layers (D=512) at several live contexts.

`--qkv`: a store layer's whole attention at one row, the q/k/v work included, by path: qkv_finish +
the split kernel + the combine (`fuse.qkv_kernel`), and the split kernel's q/k/v mode
(`fuse.attn_qkv`) with its default tiles and with each of `--tiles` (BLOCK_N x warps, stages), at
each of `--contexts` on a full layer (with each of `--splits`) and once on the frontier's sliding ring
(window 188, with each of `--sliding-splits`); `--query-only` adds the KV-shared layers (q rows alone, the cache only read), `--merge`
times every path without its combine launch (`fuse.attn_merge`)."""
from __future__ import annotations

import argparse

import torch

from ..kernels.attention_tiles import _qkv_tiles, _tiles, parse_tiles, tiles_text
from ..kernels.decode_attention import (
    decode_attention, decode_attention_qkv, decode_attention_qkv_ref, decode_attention_ref,
)

H, HKV = 8, 2  # E4B's query and KV heads
EPS = 1e-6


def _timer(fn) -> float:
    import triton.testing

    fn()
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def _slot_pos(B, S, ctx, dev):
    """A ring of S slots holding positions ctx - S .. ctx - 1 (those >= 0)."""
    p = torch.arange(ctx - S, ctx, device=dev)
    slot_pos = torch.full((B, S), -1, dtype=torch.int32, device=dev)
    slot_pos[0, p[p >= 0] % S] = p[p >= 0].int()
    return slot_pos


def case(T, D, S, ctx, ring, window, splits=None):
    dev = "cuda"
    B = 1
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16)
    q_pos = torch.arange(ctx - T, ctx, device=dev)[None]
    slot_pos = _slot_pos(B, S, ctx, dev) if ring else None
    ref = decode_attention_ref(q, k, v, q_pos, slot_pos, window)
    out = decode_attention(q, k, v, q_pos, slot_pos, window, num_splits=splits)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return err, _timer(lambda: decode_attention(q, k, v, q_pos, slot_pos, window, num_splits=splits))


def qkv_inputs(D: int, S: int, ctx: int, ring: bool, dev: str, dtype=torch.bfloat16, seed: int = 0):
    """One row of a store layer at position ctx - 1: the merged projection's row, the norms' weights,
    RoPE, caches holding every earlier position (a ring of S slots, or S slots by position)."""
    from ..model.layers import rope_cos_sin, rope_inv_freq

    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn(1, 1, (H + 2 * HKV) * D, device=dev, generator=g).to(dtype)
    q_w = (torch.rand(D, device=dev, generator=g) + 0.5).to(dtype)
    k_w = (torch.rand(D, device=dev, generator=g) + 0.5).to(dtype)
    q_pos = torch.tensor([[ctx - 1]], device=dev)
    cos, sin = rope_cos_sin(q_pos, rope_inv_freq(D, 10000.0, 1.0).to(dev), dtype)
    k = (torch.randn(1, S, HKV, D, device=dev, generator=g) * D ** -0.25).to(dtype)
    v = torch.randn(1, S, HKV, D, device=dev, generator=g).to(dtype)
    slot_pos = _slot_pos(1, S, ctx, dev) if ring else None
    idx = q_pos % S if ring else q_pos
    return qkv, q_w, k_w, cos, sin, k, v, idx, q_pos, slot_pos


def qkv_paths(tiles: list[tuple[int, int, int]], D: int, S: int | None = None,
              store: bool = True) -> list[tuple[str, object]]:
    """(name, tiles) of the q/k/v mode's rows: its default (for S cache slots, a store or query-only
    layer) first, then the others given."""
    default = _qkv_tiles(D, 16, S, store)
    rows = [(f"q/k/v mode {tiles_text(default)} (default)", default)]
    return rows + [(f"q/k/v mode {tiles_text(t)}", t) for t in tiles if t != default]


def qkv_rows(D, S, ctx, ring, window, tiles, dev="cuda", timer=_timer, dtype=torch.bfloat16, splits=(None,),
             store: bool = True, merge: bool = False):
    """-> [(path, splits, rel err vs the twin, us)] for one layer and context (`timer(fn)` -> us), each
    path once per entry of `splits`: the cache's split count (None: the kernels' own pick; the q/k/v
    mode adds its own-rows split to it). store=False: a KV-shared (query-only) layer, its q rows
    alone, the cache only read. merge: the split tile's last program merges (no combine launch)."""
    from ..kernels.attention_tiles import pick_num_splits
    from ..kernels.gemv import sm_count
    from ..kernels.qkv_finish import qkv_finish

    qkv, q_w, k_w, cos, sin, k, v, idx, q_pos, slot_pos = qkv_inputs(D, S, ctx, ring, dev, dtype)
    if not store:
        qkv, k_w, idx = qkv[..., :H * D].contiguous(), None, None
    kw = dict(heads=H, eps=EPS)
    k2, v2 = k.clone(), v.clone()
    ref = decode_attention_qkv_ref(qkv, q_w, k_w, cos, sin, k2, v2, idx, q_pos, slot_pos, window, **kw).float()

    def err(out):
        return ((out.float() - ref).norm() / ref.norm()).item()

    sms = sm_count(torch.device(dev))
    own = 1 if store else 0  # the store layer's own-rows split
    rows = []
    for n in splits:
        def plain(n=n):
            q = qkv_finish(qkv, q_w, k_w, cos, sin, *((k, v, idx) if store else ()), **kw)
            return decode_attention(q, k, v, q_pos, slot_pos, window, num_splits=n, merge=merge)

        rows.append(("qkv_finish + split" + ("" if merge else " + combine"),
                     n or pick_num_splits(1, HKV, 1, S, _tiles(D, 16)[0], sms), err(plain()), timer(plain)))
        for name, t in qkv_paths(tiles, D, S, store):
            def fn(t=t, n=n):
                return decode_attention_qkv(qkv, q_w, k_w, cos, sin, k, v, idx, q_pos, slot_pos, window, tiles=t,
                                            num_splits=n, merge=merge, **kw)
            rows.append((name, (n or pick_num_splits(1, HKV, 1, S, t[0], sms)) + own, err(fn()), timer(fn)))
    return rows


def split_counts(name: str, text: str) -> list[int | None]:
    """'auto,2,...' -> [None, 2, ...] (None: the kernels' own pick), or exit naming the option."""
    try:
        out = [None if n.strip() == "auto" else int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        out = []
    if not out or any(n is not None and not 1 <= n <= 1024 for n in out):
        raise SystemExit(f"{name}: 'auto' or counts in 1..1024, got {text!r}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qkv", action="store_true", help="a store layer's attention with its q/k/v work, by path")
    ap.add_argument("--contexts", default="300,4096,16384,32768", help="full-layer contexts of --qkv (tokens)")
    ap.add_argument("--tiles", default="32x8s2,16x8s3,32x16s2",
                    help="q/k/v-mode tiles to time beside the default, BLOCKNxWARPSsSTAGES joined by ','")
    ap.add_argument("--splits", default="auto",
                    help="full-layer split counts of --qkv, joined by ',': 'auto' (the kernels' pick) or a number")
    ap.add_argument("--sliding-splits", default="auto",
                    help="the sliding ring's split counts of --qkv, joined by ',': 'auto' or a number")
    ap.add_argument("--query-only", action="store_true",
                    help="--qkv on KV-shared layers too: their q rows alone, the cache only read")
    ap.add_argument("--merge", action="store_true", help="--qkv: no combine launch (fuse.attn_merge)")
    ap.add_argument("--max-context", type=int, default=32784, help="full-layer cache slots (S)")
    a = ap.parse_args(argv)
    try:
        tiles = [parse_tiles(t) for t in a.tiles.split(",") if t.strip()]
        contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if any(c < 2 or c > a.max_context for c in contexts):
        raise SystemExit(f"--contexts must lie in 2..--max-context ({a.max_context}), got {contexts}")
    splits, ring_splits = split_counts("--splits", a.splits), split_counts("--sliding-splits", a.sliding_splits)
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention times Triton kernels on a CUDA GPU; none is visible")
    if not a.qkv:
        print("| layer | T | ctx | splits | rel err vs twin | us |")
        print("|---|---|---|---|---|---|")
        for T in (1, 8):
            for splits in (None, 1, 4):
                err, us = case(T, 256, 528, 800, True, 512, splits)
                print(f"| sliding D=256 S=528 | {T} | 800 | {splits or 'auto'} | {err:.2e} | {us:.1f} |")
            for ctx in (300, 4096, 32768):
                for splits in (None, 8, 32):
                    err, us = case(T, 512, 32784, ctx, False, 0, splits)
                    print(f"| full D=512 S=32784 | {T} | {ctx} | {splits or 'auto'} | {err:.2e} | {us:.1f} |")
        return
    print("| layer | ctx | path | splits | rel err vs twin | us |")
    print("|---|---|---|---|---|---|")
    layers = [("sliding D=256 ring 189, window 188", 256, 189, 800, True, 188)]
    layers += [(f"full D=512 S={a.max_context}", 512, a.max_context, c, False, 0) for c in contexts]
    for store in (True, False) if a.query_only else (True,):
        for name, D, S, ctx, ring, window in layers:
            name = name if store else name.replace(" ", " query-only ", 1)
            for path, n, err, us in qkv_rows(D, S, ctx, ring, window, tiles, splits=ring_splits if ring else splits,
                                             store=store, merge=a.merge):
                print(f"| {name} | {ctx} | {path} | {n} | {err:.2e} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
