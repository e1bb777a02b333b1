"""The bf16 decode ladder on one GPU, in one process: transformers (outside reference), our eager
path, the static step, CUDA graphs, graphs + Triton attention. Same synthetic weights for all.

    python -m fastgemma.bench.ladder --model gemma4_e4b --prompts 4 --prompt-len 256 --new 512

Prints a markdown table last; --out writes the rows as JSONL.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..engine.cache import KVCache
from ..engine.generator import Generator
from ..engine.steps import EagerStep, GraphStep, StaticStep
from ..kernels.decode_attention import decode_attention_op, decode_attention_ref
from ..metrics.identity import common_prefix, top1_agreement
from ..model.config import preset
from ..transforms.fuse import MergeProjections
from ..transforms.quant import nf4_stat_bytes
from ..weights.synthetic import synthetic_model

# variant -> (step class, attention, torch.compile, merged q|k|v and gate|up, int4 g128 body,
# one-row dense linears through our Triton GEMV, fused one-row layer GEMVs: None / "layers" /
# "layers_pdl" / "layers_all": + the attention kernels under PDL and the q/k/v kernel); merging and
# int4 are irreversible, so merged variants come after unmerged ones and int4 last (the GEMV switch
# and the fused step are set per variant)
VARIANTS = {
    "eager": (EagerStep, "torch", False, False, False, False, None),
    "static_torch": (StaticStep, "torch", False, False, False, False, None),
    "static_triton": (StaticStep, "triton", False, False, False, False, None),
    "graph_torch": (GraphStep, "torch", False, False, False, False, None),
    "graph_triton": (GraphStep, "triton", False, False, False, False, None),
    "graph_triton_merged": (GraphStep, "triton", False, True, False, False, None),
    "graph_triton_merged_gemv": (GraphStep, "triton", False, True, False, True, None),
    "compiled_triton_merged": (GraphStep, "triton", True, True, False, False, None),
    "compiled_triton_merged_gemv": (GraphStep, "triton", True, True, False, True, None),
    "compiled_triton_fused": (GraphStep, "triton", True, True, False, False, "layers"),
    "compiled_triton_fused_pdl": (GraphStep, "triton", True, True, False, False, "layers_pdl"),
    "compiled_triton_fused_all": (GraphStep, "triton", True, True, False, False, "layers_all"),
    "compiled_torch_merged": (GraphStep, "torch", True, True, False, False, None),
    "graph_triton_merged_int4": (GraphStep, "triton", False, True, True, False, None),
    "compiled_triton_merged_int4": (GraphStep, "triton", True, True, True, False, None),
    "compiled_triton_merged_int4_gemv": (GraphStep, "triton", True, True, True, True, None),
    "compiled_triton_fused_int4": (GraphStep, "triton", True, True, True, False, "layers"),
    "compiled_triton_fused_int4_pdl": (GraphStep, "triton", True, True, True, False, "layers_pdl"),
    "compiled_triton_fused_int4_all": (GraphStep, "triton", True, True, True, False, "layers_all"),
    "compiled_triton_fused_int4_mma": (GraphStep, "triton", True, True, True, False, "layers_mma"),
}


def apply_variant(model, name, state):
    """Bring `model` to variant `name` (state: what was applied so far). -> (step class, compile)."""
    from ..transforms.gemv import use_gemv

    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    cls, attn, compiled, merge, int4, gemv, fused = VARIANTS[name]
    if merge and not state.get("merged"):
        MergeProjections().apply(model)
        state["merged"] = True
    model.fused_decode = None
    model.fused_verify = None
    model.fuse_drafter = None
    model.draft_head = None
    fuse = None
    if fused:
        from ..transforms.fuse_layers import FuseLayers

        every = fused in ("layers_all", "layers_mma")  # + the attention kernels under PDL and the q/k/v kernel
        fuse = FuseLayers(backend="triton" if model.embed_tokens.weight.is_cuda else "torch",
                          pdl=fused != "layers", attn_pdl=every, qkv_kernel=every, int4_mma=fused == "layers_mma")
        fuse.apply(model)
    if int4 and not state.get("int4"):
        from ..transforms.quant import Int4Quant

        use_gemv(model, False)
        Int4Quant(group_size=128).apply(model)
        state["int4"] = True
    if fuse is not None:
        fuse.validate(model)  # int4_mma: the tensor-core kernel's weight copies, once the linears are int4
    use_gemv(model, gemv)  # resets torch.compile's caches when it switches classes
    torch._dynamo.reset()  # and every variant compiles afresh, whatever else it changed
    model.step_attention = decode_attention_op if attn == "triton" else decode_attention_ref
    return cls, compiled


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second (metrics.memory.copy_bandwidth_gbs)."""
    from ..metrics.memory import copy_bandwidth_gbs

    return copy_bandwidth_gbs(torch.device(device)) * 1e9


