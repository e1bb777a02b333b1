"""The verify pass's own kernels of one step, alone, chained, in one CUDA graph: plain launches
against programmatic dependent launch (PDL).

    python -m fastgemma.bench.verify_chain --rows 8 --rounds 3

Per layer of the model (E4B by default), in `fused_verify`'s order and at its shapes: the residual
update + input norm (kernels/residual_norm.py), the int4 q|k|v GEMM (q on KV-shared layers), o
(reading q|k|v's first columns where the attention would sit), the residual update + norm, gate|up
with GeGLU, down, the residual update, the dense PLE gate with gelu * PLE input (the skinny GEMM),
the PLE projection. Weights: random int4 codes with 16-bit scales / zeros (packed words), g128.
The attention is left out, and so are the q/k norms and RoPE unless --qkv-kernel puts
kernels/qkv_finish.py between q|k|v and o (its q, in place of the attention output, feeds o).
Each variant is captured once and replayed; the variants alternate for --rounds rounds (the
machine's state drifts between back-to-back timings), and every round's output must be
bit-identical to the first plain one (same arithmetic: a race under PDL would show). Prints one
JSON line per timing (--out: JSONL) and a markdown table last.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from ..kernels.int4_pack import pack_scale_zero
from ..kernels.qkv_finish import qkv_finish, qkv_finish_ref
from ..kernels.residual_norm import residual_norm, residual_norm_ref
from ..kernels.skinny_gemm import skinny_matmul, skinny_matmul_ref
from ..kernels.w4a16 import w4a16_matmul, w4a16_torch
from ..model.config import preset
from .chain import time_graph


def _int4(n: int, k: int, group: int, dtype, device, g) -> tuple:
    qw = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=g)
    s = (torch.rand(k // group, n, device=device, generator=g) * 0.002 + 0.001).to(dtype)
    z = (-8 * s.float()).to(dtype)
    return qw, s, z, group, pack_scale_zero(s, z) if dtype != torch.float32 else None


def build_layers(cfg, device, group: int = 128, dtype=torch.bfloat16, seed: int = 0) -> list[dict]:
    """Per layer: int4 (qweight, scales, zeros, group, sz) of q|k|v, o, gate|up, down and the PLE
    projection, the dense PLE gate, and q's width."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, out = cfg.hidden_size, []
    for s in cfg.layer_specs():
        q = cfg.num_heads * s.head_dim
        kv = 2 * s.num_kv_heads * s.head_dim if s.stores_kv else 0
        w = [_int4(n, k, group, dtype, device, g) for n, k in ((q + kv, h), (h, q), (2 * s.intermediate_size, h),
                                                               (h, s.intermediate_size), (h, cfg.ple_dim))]
        gate = (torch.randn(cfg.ple_dim, h, device=device, generator=g) * h ** -0.5).to(dtype)
        norms = (torch.rand(2, s.head_dim, device=device, generator=g) + 0.5).to(dtype)  # q_norm, k_norm weights
        out.append(dict(zip(("qkv", "o", "gate_up", "down", "ple_proj"), w), ple_gate=gate, q=q, heads=cfg.num_heads,
                        kv_heads=s.num_kv_heads if s.stores_kv else 0, head_dim=s.head_dim, norms=norms))
    return out


def qkv_inputs(layers, rows: int, device, dtype=torch.bfloat16) -> dict:
    """What `run_verify_chain(..., qkv=...)` reads: RoPE tables of `rows` positions per head dim and
    a KV cache per store layer (one sequence, a slot per row)."""
    from ..model.layers import rope_cos_sin, rope_inv_freq

    pos = torch.arange(rows, device=device)[None] + 100
    rope = {d: rope_cos_sin(pos, rope_inv_freq(d, 10000.0).to(device), dtype) for d in {L["head_dim"] for L in layers}}
    caches = [tuple(torch.zeros(1, rows, L["kv_heads"], L["head_dim"], device=device, dtype=dtype) for _ in range(2))
              if L["kv_heads"] else None for L in layers]
    return dict(rope=rope, caches=caches, idx=torch.arange(rows, device=device)[None])


