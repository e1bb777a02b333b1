"""Batch invariance on the GPU, E4B shapes, bf16: is each kernel's row the same bits at one row and
among `--rows` rows, and is every row of a verify pass the one-row step's (fuse.batch_invariant)?

    python -m fastgemma.bench.invariance --rows 8

Kernels (random inputs, each row alone vs all rows in one launch): the tensor-core int4 kernel on
every shape of its table at the one-row config (GeGLU on gate|up), the skinny GEMM and the rows GEMV
(the fused steps' PLE gate) with the PLE gate's gelu * input, kernels/residual_norm.py, the attention
with its row tiles per group of positions (sliding ring and full layers), the head's fused argmax at
its row-invariant config; for contrast the same launches as the engine's default path runs them (the
8-row table entry, the default tiles). Then
the whole step: the synthetic E4B int4 stack (pruned head, `--variant`), a prompt prefilled twice,
one k+1-row pass against k+1 one-row steps over the same tokens, eager and compiled. Prints one
JSON line per check and a table last; `bit_equal` is what matters, `max_abs_diff` says by how much.
"""
from __future__ import annotations

import argparse
import json

import torch


def _diff(a, b) -> dict:
    a, b = a.float(), b.float()
    return dict(bit_equal=bool(torch.equal(a, b)), max_abs_diff=float((a - b).abs().max().item()))


def _rows_vs_one(fn, x, *rest) -> dict:
    """fn(x[M], *rest[M]) against fn on each row alone (rest: tensors with the same leading rows, or None)."""
    wide = fn(x, *rest)
    ones = torch.cat([fn(x[i:i + 1], *[r[i:i + 1] if torch.is_tensor(r) else r for r in rest])
                      for i in range(x.shape[0])])
    return _diff(wide, ones)


def _randn(dev):
    """rnd(*shape, scale=1.0) -> seeded bf16 normals on dev."""
    g = torch.Generator(device=dev).manual_seed(0)
    return lambda *shape, scale=1.0: torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16) * scale


def _int4(N: int, K: int, rnd, dev, geglu: bool = False):
    """An Int4Linear (g128) of random weights with its tensor-core copy (a GeGLU weight in the layout the
    table's entries take)."""
    from ..kernels.mma_table import table_pairs
    from ..transforms.quant import Int4Linear

    lin = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(rnd(N, K, scale=K ** -0.5))
    mod = Int4Linear.from_linear(lin, 128).to(dev)
    mod.enable_mma(pairs=geglu and table_pairs(N, K))
    return mod


# (name, head dim, slots, window, ring): a sliding layer's ring at window 188, a full layer's cache
ATTENTION_CASES = (("sliding ring", 256, 204, 188, True), ("full", 512, 1024, 0, False))


def _kv(D: int, S: int, ring: bool, last: int, rnd, dev):
    """k, v [1, S, 2, D] and the slots' positions (a ring holding the last S positions, or None)."""
    k, v = rnd(1, S, 2, D, scale=D ** -0.25), rnd(1, S, 2, D)
    slot_pos = None
    if ring:
        slot_pos = torch.full((1, S), -1, dtype=torch.int32, device=dev)
        p = torch.arange(last - S + 1, last + 1, device=dev)
        slot_pos[0, p % S] = p.to(torch.int32)
    return k, v, slot_pos


