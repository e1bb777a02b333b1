"""How close each bf16 decode path is to fp32 arithmetic on the same weights (the noise floor).

    python -m fastgemma.bench.agreement --variants eager,compiled_triton_merged_gemv

`top1_agree` against the bf16 eager path mixes two things on random weights: rounding noise that
any bf16 path has, and real errors. This entry separates them. It builds E4B synthetic bf16
weights, decodes `--new` tokens greedily with the bf16 eager path, then teacher-forces that trace
through an fp32 copy of the same weights (the bf16 values, exactly, computed in fp32: the
reference) and through each bf16 variant. Each variant's top-1 agreement with fp32 is printed
beside bf16 eager's own: a fast path is as good as eager when its agreement with fp32 is as high.
Margins are the fp32 reference's top-1 minus top-2 logits. --out writes JSONL.
"""
from __future__ import annotations

import argparse
import copy
import json

import torch

from ..engine.cache import KVCache
from ..engine.generator import Generator
from ..engine.steps import EagerStep
from ..metrics.identity import top1_agreement, top2
from ..model.config import preset
from ..weights.synthetic import synthetic_model
from .ladder import apply_variant


@torch.inference_mode()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--variants", default="eager,compiled_triton_merged_gemv")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--thresh", type=float, default=0.1, help="confident: reference margin above this")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    dev = a.device
    cfg = preset(a.model)
    model = synthetic_model(cfg, dev, torch.bfloat16, seed=0)
    ref_model = copy.deepcopy(model).float()  # the same (bf16) values, fp32 arithmetic
    ref_model.step_attention = model.step_attention
    prompt = torch.randint(10, cfg.vocab_size, (a.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    max_ctx = a.prompt_len + a.new + 16

    def generator(m, dtype, cls=EagerStep, compiled=False):
        cache = KVCache(cfg, 1, max_ctx, device=dev, dtype=dtype)
        step = cls(m, cache) if cls is EagerStep else cls(m, cache, compile=compiled)
        step.prepare()
        return Generator(m, cache, step)

    trace = generator(model, torch.bfloat16).generate(prompt, a.new).tokens
    ref = generator(ref_model, torch.float32).forced(prompt, trace)
    del ref_model
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    margins = top2(ref)[1]
    print(f"{cfg.name} synthetic, {a.prompt_len}-token prompt, {a.new} forced tokens; fp32 reference margins: "
          f"median {margins.median().item():.3f}, share > {a.thresh}: {(margins > a.thresh).float().mean().item():.3f}",
          flush=True)
    rows, state, eager_logits = [], {}, None
    for name in a.variants.split(","):
        cls, compiled = apply_variant(model, name, state)
        logits = generator(model, torch.bfloat16, cls, compiled).forced(prompt, trace)
        row = dict(variant=name, vs="fp32", **top1_agreement(ref, logits, a.thresh))
        if eager_logits is None and name == "eager":
            eager_logits = logits
        elif eager_logits is not None:
            e = top1_agreement(eager_logits, logits, a.thresh, ref_margins=margins)  # confident: by fp32
            row.update(top1_vs_eager=e["top1"], top1_confident_vs_eager=e["top1_confident"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\n| variant | top1 vs fp32 | top1 conf vs fp32 | max abs diff vs fp32 | worst flipped margin "
          "| top1 vs bf16 eager | top1 conf vs bf16 eager |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['top1']:.4f} | {r['top1_confident']:.4f} | {r['max_abs_diff']:.3f} | "
              f"{r['worst_flipped_margin']:.3f} | {r.get('top1_vs_eager', float('nan')):.4f} | "
              f"{r.get('top1_confident_vs_eager', float('nan')):.4f} |")


if __name__ == "__main__":
    main()
