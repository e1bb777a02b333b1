"""LM-head benchmark on a CUDA GPU (not a test): the E4B head (262,144 x 2560) and its cheaper forms.

Rows timed (CUDA graphs, weights rotated out of L2, median of repeats):
- full bf16: cuBLAS GEMV alone; + softcap + argmax (sampler=argmax); the fused argmax kernel.
- int8 (per-row scales) and int4 (w4a16, group 128): logits, and the pick (the fused kernel; int8 at one row:
  the rows as int32 words, against the element loop; int4: the w4a16 GEMV with the argmax in its store at one
  row, against its GEMV, then torch's argmax and gather).
- pruned 12,288 / 16,384 / 32,768 rows in bf16: GEMV + argmax + id gather (torch), the scatter path
  (compute_logits: -inf fill + index_copy + argmax over V), the fused kernel; int8 / int4 at 12,288.
Run: python -m fastgemma.bench.head [--m 1 4] [--sweep]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from ..kernels.sparse_argmax import HeadArgmaxConfig, head_argmax, head_raw_torch
from ..transforms.lm_head import DenseRows, Int4Rows, Int8Rows

V, K = 262144, 2560
CAP = 30.0


def _candidates(M: int) -> list[HeadArgmaxConfig]:
    if M == 1:
        return [HeadArgmaxConfig(bn, bk, 1, w, 3) for bn in (8, 16, 32) for bk in (128, 256, 512) for w in (4, 8)]
    return [HeadArgmaxConfig(bn, bk, 16, w, s)
            for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8) for s in (3, 4)]


def bench_head(ms=(1,), rows=(12288, 16384, 32768), dtype=torch.bfloat16, sweep: bool = False,
               rep_ms: int = 50, device: str = "cuda", vocab: int = V, hidden: int = K, group_size: int = 128,
               timer=None) -> list[dict]:
    """Print a table and return one dict per (case, M): us, GB/s of weight bytes, speed-up over the
    full GEMV, and whether the ids equal the torch reference on the same rows. `timer(fn) -> ms`
    defaults to triton's do_bench_cudagraph (tests pass their own, with a CPU and a tiny head)."""
    dev = torch.device(device)
    if timer is None:
        from triton.testing import do_bench_cudagraph

        if not torch.cuda.is_available():
            raise RuntimeError("bench_head needs a CUDA device")
        timer = lambda fn: do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")  # noqa: E731
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 0
    V, K = vocab, hidden
    gen = torch.Generator(device=dev).manual_seed(0)
    emb = torch.randn(V, K, device=dev, dtype=dtype, generator=gen) * 0.02
    keeps = {n: torch.randperm(V, device=dev, generator=gen)[:n].sort().values for n in rows}

    def copies(head) -> list:
        n = max(2, math.ceil(2 * l2 / head.nbytes()))  # one pass over all copies > 2 x L2
        return [head] + [_clone(head) for _ in range(n - 1)]

    def timed(fn_of_head, heads):
        state = {"i": 0}

        def fn():
            state["i"] = (state["i"] + 1) % len(heads)
            return fn_of_head(heads[state["i"]])
        return 1e3 * timer(fn)

    dname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    cases = [("full", None, dname, DenseRows(emb, V, CAP, None, "triton")),
             ("full", None, "int8", Int8Rows.from_weight(emb, V, CAP, None, "triton")),
             ("full", None, "int4", Int4Rows(emb, V, CAP, None, group_size, "triton"))]
    for n in rows:
        rows_n = emb.index_select(0, keeps[n])
        cases.append((f"pruned {n}", keeps[n], dname, DenseRows(rows_n, V, CAP, keeps[n], "triton")))
    n0 = rows[0]
    rows0, k0 = emb.index_select(0, keeps[n0]), keeps[n0]
    cases.append((f"pruned {n0}", k0, "int8", Int8Rows.from_weight(rows0, V, CAP, k0, "triton")))
    cases.append((f"pruned {n0}", k0, "int4", Int4Rows(rows0, V, CAP, k0, group_size, "triton")))

    out, base = [], {}
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print(f"{where}  head {V} x {K}  {dtype}  CUDA graphs, weights rotated out of L2")
    print(f"{'head':>14} {'rows':>6} {'M':>3} {'path':>22} | {'us':>8} {'GB/s':>6} {'x full':>7} | ids ok | config")
    for M in ms:
        x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
        for name, keep, kind, head in cases:
            heads = copies(head)
            wbytes = head.nbytes()
            ref = _ref_ids(head, x)
            paths = []
            if kind == dname:
                paths.append(("GEMV (cuBLAS)", lambda h: F.linear(x, h.weight), None))
            if keep is None and kind == dname:  # sampler=argmax on the plain tied head
                paths.append(("compute_logits+argmax", lambda h: _plain_logits(h, x).argmax(-1), None))
            elif keep is None:
                paths.append(("compute_logits+argmax", lambda h: h(x).argmax(-1), None))
            else:
                paths.append(("GEMV+argmax+gather", lambda h: _torch_pick(h, x), None))
                paths.append(("scatter+argmax(V)", lambda h: h(x).argmax(-1), None))
            if kind == "int4":  # the pick before the GEMV's argmax store: its outputs, then torch's argmax
                paths.append(("int4 GEMV, then argmax", lambda h: _two_step_int4(h, x), None))
            if kind == "int8" and M == 1:  # the one-row loop element by element, as before the word loop
                paths.append(("fused ids, int8 elements", lambda h: _int8_elements(h, x), None))
            buf = head.new_logits(M, dev)
            paths.append(("fused (+logits)", lambda h: h.pick(x, buf), None))
            paths.append(("fused (ids only)", lambda h: h.pick(x), None))
            if kind != "int4":
                if sweep:
                    for cfg in _candidates(M):
                        paths.append(("fused ids, sweep", lambda h, c=cfg: _pick_cfg(h, x, c), cfg))
            for path, fn, cfg in paths:
                try:
                    us = timed(fn, heads)
                    got = fn(head)
                except Exception as e:  # a sweep candidate out of resources: skip it
                    print(f"    skip {path} {cfg}: {type(e).__name__}")
                    continue
                ok = None if path.startswith("GEMV (") else bool(torch.equal(got.reshape(-1), ref))
                if (name, kind, path) == ("full", dname, "GEMV (cuBLAS)"):
                    base[M] = us
                row = dict(head=name, dtype=kind, M=M, path=path, us=us, gbs=wbytes / us / 1e3,
                           speedup=base.get(M, us) / us, ids_ok=ok, config=cfg)
                out.append(row)
                print(f"{name + ' ' + kind:>14} {head.rows:>6} {M:>3} {path:>22} | "
                      f"{us:8.1f} {row['gbs']:6.0f} {row['speedup']:7.2f} | {str(ok):>6} | {cfg or ''}")
            del heads
    return out


