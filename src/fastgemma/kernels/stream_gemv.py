"""The one-row fused GEMV as a persistent stream: a few programs per multiprocessor walk the tiles.

kernels/fused_gemv.py launches one program per row tile: E4B's bf16 gate|up is 2,560 programs of 8
rows, and a phase of 2,560 programs costs ~4.9 us of boundary against ~1.6 at 264 (run GX's phase
floor). Here `per_sm` programs a multiprocessor take tiles pid, pid + P, pid + 2P, ... in turn. A
program loads its first `depth` weight blocks before its PDL wait, computes the prologue's norms and
its input x once (not once per tile), and keeps `depth` blocks in flight across tile boundaries
while it multiplies (a rotating set of registers: block j + depth is asked for as block j is used).
Prologues, epilogues and rounding points are kernels/fused_gemv.py's; its twin, `fused_gemv_ref`,
is this kernel's. `fused_gemv` runs this kernel when its config has `per_sm` > 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemv
from .fused_gemv import _aux_rows, _finish, _h_store, _pro_params, _prologue_scalars, _rows, _x_block
from .gemv import _pdl_trigger, _pdl_wait


@triton.jit
def _block(w_ptr, stride_wn, j, pid, P, N, HALF, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           EPI: tl.constexpr, NKB: tl.constexpr):
    """Block j of the program's stream: K block j % NKB of tile pid + (j // NKB) P (none past the
    last tile: its rows are masked)."""
    rows, n_ok = _rows(pid + (j // NKB) * P, N, HALF, BLOCK_N, EPI)
    k = (j % NKB) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = n_ok[:, None] & (k < K)[None, :]
    return tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=ok, other=0.0)


@triton.jit
def _stream_gemv_kernel(a_ptr, y_ptr, post_ptr, scale_ptr, pre_ptr, h_ptr, w_ptr, aux_ptr, out_ptr,
                        N, HALF, stride_wn, eps, off, NT: tl.constexpr, P: tl.constexpr,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
                        HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr, EPI: tl.constexpr, PDL: tl.constexpr,
                        DEPTH: tl.constexpr):
    _pdl_trigger(PDL)
    pid = tl.program_id(0)  # of P programs, NT tiles
    NKB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    buf = ()  # the next DEPTH blocks of the stream, asked for before the wait
    for i in tl.static_range(DEPTH):
        buf = buf + (_block(w_ptr, stride_wn, i, pid, P, N, HALF, K, BLOCK_N, BLOCK_K, EPI, NKB),)
    offs_k = tl.arange(0, BLOCK_K)
    params = _pro_params(post_ptr, pre_ptr, scale_ptr, offs_k, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE)
    _pdl_wait(PDL)  # the previous kernels' outputs are visible from here on
    DT: tl.constexpr = out_ptr.dtype.element_ty
    inv_y, inv_x = _prologue_scalars(a_ptr, y_ptr, params, eps, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    xs = ()  # the GEMV's input, once per program, in DT (its values are rounded to DT: exact)
    for kb in tl.static_range(NKB):
        xs = xs + (_x_block(a_ptr, y_ptr, params, kb, offs_k, inv_y, inv_x, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE,
                            DT).to(DT),)
    _h_store(pid, a_ptr, y_ptr, params, h_ptr, inv_y, off, K, BLOCK_K, PRO, HAS_SCALE, DT)  # program 0's first tile
    j = 0  # the stream's block at the tile's start
    for i in range(0, NT, P):  # every program the same rounds; tiles past the last are masked
        t = pid + i
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for kb in tl.static_range(NKB):
            w = buf[0]
            nxt = _block(w_ptr, stride_wn, j + kb + DEPTH, pid, P, N, HALF, K, BLOCK_N, BLOCK_K, EPI, NKB)
            rot = ()
            for d in tl.static_range(1, DEPTH):
                rot = rot + (buf[d],)
            buf = rot + (nxt,)
            acc += w.to(tl.float32) * xs[kb].to(tl.float32)[None, :]
        j += NKB
        rows, n_ok = _rows(t, N, HALF, BLOCK_N, EPI)
        _finish(tl.sum(acc, axis=1), rows, n_ok, t, _aux_rows(aux_ptr, rows, n_ok, EPI), out_ptr, HALF, BLOCK_N, EPI,
                DT)


def launch_stream(args, flags: dict, n_tiles: int, cfg, device) -> None:
    """fused_gemv's launch of this kernel: min(tiles, per_sm x SMs) programs."""
    programs = min(n_tiles, cfg.per_sm * gemv.sm_count(device))
    _stream_gemv_kernel[(programs,)](*args, NT=n_tiles, P=programs, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                     DEPTH=cfg.depth, num_warps=cfg.num_warps, num_stages=1, **flags)