def decode_bytes(model) -> int:
    """Bytes a decode step reads from weights: every matrix except the PLE table (one row gathered)
    and the token embedding (one row), plus the tied head (the whole embedding); quantised layers
    with their scales (nf4: absmax)."""
    n = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        n += p.numel() * p.element_size()
    for mod in model.modules():  # quantised layers keep packed weights and scales as buffers
        if hasattr(mod, "weight_bytes"):
            n += mod.weight_bytes()
        n += nf4_stat_bytes(getattr(mod, "weight", None))  # bitsandbytes' absmax, outside the parameters
    return n + model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()


def kernels_per_step(step, tok):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(tok)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA" and "Memcpy" not in e.key
               and "Memset" not in e.key)


def top1(ref_logits, logits, thresh=0.1):
    r = top1_agreement(ref_logits, logits, thresh)
    return r["top1"], r["top1_confident"]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=0)
    ap.add_argument("--variants", default="eager,static_torch,graph_torch,graph_triton")
    ap.add_argument("--hf-new", type=int, default=64, help="tokens for transformers' own eager figure (0: skip)")
    ap.add_argument("--hf-check", type=int, default=1, help="compare logits with transformers over the decode")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    dev = a.device
    cuda = dev.startswith("cuda")
    cfg = preset(a.model)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model = synthetic_model(cfg, dev, torch.bfloat16, seed=0)
    sync()
    build_s = time.time() - t0
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    bw = copy_bandwidth(dev) if cuda else float("nan")
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    nbytes = nbytes_bf16 = decode_bytes(model)
    print(f"{gpu} | build {build_s:.1f}s | weights {weights_gb:.2f} GB | "
          f"decode reads {nbytes / 1e9:.2f} GB/token | copy bw {bw / 1e12:.2f} TB/s | "
          f"ceiling {bw / nbytes:.0f} tok/s", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    max_ctx = a.max_context or (a.prompt_len + a.new + 16)
    rows, ref_tokens, ref_forced, hf_row, ref_outs = [], None, None, None, None
    want_hf = bool(a.hf_new or a.hf_check)
    state = {}
    for name in a.variants.split(","):
        cls, compiled = apply_variant(model, name, state)
        nbytes = decode_bytes(model)
        cache = KVCache(cfg, 1, max_ctx, device=dev, dtype=torch.bfloat16)
        try:
            step = cls(model, cache) if cls is EagerStep else cls(model, cache, compile=compiled)
            gen = Generator(model, cache, step)
            t_prep = time.perf_counter()
            step.prepare()
            print(f"{name}: prepare {time.perf_counter() - t_prep:.1f}s", flush=True)
            gen.generate(prompts[0], 8)  # warm-up (JIT, autotune) at the timed length, untimed
            gen.warm_prefill(a.prompt_len)  # the prompt's graph (graphs: padded lengths)
            sync()
            t = time.perf_counter()
            outs = [gen.generate(p, a.new) for p in prompts]
            sync()
            wall = time.perf_counter() - t
        except Exception as e:  # report and go on with the other variants
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        n_tok = sum(len(o.tokens) for o in outs)
        steps = [s for o in outs for s in o.step_s]
        step_ms = statistics.median(steps) * 1e3
        forced = gen.forced(prompts[0], outs[0].tokens if ref_tokens is None else ref_tokens)
        if ref_tokens is None:
            ref_tokens, ref_forced = outs[0].tokens, forced
        same = [o.tokens == r for o, r in zip(outs, ref_outs)] if rows else [True] * len(outs)
        if not rows:
            ref_outs = [o.tokens for o in outs]
        prefix = statistics.mean(common_prefix(o.tokens, r) for o, r in zip(outs, ref_outs))
        agree, agree_conf = top1(ref_forced, forced)
        k = None
        try:
            if isinstance(step, GraphStep):
                k = "1 graph"
            elif cuda:
                step.begin(a.prompt_len)
                k = kernels_per_step(step, torch.tensor([[5]], device=dev))
        except Exception as e:
            k = f"? ({type(e).__name__})"
        row = dict(variant=name, tps=n_tok / wall, step_ms=step_ms, ttft_ms=statistics.median(o.ttft_s for o in outs) * 1e3,
                   mbu=nbytes / (step_ms / 1e3) / bw, identity_rate=sum(same) / len(same), prefix_mean=prefix,
                   top1_agree=agree, top1_agree_confident=agree_conf, kernels=k,
                   vram_peak_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del step, gen, cache
        if want_hf and hf_row is None and not state:  # transformers maps only the unmerged, dense weights
            hf_row = hf_reference(model, prompts, a, ref_forced, ref_tokens)
        if cuda:
            torch.cuda.empty_cache()
    if want_hf and hf_row is None:
        hf_row = hf_reference(model, prompts, a, ref_forced, ref_tokens)
    if a.out:
        with open(a.out, "w") as f:
            for r in rows + ([hf_row] if hf_row else []):
                f.write(json.dumps(r) + "\n")
    print(f"\n{cfg.name} bf16 synthetic, {a.prompts} prompts x {a.prompt_len} tokens -> {a.new} new, "
          f"{gpu}, copy bw {bw / 1e12:.2f} TB/s, bf16 ceiling {bw / nbytes_bf16:.0f} tok/s")
    print("| variant | tok/s | step ms | TTFT ms | MBU | identity | prefix | top1 | top1 conf | kernels/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['tps']:.1f} | {r['step_ms']:.2f} | {r['ttft_ms']:.1f} | {r['mbu']:.2f} | "
              f"{r['identity_rate']:.2f} | {r['prefix_mean']:.0f} | {r['top1_agree']:.4f} | "
              f"{r['top1_agree_confident']:.4f} | {r['kernels']} |")
    if hf_row:
        print(f"| transformers {hf_row.get('transformers')} eager | {hf_row.get('tps', float('nan')):.1f} | | | | | | "
              f"{hf_row.get('top1_agree', float('nan')):.4f} | {hf_row.get('top1_agree_confident', float('nan')):.4f} | "
              f"max abs diff {hf_row.get('max_abs_diff', float('nan')):.3g} |")


@torch.inference_mode()
def hf_reference(model, prompts, a, ref_forced, ref_tokens):
    """transformers on the same weights: teacher-forced logits over our eager decode (max abs diff,
    top-1 agreement) and its own eager generate speed."""
    import transformers

    from ..model.hf_config import hf_model_sharing_weights

    row = {"variant": "transformers", "transformers": transformers.__version__}
    try:
        hf = hf_model_sharing_weights(model, "sdpa")
        if a.hf_check and ref_forced is not None:
            seq = torch.tensor([prompts[0] + ref_tokens[:-1]], device=model.embed_tokens.weight.device)
            logits = hf(seq, logits_to_keep=len(ref_tokens)).logits[0].float()
            row["max_abs_diff"] = (logits - ref_forced).abs().max().item()
            row["top1_agree"], row["top1_agree_confident"] = top1(logits, ref_forced)
            del logits
        if a.hf_new:
            ids = torch.tensor([prompts[0]], device=model.embed_tokens.weight.device)
            hf.generate(ids[:, :16], max_new_tokens=4, do_sample=False)
            sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
            sync()
            t = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=a.hf_new, min_new_tokens=a.hf_new, do_sample=False)
            sync()
            row["tps"] = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        print(f"transformers reference FAILED: {row['error']}", flush=True)
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
