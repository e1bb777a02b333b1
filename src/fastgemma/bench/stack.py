"""Body x head on one GPU, in one process: bf16 / int4 / int8 / nf4 bodies, each with the full / int8 / int4
and pruned heads, on the same synthetic weights. The AR decode step of each pair, and the head alone.

    python -m fastgemma.bench.stack --bodies bf16 int4 nf4 --heads full int8 int4 pruned:12288 pruned:16384 pruned:32768
        [pruned:12288:int4 ...]

Bodies (merged q|k|v and gate|up, Triton split-KV attention, CUDA graphs, torch.compile):
- bf16: `fuse=layers fuse.pdl=true` (the fused one-row GEMVs of kernels/fused_gemv.py);
- int4: `quant=int4` g128 (per_layer_input_gate kept bf16) + `fuse=layers fuse.pdl=true`;
- int8: `quant=int8` (W8A16, a scale per row) + `fuse=layers fuse.pdl=true` (kernels/fused_w8a16.py's GEMVs);
- nf4: `quant=nf4`, bitsandbytes Linear4bit (its own kernels; no fused step).
`--variants base,attn_pdl,attn_pdl+qkv` builds each fused body once per variant of the step (`fuse.attn_pdl`:
the attention kernels under PDL too; `fuse.qkv_kernel`: kernels/qkv_finish.py), each compiled on its own;
the full head's tokens of each variant are compared with the first variant's (`identity vs first variant`:
launch options must give 1.00), and each row's step with the first variant's on the same head (`vs first
variant`: with the whole stack first and one option left out of each later variant, what each option buys, in
one process: `bash sweeps/h200.sh loo`). `--attn-tiles` (repeated) builds the variants with `attn_qkv` once per
tile choice of the attention's q/k/v mode (`fuse.attn_tiles`), in the same process. `--window 188`:
the sliding layers' window (`window=w188`, the frontier's; default the model's own).
The body is compiled once; each head is then swapped in and the step re-captured, the head's pick
(`sampler=fused_argmax`) outside the compiled region, so a head costs seconds, not a compile.
Pruned heads keep N rows: the eos ids, the full head's greedy tokens on these prompts, then seeded
random ids. On synthetic weights that says nothing about a keepset's quality (see the README for real
weights); it makes `identity` a check of the pruned path: with every greedy token kept, its ids must
equal the full head's. Quantized heads may flip near-ties of random weights: their identity is reported as is.
Columns: GB read per token (body + head), tok/s (prefill included), median step ms, MBU against the
device's copy bandwidth, the head's pick alone (CUDA graph of one call; heads under the L2 size stay
partly cached between calls, so small heads read optimistic), identity and greedy prefix against the
same body with the full head. `--timeline N` traces N replays of each row's step (bench.timeline): per
kernel and grid, its own time and its share of the step's critical path; `--floor FILE` (bench.floor's
JSONL) adds each kernel's boundary at its grid's PDL figure and what it takes above it. Prints one JSON line per row
(--out: JSONL, with the timeline) and a markdown table last.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from ..engine.cache import KVCache
from ..engine.compile import compile_step
from ..engine.generator import Generator
from ..engine.steps import GraphStep, StaticStep
from ..metrics.identity import common_prefix
from ..model.config import preset
from ..transforms.window import SlidingWindow
from ..weights.synthetic import synthetic_model
from .floor import floor_option
from .ladder import copy_bandwidth, decode_bytes

BODIES = ("bf16", "int4", "int8", "nf4")
UNFUSED = ("nf4",)  # bodies without fused one-row GEMVs: merged + compiled + CUDA graphs


def parse_head(spec: str) -> tuple[str, int | None, str]:
    """'full' | 'int8' | 'int4' | 'pruned:N[:int8|:int4]' -> (kind, rows, the pruned rows' dtype: auto, the
    model's, unless given)."""
    kind, _, rest = spec.partition(":")
    n, _, dtype = rest.partition(":")
    if kind in ("full", "int8", "int4") and not rest:
        return kind, None, "auto"
    if kind == "pruned" and n.isdigit() and int(n) > 0 and dtype in ("", "int8", "int4"):
        return kind, int(n), dtype or "auto"
    raise SystemExit(f"bad head {spec!r}: use full, int8, int4 or pruned:N[:int8|:int4] (N rows kept, in the "
                     "model's dtype or int8 / int4)")


def head_name(kind: str, rows: int | None, dtype: str) -> str:
    """`parse_head`'s spec back: the rows' name in the tables and records."""
    return kind if rows is None else f"{kind}:{rows}" + ("" if dtype == "auto" else f":{dtype}")


def int4_group_size(cfg) -> int:
    """128 where the hidden size allows it (E4B), else 32 (the tiny test models)."""
    return 128 if cfg.hidden_size % 128 == 0 else 32


VARIANT_OPTS = {"attn_pdl": "attn_pdl", "qkv": "qkv_kernel", "attn_merge": "attn_merge", "mma": "int4_mma",
                "attn_qkv": "attn_qkv", "inv": "batch_invariant", "dloop": "draft_loop", "fold": "norm_fold",
                "afold": "attn_fold", "tail": "tail_norm", "start": "start_kernel", "dmerge": "draft_merge"}
MODEL_OPTS = ("ple",)  # variant options that change the model, not the fused step: 'ple' = ple=table
STEP_OPTS = ("adv", "combo")  # variant options of the captured step: 'adv' = graphs.advance=kernel; 'combo' = the
# body compiled with inductor's combo_kernels (independent small kernels horizontally fused into one launch)


def variant_options(v: str) -> set:
    """A variant's options: its '+'-joined names ('base' and empty names dropped)."""
    return {o for o in v.split("+") if o and o != "base"}


def parse_variant(v: str) -> dict:
    """A fused-step variant: 'base' (the GEMVs under PDL) or '+'-joined options from VARIANT_OPTS
    ('attn_pdl': the attention kernels too; 'qkv': kernels/qkv_finish.py; 'attn_merge': no attention
    combine launch; 'mma': int4 GEMVs / GEMMs of <= 8 rows on kernels/mma_w4a16.py where its table
    has the shape; 'attn_qkv': q/k/v norms, RoPE and cache writes in the attention's split kernel;
    'inv': batch_invariant, the verify pass's rows bit-equal to the one-row step's; 'dloop': draft_loop,
    the speculative draft loop in one persistent kernel; 'fold': norm_fold, with 'mma' the norms between
    o and gate|up and before the next q|k|v folded into those GEMVs; 'afold': attn_fold, with 'fold' and
    'attn_qkv' the sliding layers' attention combine folded into o; 'tail': tail_norm, the last update and final
    norm in kernels/residual_norm.py; 'start': start_kernel, the step's inputs in one launch; 'dmerge':
    draft_merge, no combine launch in the MTP drafter's attention (bench.spec); 'ple': not a step
    option, the model's PLE inputs from a table, transforms/ple.py, applied before quant; 'adv': the captured
    step's bookkeeping in one launch, kernels/step_advance.py; 'combo': the body compiled with inductor's
    combo_kernels) -> FuseLayers options."""
    opts = variant_options(v)
    bad = [o for o in sorted(opts) if o not in VARIANT_OPTS and o not in MODEL_OPTS and o not in STEP_OPTS]
    if bad:
        raise SystemExit(f"bad variant {v!r}: base, or options joined by '+' from "
                         f"{', '.join((*VARIANT_OPTS, *MODEL_OPTS, *STEP_OPTS))}")
    return {VARIANT_OPTS[o]: True for o in opts if o in VARIANT_OPTS}


def mma_table_arg(text: str) -> dict:
    """An --mma-table value -> the tensor-core kernel's table (`mma_table.parse_table`; '+ENTRIES': the
    shipped table with those entries replaced or added), or exit with the form it expects."""
    from ..kernels.mma_table import MMA_CONFIGS, parse_table

    try:
        return {**MMA_CONFIGS, **parse_table(text[1:])} if text.startswith("+") else parse_table(text)
    except ValueError as e:
        raise SystemExit(str(e)) from e


def fused_table_arg(text: str) -> dict:
    """A --fused-table value -> the fused one-row GEMVs' table (`fused_gemv.parse_fused_table`), or exit
    naming the option and the entry at fault."""
    from ..kernels.fused_gemv import parse_fused_table

    try:
        return parse_fused_table(text)
    except ValueError as e:
        raise SystemExit(f"--fused-table: {e}") from e


def attn_tiles_arg(text: str) -> str:
    """An --attn-tiles value -> fuse.attn_tiles' checked text ('default': '', the kernel's own), or exit naming the
    option and the entry at fault."""
    from ..kernels.attention_tiles import parse_qkv_tiles, qkv_tiles_text

    try:
        return "" if text == "default" else qkv_tiles_text(parse_qkv_tiles(text))
    except ValueError as e:
        raise SystemExit(f"--attn-tiles: {e}") from e


def build_body(cfg, dev: str, body: str, dtype, fuse: bool = True, variant: str = "base", attn_tiles: str = ""):
    """Synthetic weights -> the body's transforms (fuse: the fused one-row step, bf16 and int4
    bodies, with the options of `variant`; `attn_tiles`: fuse.attn_tiles). -> (model, {transform: describe()})."""
    from ..transforms.attention import TorchAttention, TritonAttention
    from ..transforms.fuse import MergeProjections
    from ..transforms.fuse_layers import FuseLayers
    from ..transforms.ple import PleTable
    from ..transforms.quant import Int4Quant, Nf4Quant
    from ..transforms.quant_int8 import Int8Quant

    cuda = dev.startswith("cuda")
    backend = "triton" if cuda else "torch"
    gs = int4_group_size(cfg)
    skip = ("per_layer_input_gate",) + (("per_layer_projection",) if cfg.ple_dim % gs else ())
    parts = ([PleTable()] if "ple" in variant_options(variant) else []) + [MergeProjections()]
    if body == "int4":
        parts.append(Int4Quant(group_size=gs, skip=skip, backend=backend))
    elif body == "int8":
        parts.append(Int8Quant(backend=backend))
    elif body == "nf4":
        parts.append(Nf4Quant())
    elif body != "bf16":
        raise SystemExit(f"unknown body {body!r}; known: {', '.join(BODIES)}")
    if fuse and body not in UNFUSED:
        parts.append(FuseLayers(backend=backend, pdl=cuda, attn_tiles=attn_tiles, **parse_variant(variant)))
    parts.append(TritonAttention() if cuda else TorchAttention())
    model = synthetic_model(cfg, dev, dtype, seed=0)
    for t in parts:
        model = t.apply(model) or model
    return model, {type(t).__name__: (t.describe() if hasattr(t, "describe") else {}) for t in parts}


def set_head(model, kind: str, rows: int | None, keep_ids: list[int] | None, dev: str, workdir: str,
             dtype: str = "auto"):
    """Swap the model's head; -> (bytes the head reads per token, describe())."""
    from ..transforms.lm_head import FullHead, Int4Head, Int8Head, PrunedHead, write_keepset

    backend = "triton" if dev.startswith("cuda") else "torch"
    model.logits_head = None
    model.pruned_head = None
    if kind == "full":
        t = FullHead()
    elif kind == "int8":
        t = Int8Head(backend=backend)
    elif kind == "int4":
        t = Int4Head(group_size=int4_group_size(model.config), backend=backend)
    else:
        path = write_keepset(os.path.join(workdir, f"keep{rows}.txt"), keep_ids[:rows])
        t = PrunedHead(rows=rows, keepset=str(path), source="file", dtype=dtype,
                       group_size=int4_group_size(model.config), backend=backend)
    t.apply(model)
    info = t.describe()
    return info["head_bytes_per_token"], info


def keepset(first: list[int], rows: int, vocab: int, seed: int = 0) -> list[int]:
    """`first` (deduplicated, in order), then seeded random ids, `rows` in all."""
    ids = list(dict.fromkeys(first))[:rows]
    seen = set(ids)
    g = torch.Generator().manual_seed(seed)
    for i in torch.randperm(vocab, generator=g).tolist():
        if len(ids) >= rows:
            break
        if i not in seen:
            ids.append(i)
            seen.add(i)
    return ids


def body_bytes(model) -> int:
    """Weight bytes a decode step reads outside the head: decode_bytes without the tied embedding."""
    emb = model.embed_tokens.weight
    return decode_bytes(model) - emb.numel() * emb.element_size()


def head_us(model, sampler, dev: str, rep_ms: int = 50) -> float:
    """The head's pick alone: hidden [1, 1, H] -> id, median us (a CUDA graph of one call)."""
    x = torch.randn(1, 1, model.config.hidden_size, device=dev, dtype=model.embed_tokens.weight.dtype)
    sampler(model, x)  # buffers and autotuning before any capture
    if dev.startswith("cuda"):
        from ..kernels.bench_util import timer

        return timer(True, rep_ms)(lambda: sampler(model, x))
    t = time.perf_counter()
    for _ in range(3):
        sampler(model, x)
    return (time.perf_counter() - t) / 3 * 1e6


def random_prompts(cfg, lengths: list[int], count: int, new: int) -> tuple[dict, int]:
    """`count` random prompts of each length (seed 0, drawn length by length) and the context a cache
    needs for the longest plus `new` tokens; a SystemExit past the model's positions."""
    g = torch.Generator().manual_seed(0)
    prompts = {n: [torch.randint(10, cfg.vocab_size, (n,), generator=g).tolist() for _ in range(count)]
               for n in lengths}
    max_ctx = max(lengths) + new + 16
    if max_ctx > cfg.max_position_embeddings:
        raise SystemExit(f"--prompt-len {max(lengths)} + --new {new} exceeds {cfg.name}'s "
                         f"{cfg.max_position_embeddings} positions")
    return prompts, max_ctx


def main(argv=None):
    from ..transforms.sampler import FusedArgmax

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--bodies", nargs="+", default=list(BODIES), choices=BODIES)
    ap.add_argument("--heads", nargs="+", default=["full", "int8", "int4", "pruned:12288", "pruned:16384",
                                                   "pruned:32768"],
                    help="full, int8, int4, pruned:N (N rows in the model's dtype) or pruned:N:int8 / pruned:N:int4")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[256],
                    help="prompt tokens; several: rows for each, one cache sized for the longest (long context "
                         "in one process)")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--variants", default="base",
                    help="fused-step variants per body, comma-separated: base, or options joined by '+' "
                         f"({', '.join(VARIANT_OPTS)}), e.g. base,attn_pdl,attn_pdl+qkv (nf4: base only)")
    ap.add_argument("--mma-table", action="append", default=[],
                    help="variants with 'mma': the tensor-core int4 kernel's table instead of its own: entries "
                         "CASE@ROWS=CONFIG joined by ',' (ROWS 1.., or 'inv': fuse.batch_invariant's entry; CONFIG "
                         "TxW[dD][sS][pR][f][nH][g] or cudaWxS[cC][g]; e.g. 'o@1=2x8,down@1=1x4s4'), "
                         "'none', 'default' (its own), or '+' then entries (its own with those changed, e.g. "
                         "'+down@1=1x4s4'); repeated: one row set per table, in one process. A one-row GEMV with "
                         "a prologue (q|k|v, gate|up) runs it in kernels/residual_norm.py first")
    ap.add_argument("--attn-tiles", action="append", default=[],
                    help="variants with 'attn_qkv': the q/k/v attention mode's tiles per layer kind (fuse.attn_tiles: "
                         "KIND:NxWsS[pP][eE] joined by ',', KIND full_store, full_query, sliding_store or "
                         "sliding_query; eE: the first K / V block before the PDL wait into registers (e1; e2: the q "
                         "rows' cos / sin too) or L2 (e0)), or 'default' (the kernel's own); repeated: one row set per "
                         "value, in one process")
    ap.add_argument("--fused-table", action="append", default=[],
                    help="the fused one-row GEMVs' tiles (kernels/fused_gemv.FUSED_CONFIGS; given here, on any GPU) "
                         "instead of the shipped table (sm_90 only): entries CASE=NxKwW[pPdD] joined by ',' (e.g. "
                         "'PLE_gate=2x1024w4'; pPdD: streamed, kernels/stream_gemv.py), 'none' (every shape "
                         "autotuned), 'default', or '+' then entries (the "
                         "shipped table with those changed); repeated: one row set per table, in one process")
    ap.add_argument("--window", default="native",
                    help="the sliding layers' window: native (the model's) or a number of keys (the frontier: 188)")
    ap.add_argument("--no-compile", action="store_true", help="CUDA graphs without torch.compile (fast to build)")
    ap.add_argument("--timeline", type=int, default=0, metavar="N",
                    help="after each row's runs, trace N replays of its step (bench.timeline): each kernel's own "
                         "time and its share of the step's critical path, per kernel and grid (0: off)")
    ap.add_argument("--floor", default=None, metavar="FILE",
                    help="with --timeline: bench.floor's JSONL; each kernel's boundary at its grid's PDL figure and "
                         "the critical path above it")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the script's logic on torch twins (smoke test)")
    a = ap.parse_args(argv)
    lengths = list(dict.fromkeys(a.prompt_len))
    try:
        window = None if a.window == "native" else SlidingWindow(int(a.window)).size
    except ValueError as e:
        raise SystemExit(f"--window: native or a positive number of keys, got {a.window!r}") from e
    if a.timeline < 0:
        raise SystemExit(f"--timeline: a number of replays >= 0, got {a.timeline}")
    floor = floor_option(a.floor, a.timeline > 0, "--timeline")
    if a.timeline and not a.device.startswith("cuda"):
        raise SystemExit("--timeline traces CUDA kernels: it needs --device cuda")
    if min(lengths) < 1 or a.new < 1:
        raise SystemExit(f"--prompt-len and --new must be >= 1, got {a.prompt_len} and {a.new}")
    variants = [v for v in a.variants.split(",") if v]
    if not variants:
        raise SystemExit("--variants: at least one (base)")
    for v in variants:
        parse_variant(v)
    from ..kernels import mma_table

    shipped = dict(mma_table.MMA_CONFIGS)
    # text -> table; '' is the shipped one
    tables = {"" if t == "default" else t: shipped if t == "default" else
              mma_table_arg(t)
              for t in a.mma_table or ["default"]}
    from ..kernels import fused_gemv

    shipped_fused = dict(fused_gemv.FUSED_CONFIGS)
    fused_tables = {"" if t == "default" else t: shipped_fused if t == "default" else fused_table_arg(t)
                    for t in a.fused_table or ["default"]}
    attn_tiles = list(dict.fromkeys(attn_tiles_arg(t) for t in a.attn_tiles or ["default"]))  # '': the kernel's own
    if a.attn_tiles and not any("attn_qkv" in variant_options(v) for v in variants):
        raise SystemExit("--attn-tiles sets the q/k/v attention mode's tiles: give a variant with attn_qkv")
    # the full head first: the reference of identity, and the pruned keepsets' first ids
    heads = [("full", None, "auto")] + [h for h in dict.fromkeys(parse_head(h) for h in a.heads)
                                        if h != ("full", None, "auto")]
    dev = a.device
    cuda = dev.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("fastgemma.bench.stack measures CUDA graphs on a GPU; no CUDA device here")
    compiled = cuda and not a.no_compile
    cfg = preset(a.model)
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    bw = copy_bandwidth(dev) if cuda else float("nan")
    prompts, max_ctx = random_prompts(cfg, lengths, a.prompts, a.new)
    sampler = FusedArgmax("triton" if cuda else "torch")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    print(f"{gpu} | {cfg.name} synthetic | copy bw {bw / 1e12:.2f} TB/s | compile {compiled}", flush=True)
    workdir = tempfile.mkdtemp(prefix="fastgemma-stack-")  # the pruned heads' keepset files
    eos = list(cfg.eos_ids)  # kept first, so greedy decode can still stop
    plan = [(b, v, t, at, ft) for b in a.bodies for v in (variants if b not in UNFUSED else variants[:1])
            for t in (tables if "mma" in variant_options(v) else [""])
            for at in (attn_tiles if "attn_qkv" in variant_options(v) else [""])
            for ft in (fused_tables if b not in UNFUSED else [""])]
    first = {}  # body -> prompt length -> the first variant's full-head tokens
    first_ms = {}  # (body, head, prompt length) -> the first variant's step ms: each later variant's delta
    for body, variant, table, tiles, ftable in plan:
        mma_table.set_table(tables.get(table, shipped))  # read when the body is built and traced
        fused_gemv.set_fused_table(fused_tables.get(ftable, shipped_fused), forced=bool(ftable))
        label = ((f"{variant} [{table}]" if table else variant) + (f" {{{tiles}}}" if tiles else "")
                 + (f" (fused: {ftable})" if ftable else ""))
        t0 = time.perf_counter()
        try:
            model, desc = build_body(cfg, dev, body, dtype, variant=variant, attn_tiles=tiles)
        except Exception as e:  # nf4 without bitsandbytes, ...: report and go on
            print(f"{body} {label}: FAILED to build: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(body=body, variant=label, head="*", error=f"{type(e).__name__}: {e}"))
            continue
        sync()
        nbody = body_bytes(model)
        print(f"{body} {label}: built in {time.perf_counter() - t0:.1f}s, body reads {nbody / 1e9:.3f} GB/token",
              flush=True)
        torch._dynamo.reset()
        step_fn = model.step
        if compiled:  # the body once; the head's pick stays outside, so swapping heads never recompiles
            combo = "combo" in variant_options(variant)
            model.step = compile_step(step_fn, options={"combo_kernels": True} if combo else None)
        cache = KVCache(cfg, 1, max_ctx, window=window, device=dev, dtype=dtype)
        refs, full_tokens = {}, []
        for kind, n, hdtype in heads:
            name = head_name(kind, n, hdtype)
            try:
                nhead, hinfo = set_head(model, kind, n, keepset(eos + full_tokens, n, cfg.vocab_size) if n else None,
                                        dev, workdir, hdtype)
                cache.reset()
                step = (GraphStep if cuda else StaticStep)(
                    model, cache, sampler, advance="kernel" if "adv" in variant_options(variant) else "ops")
                gen = Generator(model, cache, step, sampler=sampler)
                t = time.perf_counter()
                step.prepare()
                prep_s = time.perf_counter() - t
                for L in lengths:  # warm-up at each timed length: an eager prompt path compiles per shape
                    gen.generate(prompts[L][0], 8)
                gen.warm_prefill(max(lengths))  # the prompts' graphs (graphs: padded lengths)
                sync()
                runs = {}
                for L in lengths:
                    t = time.perf_counter()
                    outs = [gen.generate(p, a.new) for p in prompts[L]]
                    sync()
                    runs[L] = (outs, time.perf_counter() - t)
                hus = head_us(model, sampler, dev)
                tl = None
                if a.timeline:
                    from .timeline import print_groups, summarize, trace_kernels, with_floor

                    step.begin(max(lengths))
                    tl = summarize(trace_kernels(lambda s=step: s(s.out_tok), a.timeline))
                    if floor is not None:
                        tl = with_floor(tl, floor)
                    print_groups(tl, f"{body} {label} + {name}, context {max(lengths)}")
            except Exception as e:
                print(f"{body} {label} + {name}: FAILED {type(e).__name__}: {e}", flush=True)
                rows.append(dict(body=body, variant=label, head=name, error=f"{type(e).__name__}: {e}"))
                continue
            for L, (outs, wall) in runs.items():
                tokens = [o.tokens for o in outs]
                if L not in refs:
                    refs[L] = tokens
                    full_tokens += [t for ts in tokens for t in ts]
                    first.setdefault(body, {}).setdefault(L, tokens)
                ref = refs[L]
                step_ms = statistics.median(s for o in outs for s in o.step_s) * 1e3
                base_ms = first_ms.get((body, name, L))  # None: this is the first variant with this head
                first_ms.setdefault((body, name, L), step_ms)
                per_tok = nbody + nhead
                row = dict(body=body, variant=label, head=name, gb_per_token=per_tok / 1e9, head_mb=nhead / 1e6,
                           tps=sum(len(t) for t in tokens) / wall, step_ms=step_ms,
                           step_ms_vs_first=None if base_ms is None else step_ms - base_ms,
                           ttft_ms=statistics.median(o.ttft_s for o in outs) * 1e3,
                           mbu=per_tok / (step_ms / 1e3) / bw if cuda else None, head_us=hus,
                           identity_rate=sum(t == r for t, r in zip(tokens, ref)) / len(ref),
                           prefix_mean=statistics.mean(common_prefix(t, r) for t, r in zip(tokens, ref)),
                           identity_vs_first=(sum(t == r for t, r in zip(tokens, first[body][L])) / len(tokens)
                                              if kind == "full" else None),  # the full head: against the first variant
                           prepare_s=prep_s, compile=compiled, gpu=gpu, model=cfg.name, prompts=a.prompts,
                           prompt_len=L, max_context=max_ctx, window=window or cfg.sliding_window, new=a.new,
                           stack=desc, lm_head=hinfo)
                if tl is not None:
                    row["timeline"] = tl
                if cuda:
                    row["fused_tuned"] = fused_gemv.tuned_picks()  # the autotuner's picks so far in this process
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("stack", "lm_head", "timeline")}),
                      flush=True)
            del step, gen
        model.step = step_fn
        del model, cache
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    shutil.rmtree(workdir, ignore_errors=True)
    mma_table.set_table(shipped)
    fused_gemv.set_fused_table(shipped_fused, forced=False)
    line = fused_gemv.picks_line(fused_gemv.tuned_picks())
    if line:
        print("\n" + line)
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def f(x, nd=2):
        return "" if x is None else f"{x:.{nd}f}"

    def delta(x):  # step ms against the first variant's, same body, head and prompt length
        return "" if x is None else f"{x:+.3f}"

    print(f"\n{cfg.name} synthetic, merged + Triton attention + CUDA graphs{' + compile' if compiled else ''}, "
          f"fused argmax; {a.prompts} prompts x {'/'.join(map(str, lengths))} -> {a.new} new (cache {max_ctx}, "
          f"window {window or cfg.sliding_window}); "
          f"{gpu}, copy bw {bw / 1e12:.2f} TB/s")
    print("| body | variant | head | GB/token | head MB | tok/s | step ms | vs first variant | MBU | head us | "
          "identity vs full | prefix | identity vs first variant | prompt |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['body']} | {r['variant']} | {r['head']} | failed: {r['error'][:80]} | | | | | | | | | | |")
            continue
        print(f"| {r['body']} | {r['variant']} | {r['head']} | {r['gb_per_token']:.3f} | {r['head_mb']:.1f} | "
              f"{r['tps']:.1f} | {r['step_ms']:.3f} | {delta(r['step_ms_vs_first'])} | {f(r['mbu'])} | "
              f"{r['head_us']:.1f} | {r['identity_rate']:.2f} | {r['prefix_mean']:.0f} | {f(r['identity_vs_first'])} | "
              f"{r['prompt_len']} |")


if __name__ == "__main__":
    main()