# ---------------------------------------------------------------------------------------------
# benchmark (CUDA only; not a test)

def _case_kwargs(prologue: bool, epilogue: str, K: int, N: int, vec) -> dict:
    """A FUSED_CASES key's prologue / epilogue inputs (vec(n) -> a [1, n] activation)."""
    if not prologue:
        return dict(epilogue=epilogue)
    kw = dict(y=vec(K), post=vec(K), epilogue=epilogue)
    if epilogue == "gelu_mul":
        kw["aux"] = vec(N)
    else:
        kw["pre"] = vec(K)
    if epilogue == "none":
        kw["scale"] = vec(1)
    return kw


def bench_stream(cases: dict | None = None, tiles: list[str] | None = None, dtype=torch.bfloat16, timer=None,
                 device: str = "cuda", pdl: bool = True) -> list[dict]:
    """Each fused one-row GEMV case (name -> fused_gemv.FUSED_CASES' key; default its gate|up and down) on
    the shipped table's tiles and on each of `tiles` ('NxKwW[pPdD]'), weights rotated out of L2, every
    output checked against the twin first. Prints a table and, last, a `--fused-table` value with each
    case's fastest tiles ('+CASE=..', the shipped table otherwise); returns one dict per (case, tiles)."""
    from .bench_util import WRONG_REL_ERR, max_rel_err, rotated_copies, timed_candidate, timer_or_graphs
    from .fused_gemv import FUSED_CASES, FUSED_CONFIGS, fused_gemv, fused_gemv_ref, parse_tiles
    from .gemv import resolve_config

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench_stream")
    gen = torch.Generator(device=dev).manual_seed(0)
    vec = lambda n: torch.randn(1, n, device=dev, dtype=dtype, generator=gen)  # noqa: E731
    rows, best = [], {}
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}  fused one-row GEMV, "
          f"{'PDL' if pdl else 'plain launch'}, {dtype} (us; weights rotated out of L2)")
    print(f"{'case':>16} {'tiles':>14} | {'us':>8} | {'TB/s':>5} | vs twin")
    for name, key in (cases or {n: FUSED_CASES[n] for n in ("gate|up", "down")}).items():
        N, K, prologue, epilogue = key
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * K ** -0.5
        kw = dict(eps=1e-6, pdl=pdl, **_case_kwargs(prologue, epilogue, K, N, vec))
        a = vec(K)
        ref = fused_gemv_ref(a, w, **kw)[0]
        bufs = rotated_copies(w)
        shipped = FUSED_CONFIGS.get(key)
        for label, cfg in [("shipped", shipped)] + [(t, parse_tiles(t)) for t in tiles or []]:
            cfg = resolve_config(N, K, cfg)
            run = timed_candidate(lambda w_, c=cfg: fused_gemv(a, w_, config=c, **kw)[0], bufs, timer, label)
            if run is None:
                continue
            got, us = run
            err = max_rel_err(got, ref)
            ok = err < WRONG_REL_ERR
            tbs = w.numel() * w.element_size() / us / 1e6
            rows.append(dict(case=name, tiles=label, config=cfg, us=us, tb_s=tbs, max_rel_err=err, ok=ok))
            print(f"{name:>16} {label:>14} | {us:8.2f} | {tbs:5.2f} | {'ok' if ok else 'WRONG'} {err:.1e}")
            if ok and (name not in best or us < best[name][0]):
                best[name] = (us, label)
        del bufs
    picks = [f"{n.replace(' ', '_')}={t}" for n, (_, t) in best.items() if t != "shipped"]
    print(f"fused table: +{','.join(picks)}" if picks else "fused table: default")
    return rows


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="the fused one-row GEMV's streamed tiles against the shipped ones")
    ap.add_argument("--cases", default="gate|up,down",
                    help="names of kernels/fused_gemv.FUSED_CASES ('_' for their spaces), joined by ','")
    ap.add_argument("--tiles", default="8x512w4p2d8,8x512w8p1d8,8x1024w8p1d4,2x1024w4p2d8,4x1024w8p1d4",
                    help="'NxKwW[pPdD]' joined by ',' (tiles a case cannot take are skipped)")
    a = ap.parse_args(argv)
    from .fused_gemv import FUSED_CASES

    names = [c.replace("_", " ") for c in a.cases.split(",") if c]
    if bad := [n for n in names if n not in FUSED_CASES]:
        raise SystemExit(f"--cases: {bad} not among {sorted(FUSED_CASES)}")
    bench_stream({n: FUSED_CASES[n] for n in names}, [t for t in a.tiles.split(",") if t])


if __name__ == "__main__":
    main()
