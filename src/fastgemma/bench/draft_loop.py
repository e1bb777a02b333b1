"""The speculative draft loop on a GPU (not a test): the fused drafter step's k launches-per-token
loop against kernels/draft_loop.py's one persistent launch, and what a grid barrier costs.

E4B's drafter (synthetic weights with the exact shapes) over an E4B KV cache whose source layers
(22 sliding, 23 full) hold random K/V for `--context` positions, window `--window`:
- `fused step`: speculative decoding's `_draft_loop` with fuse=layers' drafter (fused GEMVs under
  PDL, the q norm + RoPE in the attention's split kernel, kernels/draft_head.py), compiled as the
  engine compiles it, in a CUDA graph;
- `draft_loop P=.. splits=..`: `DraftLoop` with that grid and key split, in a CUDA graph.
Each loop's drafts are compared with the fused step's on `--checks` random (token, hidden state)
inputs: the positions that agree until the first difference (a differing draft changes every later
input) and the largest difference of the last projected hidden state where all k agree.
`--barriers N` (first): a kernel of N grid barriers alone, us per barrier, per program count.
`--fp32-checks N`: the kernel in fp32 against the drafter's own torch step in fp32 (every draft
should agree: a check of the kernel itself, free of bf16 near-ties).
`--fused-table T` (repeatable): the fused step again, traced and compiled anew with the fused GEMVs'
tiles of table T (`fused_gemv.parse_fused_table`, e.g. '+draft_down=2x1024w4'), in the same process;
its drafts compared with the first fused step's. The drafter's shapes that no table holds are
autotuned on their first call, per process: the picks are printed.
Run: python -m fastgemma.bench.draft_loop [--depth 7] [--programs 132,66] [--splits 16,32]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ..kernels.draft_loop import SPIN_LIMIT, _leave, _sync


@triton.jit
def _barrier_kernel(bar_ptr, err_ptr, n, SPIN: tl.constexpr):
    nprog = tl.num_programs(0)
    nb = 0
    for _ in range(n):
        nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    _leave(bar_ptr, nprog)


def barrier_us(programs: int, n: int, timer, device) -> float:
    """us per grid barrier of `programs` programs (a launch of n barriers, the launch's own cost
    taken out with a launch of none)."""
    bar = torch.zeros(2, dtype=torch.int32, device=device)
    err = torch.zeros(1, dtype=torch.int32, device=device)
    run = lambda m: _barrier_kernel[(programs,)](bar, err, m, SPIN=SPIN_LIMIT, num_warps=4)  # noqa: E731
    ms_n, ms_0 = timer(lambda: run(n)), timer(lambda: run(0))
    if int(err.item()):
        raise RuntimeError(f"the barrier kernel gave up waiting with {programs} programs")
    return 1e3 * (ms_n - ms_0) / n


def _fill_cache(cache, sources, context: int, gen):
    """Random K / V in the drafter's source layers and the ring's positions as after `context` tokens."""
    for s in sources.values():
        for t in (cache.k[s], cache.v[s]):
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype))
    R = cache.ring
    slot_pos = torch.arange(context - R, context, device=cache.ring_pos.device)
    ring = torch.full((R,), -1, dtype=torch.int32, device=cache.ring_pos.device)
    ok = slot_pos >= 0
    ring[slot_pos[ok] % R] = slot_pos[ok].int()
    cache.ring_pos.copy_(ring[None])


def bench_draft_loop(depth: int = 7, context: int = 512, window: int = 188, checks: int = 16,
                     programs=(None,), splits=(None,), barriers: int = 0, fp32_checks: int = 4, compile: bool = True,
                     model: str = "gemma4_e4b", device: str = "cuda", dtype=torch.bfloat16,
                     fused_tables=()) -> list[dict]:
    """Print the tables; return a dict per barrier program count (with `barriers`), the fp32 check's
    (with `fp32_checks`), then one per loop: us per loop and per draft token, the checks' agreement
    with the fused step (`positions_equal` of `positions`, `loops_equal` of `checks`), `max_h_diff`;
    the fused step once more per (text, table) of `fused_tables` (`fused_gemv.parse_fused_table`'s
    tables; `table`: the text)."""
    from triton.testing import do_bench_cudagraph

    from ..engine.cache import KVCache
    from ..engine.compile import compile_step
    from ..engine.speculative import draft_steps
    from ..kernels import fused_gemv
    from ..kernels.decode_attention import decode_attention_op
    from ..kernels.draft_head import draft_head_op
    from ..kernels.draft_loop import DraftLoop
    from ..kernels.fused_gemv import fused_gemv_op
    from ..kernels.fused_w4a16 import fused_w4a16_op
    from ..model import preset
    from ..model.drafter import synthetic_drafter
    from ..transforms.fused_steps import fuse_drafter

    if not torch.cuda.is_available():
        raise RuntimeError("bench_draft_loop needs a CUDA device")
    dev = torch.device(device)
    timer = lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median")  # noqa: E731
    rows = []
    if barriers:
        n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
        print(f"grid barrier alone ({barriers} per launch, launch cost taken out), us per barrier:")
        for P in sorted({n_sm, n_sm // 2, n_sm // 4, 16, 1}, reverse=True):
            b = barrier_us(P, barriers, timer, dev)
            rows.append(dict(loop="barrier", programs=P, us_per_barrier=b))
            print(f"  {P:>4} programs: {b:.3f}")
    cfg = preset(model)
    if fp32_checks:
        rows.append(fp32_agreement(cfg, depth, context, window, fp32_checks, dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    emb = (0.03 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=dev)).to(dtype)
    cache = KVCache(cfg, 1, context + 16, window=window, device=dev, dtype=dtype)
    d = synthetic_drafter(cfg, dev, dtype, seed=0)
    _fill_cache(cache, d.sources, context, gen)
    d = fuse_drafter(d, gemv=fused_gemv_op, gemv4=fused_w4a16_op, pdl=True, head=draft_head_op, attn_pdl=True,
                     qkv_kernel=True, attn_qkv=True)
    pos = torch.full((1, 1), context, dtype=torch.long, device=dev)

    def fused_loop(tok, hid):
        return draft_steps(d, emb, cache, decode_attention_op, tok, hid, pos, depth)

    ref_fn = compile_step(fused_loop) if compile else fused_loop
    inputs = [(torch.randint(0, cfg.vocab_size, (1, 1), generator=gen, device=dev),
               torch.randn(1, 1, cfg.hidden_size, generator=gen, device=dev).to(dtype)) for _ in range(checks)]
    refs = [ref_fn(t, h) for t, h in inputs]
    tok0, hid0 = inputs[0]
    name = torch.cuda.get_device_name(dev)
    print(f"{name}  draft loop: {cfg.name} drafter, k={depth}, context {context}, window {window}, {dtype}; "
          f"CUDA graphs; agreement with the fused step on {checks} random inputs")
    print(f"{'loop':>30} | {'us / loop':>9} | {'us / token':>10} | {'positions equal':>15} | loops equal | max |h' diff|")
    us = 1e3 * timer(lambda: ref_fn(tok0, hid0))
    rows.append(dict(loop="fused step", programs=None, splits=None, us=us, us_per_token=us / depth,
                     positions_equal=checks * depth, positions=checks * depth, loops_equal=checks, max_h_diff=0.0))
    print(f"{'fused step' + (' (compiled)' if compile else ''):>30} | {us:9.1f} | {us / depth:10.2f} | "
          f"{'(reference)':>15} |             |")
    shipped = dict(fused_gemv.FUSED_CONFIGS)
    try:
        for text, table in fused_tables:
            fused_gemv.set_fused_table(table)
            torch._dynamo.reset()  # traced again: the tiles are read when the step is traced
            fn = compile_step(fused_loop) if compile else fused_loop
            eq = same = 0
            for (t, h), (rt, _) in zip(inputs, refs):
                agree = (fn(t, h)[0] == rt).long().cumprod(1).sum().item()
                eq += agree
                same += agree == depth
            us = 1e3 * timer(lambda: fn(tok0, hid0))
            rows.append(dict(loop="fused step", table=text, programs=None, splits=None, us=us, us_per_token=us / depth,
                             positions_equal=eq, positions=checks * depth, loops_equal=same, max_h_diff=None))
            print(f"{'fused step, ' + text:>30} | {us:9.1f} | {us / depth:10.2f} | {eq:>7}/{checks * depth:<7} | "
                  f"{same:>5}/{checks:<5} |")
    finally:
        fused_gemv.set_fused_table(shipped, forced=False)
    line = fused_gemv.picks_line(fused_gemv.tuned_picks())
    if line:
        print(line)
    for P in programs:
        for sp in splits:
            loop = DraftLoop(d, emb, cache, programs=P, splits=sp)
            eq = same = 0
            hdiff = 0.0
            for (t, h), (rt, rh) in zip(inputs, refs):
                out = loop(t, h, pos, depth)
                agree = (out == rt).long().cumprod(1).sum().item()
                eq += agree
                if agree == depth:
                    same += 1
                    hdiff = max(hdiff, (loop.hidden().float() - rh.float()).abs().max().item())
            loop.check()
            us = 1e3 * timer(lambda: loop(tok0, hid0, pos, depth))
            loop.check()
            label = f"draft_loop P={loop.P} splits={loop.meta['NSPL']}"
            rows.append(dict(loop=label, programs=loop.P, splits=loop.meta["NSPL"], us=us, us_per_token=us / depth,
                             positions_equal=eq, positions=checks * depth, loops_equal=same, max_h_diff=hdiff))
            print(f"{label:>30} | {us:9.1f} | {us / depth:10.2f} | {eq:>7}/{checks * depth:<7} | "
                  f"{same:>5}/{checks:<5} | {hdiff:.4g}")
    return rows


def fp32_agreement(cfg, depth: int, context: int, window: int, checks: int, dev) -> dict:
    """The kernel in fp32 against the drafter's own (unfused, torch) step in fp32 on the same GPU:
    the same arithmetic up to the order of fp32 sums, so every draft should agree."""
    from ..engine.cache import KVCache
    from ..engine.speculative import draft_steps
    from ..kernels.decode_attention import decode_attention_ref
    from ..kernels.draft_loop import DraftLoop
    from ..model.drafter import synthetic_drafter
    from ..transforms.fuse import MergeProjections

    gen = torch.Generator(device=dev).manual_seed(2)
    emb = 0.03 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=dev)
    cache = KVCache(cfg, 1, context + 16, window=window, device=dev, dtype=torch.float32)
    d = synthetic_drafter(cfg, dev, torch.float32, seed=0)
    MergeProjections(qkv=False).apply(d.model)
    _fill_cache(cache, d.sources, context, gen)
    pos = torch.full((1, 1), context, dtype=torch.long, device=dev)
    loop = DraftLoop(d, emb, cache)
    eq = 0
    hdiff = 0.0
    for _ in range(checks):
        tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=gen, device=dev)
        hid = torch.randn(1, 1, cfg.hidden_size, generator=gen, device=dev)
        out = loop(tok, hid, pos, depth)
        want, hid = draft_steps(d, emb, cache, decode_attention_ref, tok, hid, pos, depth)
        agree = (out == want).long().cumprod(1).sum().item()
        eq += agree
        if agree == depth:
            hdiff = max(hdiff, (loop.hidden() - hid).abs().max().item())
    loop.check()
    print(f"fp32, against the drafter's own step: positions equal {eq}/{checks * depth}, max |h' diff| {hdiff:.3g} "
          f"(|h'| max {hid.abs().max().item():.3g})")
    return dict(loop="fp32 agreement", positions_equal=eq, positions=checks * depth, max_h_diff=hdiff)


def _ints(s: str):
    return tuple(None if x in ("", "default") else int(x) for x in s.split(","))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=7, help="draft tokens per loop (k)")
    ap.add_argument("--context", type=int, default=512, help="positions before the drafts (the full layer's keys)")
    ap.add_argument("--window", type=int, default=188, help="sliding window of the cache")
    ap.add_argument("--checks", type=int, default=16, help="random inputs compared with the fused step")
    ap.add_argument("--programs", type=_ints, default=(None,),
                    help="grids to time, comma-separated (default: one program per multiprocessor)")
    ap.add_argument("--splits", type=_ints, default=(None,), help="the attention's key splits per KV head")
    ap.add_argument("--barriers", type=int, default=0, help="time N grid barriers alone per program count (0: skip)")
    ap.add_argument("--fp32-checks", type=int, default=4,
                    help="random inputs for the fp32 check against the drafter's own step (0: skip)")
    ap.add_argument("--no-compile", action="store_true", help="the fused step uncompiled")
    ap.add_argument("--fused-table", action="append", default=[],
                    help="the fused step again with the fused GEMVs' tiles of this table (bench.stack --fused-table's "
                         "form: entries CASE=NxKwW joined by ',', 'none', or '+' then entries: the shipped table with "
                         "those changed; the drafter's cases are 'draft_...'); repeated: one row each, in one process")
    ap.add_argument("--model", default="gemma4_e4b")
    a = ap.parse_args(argv)
    from .stack import fused_table_arg

    tables = [(t, fused_table_arg(t)) for t in a.fused_table]  # before any work
    bench_draft_loop(a.depth, a.context, a.window, a.checks, a.programs, a.splits, a.barriers, a.fp32_checks,
                     compile=not a.no_compile, model=a.model, fused_tables=tables)


if __name__ == "__main__":
    main()