def _plain_logits(head, x):
    # Gemma4Model.compute_logits on the tied head
    return torch.tanh(F.linear(x, head.weight).float() / CAP) * CAP


def _ref_ids(head, x):
    if isinstance(head, Int4Rows):
        raw = head.raw(x, "torch")
    else:
        w = head.weight if isinstance(head, DenseRows) else head.qweight
        raw = head_raw_torch(x, w, getattr(head, "scales", None) if isinstance(head, Int8Rows) else None)
    idx = raw.argmax(-1)
    return head.keep_ids[idx] if head.keep_ids is not None else idx


def _torch_pick(head, x):
    return head.pick(x, None, "torch") if not isinstance(head, Int4Rows) else _two_step_int4(head, x)


def _int8_elements(head, x):
    from ..kernels import sparse_argmax

    sparse_argmax.INT8_WORDS = False  # read at launch: the graph the timer captures keeps the element loop
    try:
        return head.pick(x)
    finally:
        sparse_argmax.INT8_WORDS = True


def _two_step_int4(head, x):
    # the w4a16 GEMV's outputs (its own kernel), then argmax and the keepset's gather in torch
    idx = head.raw(x).argmax(-1)
    return head.keep_ids[idx] if head.keep_ids is not None else idx


def _pick_cfg(head, x, cfg):
    w = head.weight if isinstance(head, DenseRows) else head.qweight
    scales = head.scales if isinstance(head, Int8Rows) else None
    return head_argmax(x, w, head.keep_ids, scales=scales, softcap=head.softcap, config=cfg)


def _clone(head):
    import copy

    return copy.deepcopy(head)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1], help="rows of x (1 decode, up to 16 verify)")
    ap.add_argument("--rows", type=int, nargs="+", default=[12288, 16384, 32768], help="pruned head sizes")
    ap.add_argument("--sweep", action="store_true", help="also try fused-kernel tile candidates")
    a = ap.parse_args()
    bench_head(tuple(a.m), tuple(a.rows), sweep=a.sweep)


if __name__ == "__main__":
    main()