def run_verify_chain(layers, x0, ple, norm_w, pdl: bool, eps: float = 1e-6, twin: bool = False, qkv=None):
    """x0 [M, hidden] through every layer's kernels (module docstring) -> the last normed x.
    twin: the same chain through the kernels' torch twins. qkv (`qkv_inputs`): q|k|v also goes
    through kernels/qkv_finish.py (q/k norms, RoPE, the cache writes), whose q feeds o."""
    def mm(x, w, epilogue="none", aux=None):
        qw, s, z, group, sz = w
        if twin:
            return w4a16_torch(x, qw, s, z, group, epilogue=epilogue, aux=aux)
        return w4a16_matmul(x, qw, s, z, group, epilogue=epilogue, aux=aux, sz=sz, pdl=pdl)

    def rn(*args):
        return (residual_norm_ref(*args, eps=eps) if twin else residual_norm(*args, eps=eps, pdl=pdl))

    h = x0
    _, x = rn(h, None, None, None, norm_w)
    for i, L in enumerate(layers):
        qkv_out = mm(x, L["qkv"])
        if qkv is None:
            attn = qkv_out[:, : L["q"]]
        else:
            cos, sin = qkv["rope"][L["head_dim"]]
            kc, vc = qkv["caches"][i] or (None, None)
            attn = (qkv_finish_ref if twin else qkv_finish)(
                qkv_out[None], L["norms"][0], L["norms"][1] if kc is not None else None, cos, sin, kc, vc,
                qkv["idx"] if kc is not None else None, heads=L["heads"], eps=eps, pdl=pdl).reshape(x.shape[0], -1)
        o = mm(attn, L["o"])
        h, x = rn(h, o, norm_w, None, norm_w)
        dn = mm(mm(x, L["gate_up"], "geglu"), L["down"])
        h, _ = rn(h, dn, norm_w)
        gate = (skinny_matmul_ref if twin else lambda *a, **k: skinny_matmul(*a, **k, pdl=pdl))(
            h, L["ple_gate"], epilogue="gelu_mul", aux=ple)
        h, x = rn(h, mm(gate, L["ple_proj"]), norm_w, None, norm_w)
    return x


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--rows", type=int, default=8, help="rows of the pass (k + 1); 2..16")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two variants")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--qkv-kernel", action="store_true",
                    help="q|k|v through kernels/qkv_finish.py (norms, RoPE, cache writes) before o")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if not 2 <= a.rows <= 16 or a.rounds < 1 or a.reps < 1:
        raise SystemExit("--rows must be 2..16, --rounds and --reps positive")
    if not torch.cuda.is_available():
        raise SystemExit("fastgemma.bench.verify_chain times CUDA graphs; no CUDA device here")
    cfg = preset(a.model)
    if not cfg.ple_dim:
        raise SystemExit(f"{cfg.name} has no PLE; the chain follows E4B's layer (PLE gate and projection)")
    dev = torch.device("cuda")
    layers = build_layers(cfg, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    x0 = torch.randn(a.rows, cfg.hidden_size, device=dev, generator=g).to(torch.bfloat16)
    ple = torch.randn(a.rows, cfg.ple_dim, device=dev, generator=g).to(torch.bfloat16)
    norm_w = torch.ones(cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    qkv = qkv_inputs(layers, a.rows, dev) if a.qkv_kernel else None
    kernels = 1 + (10 if qkv else 9) * len(layers)
    gpu = torch.cuda.get_device_name()
    print(f"{gpu} | {cfg.name} verify-pass kernel chain: {a.rows} rows, {kernels} kernels", flush=True)
    rows, ref = [], None
    for rnd in range(a.rounds):
        for variant in ("plain", "pdl"):
            ms, out = time_graph(lambda: run_verify_chain(layers, x0, ple, norm_w, variant == "pdl", qkv=qkv), a.reps)
            ref = out if ref is None else ref
            row = dict(variant=variant, round=rnd, gpu=gpu, model=cfg.name, rows=a.rows, kernels=kernels, ms=ms,
                       qkv_kernel=a.qkv_kernel, bitwise_equal_plain=bool(torch.equal(out, ref)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{cfg.name} verify-pass kernels ({kernels}) in one CUDA graph, {a.rows} rows; {gpu}")
    print("| variant | ms per round | median ms | bit-identical to plain |")
    print("|---|---|---|---|")
    for v in ("plain", "pdl"):
        mine = [r for r in rows if r["variant"] == v]
        times = " / ".join(f"{r['ms']:.3f}" for r in mine)
        print(f"| {v} | {times} | {statistics.median(r['ms'] for r in mine):.3f} | "
              f"{all(r['bitwise_equal_plain'] for r in mine)} |")


if __name__ == "__main__":
    main()
