"""Probe: how long torch.compile takes over the prompt's forward, the whole forward (graphs.compile_prefill=true)
against each decoder layer's regions (compile_prefill=layers), on E4B's layer layout (42 layers, 5 sliding : 1
full, 18 KV-shared, PLE) at a toy width, so that it runs on a CPU; compiling depends on the graph, not the widths.
Each prompt's first prefill is timed (the compile falls in the first one that needs a new graph) and its last hidden
state compared with the eager forward's. One mode a process: point TORCHINDUCTOR_CACHE_DIR at an empty folder for a
cold compile, run again for a warm one (docs/commands.md, "The prompt forward's compile"):

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python sweeps/probes/prompt_compile.py --mode layers [--layers 42]
        [--prompt-lens 100,150,300,37] [--chunk 256] [--device cpu]
"""
import argparse
import dataclasses
import time

import torch
from torch._dynamo.utils import counters

from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import PROMPT_COMPILE, Generator
from fastgemma.model.config import GEMMA4_E4B
from fastgemma.weights.synthetic import synthetic_model

TOY = dict(vocab_size=512, ple_vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
           head_dim=32, global_head_dim=64, ple_dim=16)


def toy_config(layers: int):
    """E4B's first `layers` layers (5 sliding, then 1 full; 42: all of them, the last 18 KV-shared; fewer: the
    last 3/7 of them KV-shared, in whole groups of six) at TOY's widths."""
    if not 12 <= layers <= GEMMA4_E4B.num_layers or layers % 6:
        raise SystemExit(f"--layers must be a multiple of 6 in [12, 42] (whole groups, one left to share from), "
                         f"got {layers}")
    shared = GEMMA4_E4B.num_kv_shared_layers if layers == GEMMA4_E4B.num_layers else layers * 3 // 7 // 6 * 6
    return dataclasses.replace(GEMMA4_E4B, num_layers=layers, layer_types=GEMMA4_E4B.layer_types[:layers],
                               num_kv_shared_layers=max(shared, 6), **TOY)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", required=True, help="true (the whole forward) | layers (each layer's regions)")
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--prompt-lens", default="100,150,300,37", help="prompts in this order, comma-separated")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk: a longer prompt adds a chunk before the last")
    ap.add_argument("--window", type=int, default=188)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    mode = {"true": True}.get(a.mode, a.mode)
    if mode not in PROMPT_COMPILE or mode is False:
        raise SystemExit(f"--mode must be true or layers, got {a.mode!r}")
    lens = [int(x) for x in a.prompt_lens.split(",") if x]
    if not lens or min(lens) < 1:
        raise SystemExit(f"--prompt-lens {a.prompt_lens!r}: positive integers, comma-separated")
    torch.set_num_threads(1)
    cfg = toy_config(a.layers)
    model = synthetic_model(cfg, dtype=torch.float32, seed=1, device=a.device)
    mk = lambda c: Generator(model, KVCache(cfg, 1, max(lens) + 16, window=a.window, device=a.device,  # noqa: E731
                                            dtype=torch.float32), prefill_chunk=a.chunk, compile_prefill=c)
    eager, timed = mk(False), mk(mode)
    g = torch.Generator().manual_seed(0)
    total, rows = 0.0, []
    for T in lens:
        ids = torch.randint(1, cfg.vocab_size, (1, T), generator=g).to(a.device)
        t0 = time.perf_counter()
        h = timed.prefill(ids)
        s = time.perf_counter() - t0
        total += s
        rows.append(f"{T} tokens {s:.2f} s (max diff to eager {(h - eager.prefill(ids)).abs().max().item():.1e})")
    print(f"compile_prefill={a.mode}, {a.layers} layers ({cfg.num_kv_shared_layers} KV-shared), chunk {a.chunk}: "
          + "; ".join(rows) + f"; first prefills {total:.1f} s in all, {counters['stats']['unique_graphs']} graphs")


if __name__ == "__main__":
    main()