def kernel_checks(M: int, dev: str) -> list[dict]:
    from ..kernels import mma_table
    from ..kernels.decode_attention import decode_attention
    from ..kernels.fused_w4a16 import E4B_CASES
    from ..kernels.residual_norm import residual_norm
    from ..kernels.rows_gemv import rows_gemv
    from ..kernels.skinny_gemm import skinny_matmul
    from ..kernels.sparse_argmax import ROW_INVARIANT_CONFIG, default_config, head_argmax
    from ..transforms.fused_layer_ops import _mma_call

    rnd = _randn(dev)
    names = {(N, K): name for name, (N, K, _) in E4B_CASES.items()}
    out = []
    shapes = sorted({(N, K) for N, K, many in mma_table.MMA_CONFIGS if not many} | set(mma_table.INVARIANT_CONFIGS))
    for N, K in shapes:
        epi = "geglu" if N == 20480 else "none"
        mod = _int4(N, K, rnd, dev, epi == "geglu")
        x = rnd(M, K)
        for inv in (True, False):
            if not inv and mma_table.mma_config(N, K, M, epi) is None:  # no M-row entry: not the engine's path
                continue
            row = _rows_vs_one(lambda t: _mma_call(mod, t, epi, False, invariant=inv), x)
            out.append(dict(check=f"int4 mma {names.get((N, K), (N, K))}", config="invariant" if inv else "default",
                            **row))

    w, x, aux = rnd(256, 2560, scale=0.02), rnd(M, 2560), rnd(M, 256)
    out.append(dict(check="skinny PLE gate + gelu*input", config="default",
                    **_rows_vs_one(lambda t, a: skinny_matmul(t, w, epilogue="gelu_mul", aux=a), x, aux)))
    out.append(dict(check="rows GEMV PLE gate + gelu*input", config="default",
                    **_rows_vs_one(lambda t, a: rows_gemv(t, w, "gelu_mul", a), x, aux)))
    a, y = rnd(M, 2560), rnd(M, 2560)
    post, pre = rnd(2560, scale=0.1) + 1, rnd(2560, scale=0.1) + 1
    scale = torch.tensor([0.7], device=dev, dtype=torch.bfloat16)
    out.append(dict(check="residual_norm", config="default", **_rows_vs_one(
        lambda t, u: residual_norm(t, u, post, scale, pre, eps=1e-6)[1], a, y)))
    for name, D, S, window, ring in ATTENTION_CASES:
        last = 700
        q, (k, v, slot_pos) = rnd(1, M, 8, D), _kv(D, S, ring, last, rnd, dev)
        q_pos = torch.arange(last - M + 1, last + 1, device=dev)[None]
        for per in (True, False):
            wide = decode_attention(q, k, v, q_pos, slot_pos, window, per_position=per)
            # (per-position: against one-row per-position launches, the AR step's under the switch)
            ones = torch.cat([decode_attention(q[:, i:i + 1], k, v, q_pos[:, i:i + 1], slot_pos, window,
                                               per_position=per) for i in range(M)], 1)
            out.append(dict(check=f"attention {name} D={D}", config="per-position" if per else "default",
                            **_diff(wide, ones)))
    w = rnd(12288, 2560, scale=0.02)
    x = rnd(M, 2560)
    for cfg_name, cfg in (("row-invariant", ROW_INVARIANT_CONFIG), ("default", None)):
        def logits(t, cfg=cfg):
            buf = torch.full((t.shape[0], 12288), float("-inf"), device=dev)
            head_argmax(t, w, logits_out=buf, softcap=30.0, config=cfg or default_config(t.shape[0]))
            return buf
        out.append(dict(check="pruned head 12,288 rows", config=cfg_name, **_rows_vs_one(logits, x)))
    return out


def kernel_times(M: int, dev: str) -> list[dict]:
    """us per launch at 1 and M rows (CUDA graphs, weights rotated out of L2): each int4 shape on the
    switch's config against the default path's launch (the M-row table entry, or the per-group /
    GEMV kernel where the table has none), the attention with per-position tiles against the
    default tiles, the pruned head at the row-invariant config against the default one."""
    from ..kernels import mma_table, mma_w4a16
    from ..kernels.bench_util import copies_past_l2, rotating, timer
    from ..kernels.decode_attention import decode_attention
    from ..kernels.fused_w4a16 import E4B_CASES
    from ..kernels.sparse_argmax import ROW_INVARIANT_CONFIG, default_config, head_argmax
    from ..kernels.w4a16 import w4a16_matmul

    us = timer(True, 10)
    rnd = _randn(dev)
    out = []
    for name, (N, K, mode) in E4B_CASES.items():
        epi = "geglu" if mode == "geglu" else "none"
        mod = _int4(N, K, rnd, dev, epi == "geglu")
        n = copies_past_l2(mod.mma_words.numel() * mod.mma_words.element_size(), dev)
        mma_bufs = [(mod.mma_words.clone(), mod.mma_sz.clone()) for _ in range(n)]
        std_bufs = [(mod.qweight.clone(), mod.scales.clone(), mod.zeros.clone(), mod.sz) for _ in range(n)]
        for m in (1, M):
            x = rnd(m, K)

            def mma(cfg, x=x):
                return rotating(mma_bufs, lambda w, sz: mma_w4a16.mma_w4a16_op(
                    x, w, sz, N, 128, epi, *mma_w4a16.config_args(cfg), False))
            inv = mma_table.mma_config(N, K, m, epi, invariant=True)
            cfg = mma_table.mma_config(N, K, m, epi)
            if cfg is not None:
                default, what = us(mma(cfg)), f"mma {cfg}"
            else:
                default = us(rotating(std_bufs, lambda q, s_, z, sz, x=x: w4a16_matmul(
                    x, q, s_, z, 128, None, epi, None, sz)))
                what = "w4a16 kernel"
            out.append(dict(check=f"int4 {name}", rows=m, invariant_us=us(mma(inv)), default_us=default,
                            default=what))
    for name, D, S, window, ring in ATTENTION_CASES:
        last = 700
        k, v, slot_pos = _kv(D, S, ring, last, rnd, dev)
        for m in (1, M):
            q = rnd(1, m, 8, D)
            q_pos = torch.arange(last - m + 1, last + 1, device=dev)[None]
            t = [us(lambda per=per: decode_attention(q, k, v, q_pos, slot_pos, window, per_position=per))
                 for per in (True, False)]
            out.append(dict(check=f"attention {name} D={D}", rows=m, invariant_us=t[0], default_us=t[1],
                            default="row tiles over all rows"))
    n = copies_past_l2(12288 * 2560 * 2, dev)
    ws = [(rnd(12288, 2560, scale=0.02),) for _ in range(n)]
    for m in (1, M):
        x = rnd(m, 2560)
        buf = torch.full((m, 12288), float("-inf"), device=dev)
        t = [us(rotating(ws, lambda w, c=c: head_argmax(x, w, logits_out=buf, softcap=30.0, config=c)))
             for c in (ROW_INVARIANT_CONFIG, default_config(m))]
        out.append(dict(check="pruned head 12,288 rows", rows=m, invariant_us=t[0], default_us=t[1],
                        default=str(default_config(m))))
    return out


def step_checks(M: int, dev: str, variant: str, head: str, prompt_len: int, compile_: bool) -> list[dict]:
    """One M-row pass against M one-row steps over the same tokens, after the same prompt."""
    from ..engine.cache import KVCache
    from ..engine.compile import compile_step
    from ..engine.generator import Generator
    from ..model.config import preset
    from .spec import build_stack

    cfg = preset("gemma4_e4b")
    model, sampler, _ = build_stack(cfg, dev, head, torch.bfloat16, fuse=True, variant=variant)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (1, prompt_len), generator=g).to(dev)
    toks = torch.randint(3, cfg.vocab_size, (1, M), generator=g).to(dev)
    out = []
    for compiled in ((False, True) if compile_ else (False,)):
        step = compile_step(model.step) if compiled else model.step
        caches = [KVCache(cfg, 1, prompt_len + 64, window=188, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        for c in caches:
            Generator(model, c, prefill_chunk=2048).prefill(prompt)
        with torch.inference_mode():
            wide = step(toks, torch.arange(prompt_len, prompt_len + M, device=dev)[None], caches[0]).clone()
            ones = torch.cat([step(toks[:, i:i + 1], torch.tensor([[prompt_len + i]], device=dev), caches[1]).clone()
                              for i in range(M)], 1)
            _, lw = sampler(model, wide.reshape(M, 1, -1))
            lw = lw.clone()
            l1 = torch.cat([sampler(model, ones[:, i:i + 1])[1].clone() for i in range(M)])
        name = f"E4B step {'compiled' if compiled else 'eager'}"
        out.append(dict(check=f"{name}: hidden", config=variant, **_diff(wide, ones)))
        keep = torch.isfinite(lw[0])
        top_w, top_1 = lw[:, keep].argmax(-1), l1[:, keep].argmax(-1)
        out.append(dict(check=f"{name}: logits", config=variant, top1_agree=float((top_w == top_1).float().mean()),
                        **_diff(lw[:, keep], l1[:, keep])))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8, help="rows of the wide launch (a k=7 verify pass: 8)")
    ap.add_argument("--variant", default="attn_pdl+qkv+mma+inv", help="the fused step's options (bench.stack)")
    ap.add_argument("--head", default="pruned:12288")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--no-step", dest="step", action="store_false", help="the kernels only")
    ap.add_argument("--compile", action="store_true", help="the step compiled too (slow)")
    ap.add_argument("--time", action="store_true", help="also time each kernel at 1 and --rows rows, both configs")
    ap.add_argument("--mma-table", default="",
                    help="the tensor-core int4 kernel's table for this run, as bench.spec --mma-table takes it "
                         "(e.g. '+down@1=cuda5x10c8': the CUDA down checked in its place)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fastgemma.bench.invariance checks the GPU's kernels; no CUDA device here")
    if a.mma_table:
        from ..kernels.mma_table import set_table
        from .stack import mma_table_arg

        set_table(mma_table_arg(a.mma_table))
    from ..kernels.mma_table import settle_cuda_entries

    for line in settle_cuda_entries("cuda"):  # as FuseLayers does: the Triton entry where CUDA's cannot run
        print(f"the CUDA entry {line}", flush=True)
    rows = kernel_checks(a.rows, "cuda")
    for r in rows:
        print(json.dumps(r), flush=True)
    if a.step:
        more = step_checks(a.rows, "cuda", a.variant, a.head, a.prompt_len, a.compile)
        for r in more:
            print(json.dumps(r), flush=True)
        rows += more
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    times = kernel_times(a.rows, "cuda") if a.time else []
    for r in times:
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in times)
    if times:
        print("\n| kernel | rows | batch-invariant config us | default path us | default path |\n|---|---|---|---|---|")
        for r in times:
            print(f"| {r['check']} | {r['rows']} | {r['invariant_us']:.2f} | {r['default_us']:.2f} | {r['default']} |")
    print(f"\n{torch.cuda.get_device_name()}, {a.rows} rows vs one row at a time, bf16\n")
    print("| check | config | bit-equal | max abs diff | top-1 agree |\n|---|---|---|---|---|")
    for r in rows:
        top = r.get("top1_agree")
        print(f"| {r['check']} | {r['config']} | {'yes' if r['bit_equal'] else 'NO'} | {r['max_abs_diff']:.3g} | "
              f"{'' if top is None else f'{top:.4f}'} |")


if __name__ == "__main__":
    main()
