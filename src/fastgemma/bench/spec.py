"""Speculative decoding on one GPU, in one process: tok/s vs depth k and vs acceptance profile, with
the sliding window native vs 188, on the int4 stack (merged q|k|v and gate|up, W4A16 g128 body,
an int4 or pruned head + fused argmax, Triton split-KV attention, CUDA graphs). Same synthetic
weights for all.

    python -m fastgemma.bench.spec --prompts 4 --prompt-len 256 --new 512

Rows per window and prompt length (`--prompt-len 256 4096 32768`: one cache sized for the longest, so
the step's graphs are captured once for all lengths): the AR baseline (GraphStep), `mtp` (the untrained
synthetic drafter's own drafts: the cost floor, ~1 token per step), then `replay` for each depth and
profile: the drafter runs k steps per verify (its cost counted) and its drafts follow the reference
trace with the profile's per-position odds. Reference traces are primed once per (window, depth,
length), untimed. Step time is split into draft / verify / accept with CUDA events between the three
graphs (a separate pass).
Speculative rows also carry `identity_rate` and `diverge_at` (per prompt, the first position where
the tokens leave AR's; the length when equal), against the AR tokens of the same prompt path (with
several --prefill paths, a later path's AR row reports its identity against the first path's), and
the verify pass's teacher-forced top-1 agreement with the AR step over AR's trace of the first
prompt (`top1_agree`, `top1_agree_confident`, `max_abs_diff`; the issue's bf16 check, skipped with
--no-agreement).
Prints one JSON line per row (--out: JSONL), then a markdown table last.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import tempfile
import time

import torch

from ..engine.cache import KVCache
from ..engine.generator import Generator
from ..engine.speculative import PROFILES, Replay, SpecGenerator, expected_tokens_per_step
from ..engine.steps import GraphStep, StaticStep
from ..kernels import w4a16, w4a16_table
from ..metrics.acceptance import acceptance_summary
from ..metrics.identity import common_prefix, top1_agreement
from ..model.config import preset
from ..model.drafter import synthetic_drafter
from .floor import floor_option
from .stack import VARIANT_OPTS, attn_tiles_arg, fused_table_arg, mma_table_arg, random_prompts, variant_options


def build_stack(cfg, dev, head: str, dtype=torch.bfloat16, fuse: bool = False, variant: str = "base",
                attn_tiles: str = ""):
    """Synthetic weights -> merged projections -> int4 body -> Triton attention (bench.stack's int4
    body; fuse: with its fused one-row step, which the AR rows and the drafter can take and the
    k+1-row passes do not) -> head (on a CPU, a smoke test of this script: the torch
    twins of every kernel). head: full | int8 | int4 | pruned:N[:int8|:int4] (rows: the eos ids, then seeded
    random ids; the pruned model's own greedy trace is the reference, so the keepset only sets the
    cost). variant: the fused step's options (bench.stack.parse_variant); attn_tiles: fuse.attn_tiles."""
    from ..transforms.sampler import FusedArgmax
    from .stack import build_body, keepset, parse_head, set_head

    kind, rows, rows_dtype = parse_head(head)
    model, desc = build_body(cfg, dev, "int4", dtype, fuse=fuse, variant=variant, attn_tiles=attn_tiles)
    with tempfile.TemporaryDirectory() as tmp:  # a pruned head's keepset file, read by apply()
        keep = keepset(list(cfg.eos_ids), rows, cfg.vocab_size) if rows else None
        desc["lm_head"] = set_head(model, kind, rows, keep, dev, tmp, rows_dtype)[1]
    return model, FusedArgmax("triton" if dev.startswith("cuda") else "torch"), desc


def use_verify_tiles(name: str) -> None:
    """The W4A16 tiles of the verify pass (M = 2..16): per_group (the table: the per-group kernel on
    packed scale / zero words) | separate (the per-group kernel's previous table on separate scales /
    zeros) | mma (the first tl.dot kernel's table). Tiles and PACKED_SZ are read at launch, so this
    holds for every graph captured after it."""
    if name not in _TILES:
        raise SystemExit(f"unknown verify tiles {name!r}; known: {', '.join(_TILES)}")
    w4a16_table.CONFIGS.update(_TILES[name])
    w4a16.PACKED_SZ = name != "separate"


def _tile_tables() -> dict:
    return {"per_group": {k: v for k, v in w4a16_table.CONFIGS.items() if k in w4a16_table.MMA_M16},
            "separate": dict(w4a16_table.PER_GROUP_SEPARATE), "mma": dict(w4a16_table.MMA_M16)}


_TILES = _tile_tables()


def sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(gen, prompts, new: int) -> tuple[list, float]:
    sync()
    t = time.perf_counter()
    outs = [gen.generate(p, new) for p in prompts]
    sync()
    return outs, time.perf_counter() - t


def summarize(name, window, k, profile, outs, wall, ar_tokens=None) -> dict:
    steps = [s for o in outs for s in o.step_s]
    per = [n for o in outs for n in o.tokens_per_step]
    n_tok = sum(len(o.tokens) for o in outs)
    row = dict(spec=name, window=window, depth=k, profile=profile, tps=n_tok / wall,
               tokens_per_step=sum(per) / len(per) if per else None,
               step_ms=statistics.median(steps) * 1e3 if steps else None,
               ttft_ms=statistics.median(o.ttft_s for o in outs) * 1e3)
    row.update(acceptance_summary(outs))
    if profile:
        row["expected_tokens_per_step"] = expected_tokens_per_step(PROFILES.get(profile, [0.0]), k)
    row["replay_mismatch"] = sum(getattr(o, "replay_mismatch", 0) for o in outs)
    if ar_tokens is not None:
        row["identity_rate"] = sum(o.tokens == r for o, r in zip(outs, ar_tokens)) / len(outs)
    return row


def split_ms(gen, prompt, new) -> dict:
    """Median draft / verify / accept ms per step over one request (events between the graphs)."""
    gen.split_timing = True
    try:
        gen.generate(prompt, new)
    finally:
        gen.split_timing = False
    return {f"{k}_ms": statistics.median(v) * 1e3 for k, v in gen.last_split_s.items() if v}


# the k+1-row pass's on / off switches (default on): what on and off mean
VERIFY_SWITCHES = {
    "--verify-norms": "residual updates + norms of the k+1-row pass in kernels/residual_norm.py (on) or compiled "
                      "torch (off)",
    "--verify-pdl": "the k+1-row pass's GEMMs and norm kernels launched with programmatic dependent launch (on) or "
                    "plainly (off)",
    "--verify-qkv": "the k+1-row pass's q/k/v norms, RoPE and cache writes in one kernel per layer (on) or compiled "
                    "torch (off)",
    "--attn-pdl": "the k+1-row pass's attention kernels launched with programmatic dependent launch (on) or plainly "
                  "(off)",
}


# record key -> fused_verify's keyword for each switch of the fused k+1-row pass
VERIFY_KWARGS = {"verify_norms": "norm_kernels", "verify_pdl": "pdl", "verify_qkv": "qkv_kernel",
                 "attn_pdl": "attn_pdl", "verify_mma": "int4_mma", "verify_attn_qkv": "attn_qkv"}


def _switch_key(flag: str) -> str:
    """A VERIFY_SWITCHES flag -> its record key ('--verify-pdl' -> 'verify_pdl')."""
    return flag[2:].replace("-", "_")


def _on_off(flag: str, value: str) -> list[str]:
    """A comparison flag's rows: on, off, or both in the order given."""
    rows = [x for x in value.split(",") if x]
    if not rows or set(rows) - {"on", "off"}:
        raise SystemExit(f"{flag} {value!r}: on, off or on,off")
    return rows


def use_prefill(gen, name: str, prompt_len: int) -> None:
    """The generator's prompt path (bench.prefill's variants), its graphs captured up to prompt_len."""
    from .prefill import set_variant

    set_variant(gen, name)
    gen.warm_prefill(prompt_len)


def profile_phases(gen, steps: int, top: int = 20, floor=None) -> dict:
    """Kernels of the captured draft and verify graphs, `steps` replays each at the generator's
    current state (replaying them alone changes only the drafts, the verify rows and their cache
    rows): {phase: bench.timeline's summary (each kernel's own time and its share of the phase's
    critical path, per kernel and grid)}, printed as tables; `floor` (bench.floor's figures): with
    each kernel's boundaries."""
    from .timeline import print_groups, summarize, trace_kernels, with_floor

    out = {}
    for phase, g in zip(("draft", "verify"), gen._graphs):
        row = summarize(trace_kernels(g.replay, steps), top)
        if floor is not None:
            row = with_floor(row, floor)
        out[phase] = row
        print_groups(row, f"{phase} graph")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[256],
                    help="prompt tokens; several: rows for each, one cache sized for the longest (the speculative "
                         "step at long context in one process)")
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--depths", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--profiles", default="frontier,stock,chat", help=f"names from {sorted(PROFILES)}")
    ap.add_argument("--windows", default="native,188", help="native or a number of keys")
    ap.add_argument("--head", default="int4", help="full, int8, int4 or pruned:N[:int8|:int4] (N rows in bf16, or int8 / int4; fused sparse "
                         "argmax)")
    ap.add_argument("--mtp-depth", type=int, default=7, help="depth of the untrained-drafter cost row (0: skip)")
    ap.add_argument("--centroid-top-k", type=int, default=0, help="0: the drafter's own (32)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the step bodies before capture (slow)")
    ap.add_argument("--no-agreement", dest="agreement", action="store_false",
                    help="skip the teacher-forced top-1 agreement of the verify pass with the AR step")
    ap.add_argument("--verify-tiles", default="per_group",
                    help="int4 tiles of the k+1-row passes, comma-separated to compare in one run: per_group, "
                         "separate (per-group, separate scales / zeros), mma")
    ap.add_argument("--fuse", default="none", choices=("none", "layers"),
                    help="layers: the body's fused one-row step (fuse=layers fuse.pdl=true) for the AR rows")
    ap.add_argument("--drafter-steps", default="",
                    help="fused (fuse=layers' drafter step, with --variant's options and kernels/draft_head.py "
                         "for its head), fused_torch_head (the same with torch's topk head), fused_base (without "
                         "the q kernel and the attention's PDL), unfused; comma-separated, one row each; default: "
                         "fused with --fuse layers")
    ap.add_argument("--split-fixup", default="on",
                    help="int4 split-K partials summed in the kernel (on) or by a second launch (off); on,off: both")
    ap.add_argument("--verify-epilogues", default="on",
                    help="with --fuse layers: GeGLU and the PLE gate's gelu * input in the k+1-row pass's GEMM "
                         "stores (on) or in torch after them (off); on,off: a row each")
    for flag, what in VERIFY_SWITCHES.items():
        ap.add_argument(flag, default="on", help=f"with --fuse layers and epilogues on: {what}; on,off: a row each")
    ap.add_argument("--verify-mma", default="",
                    help="with --fuse layers and epilogues on and 'mma' in --variant: the k+1-row pass's int4 GEMMs on "
                         "kernels/mma_w4a16.py where its table has the shape (on) or the per-group kernel (off); "
                         "on,off: a row each (default: as --variant says)")
    ap.add_argument("--verify-attn-qkv", default="off",
                    help="with --fuse layers and epilogues on: the k+1-row pass's q/k/v norms, RoPE and cache writes in "
                         "the attention's split kernel (on; not the engine's: fuse.attn_qkv is the one-row step's and "
                         "the drafter's) or as --verify-qkv says (off); on,off: a row each")
    ap.add_argument("--mma-table", default="",
                    help="with 'mma' in --variant: the tensor-core int4 kernel's table for this run instead of "
                         "its own, as bench.stack --mma-table writes it (e.g. 'down@8=1x1s8,o_full@1=2x8', or 'none'; "
                         "'+ENTRIES': the shipped table with those entries changed, e.g. '+gate|up@1=cuda5x8g')")
    ap.add_argument("--fused-table", default="",
                    help="with --fuse layers: the fused one-row GEMVs' tiles for this run (the AR step's and the "
                         "drafter's; kernels/fused_gemv.FUSED_CONFIGS, given here on any GPU), as bench.stack "
                         "--fused-table takes one (e.g. '+draft_down=2x1024w4', or 'none': every shape autotuned)")
    ap.add_argument("--attn-tiles", default="",
                    help="with --fuse layers and 'attn_qkv' in --variant: the q/k/v attention mode's tiles per layer "
                         "kind (fuse.attn_tiles, as bench.stack --attn-tiles takes one: e.g. "
                         "'sliding_query:32x8s2e1', the KV-shared sliding layers' first K / V block into registers "
                         "before the PDL wait, the verify pass's per-position tiles included)")
    ap.add_argument("--variant", default="attn_pdl+qkv",
                    help="with --fuse layers: the one-row AR step's and the fused drafter's options, as bench.stack "
                         f"--variants: base, or options joined by '+' ({', '.join(VARIANT_OPTS)})")
    ap.add_argument("--profile-phases", type=int, default=0,
                    help="N > 0: trace N replays of the first speculative row's draft and verify graphs "
                         "(bench.timeline: each kernel's own time and its share of the graph's critical path)")
    ap.add_argument("--floor", default=None, metavar="FILE",
                    help="with --profile-phases: bench.floor's JSONL; each kernel's boundary at its grid's PDL "
                         "figure and the critical path above it")
    ap.add_argument("--prefill", default="graph",
                    help="the prompt's path, comma-separated for one row each (same captured decode graphs): "
                         "eager, graph (padded, one CUDA graph per padded length: graphs=cuda_graph), "
                         "layers_graph (+ each decoder layer's regions compiled: graphs=compiled), compiled_graph "
                         "(+ the whole forward compiled: graphs.compile_prefill=true), compiled, layers")
    ap.add_argument("--bookkeeping", default="on",
                    help="the accept bookkeeping and replay's drafts in one kernel each (on: kernels/spec_accept.py) "
                         "or as torch ops (off: their twins); on,off: a row each (a CPU without TRITON_INTERPRET "
                         "takes the torch ops either way)")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the script's logic on torch twins (smoke test)")
    a = ap.parse_args(argv)
    dev = a.device
    cuda = dev.startswith("cuda")
    floor = floor_option(a.floor, a.profile_phases > 0, "--profile-phases")
    if min(a.prompt_len) < 1 or a.new < 1:
        raise SystemExit(f"--prompt-len and --new must be >= 1, got {a.prompt_len} and {a.new}")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("fastgemma.bench.spec measures CUDA graphs on a GPU; no CUDA device here")
    if a.compile:  # one specialisation per (window, depth) generator
        for key in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, key):
                setattr(torch._dynamo.config, key, 256)
    cfg = preset(a.model)
    from .prefill import VARIANTS as PREFILL

    prefills = [x for x in a.prefill.split(",") if x]
    if not prefills or set(prefills) - set(PREFILL):
        raise SystemExit(f"--prefill {a.prefill!r}: {', '.join(PREFILL)}")
    if a.mma_table:
        from ..kernels.mma_table import set_table

        set_table(mma_table_arg(a.mma_table))  # this process's table
    if a.fused_table:
        from ..kernels.fused_gemv import set_fused_table

        set_fused_table(fused_table_arg(a.fused_table))  # this process's table
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.time()
    if a.attn_tiles and (a.fuse != "layers" or "attn_qkv" not in variant_options(a.variant)):
        raise SystemExit("--attn-tiles sets the q/k/v attention mode's tiles: give --fuse layers and a --variant "
                         "with attn_qkv")
    a.attn_tiles = attn_tiles_arg(a.attn_tiles or "default")
    model, sampler, stack = build_stack(cfg, dev, a.head, dtype, fuse=a.fuse == "layers", variant=a.variant,
                                        attn_tiles=a.attn_tiles)
    if a.fused_table:
        stack["fused_table"] = a.fused_table
    steps = [x for x in (a.drafter_steps or ("fused" if a.fuse == "layers" else "unfused")).split(",") if x]
    fused_steps = {"fused", "fused_base", "fused_torch_head"}
    if set(steps) - fused_steps - {"unfused"} or (set(steps) & fused_steps and a.fuse != "layers"):
        raise SystemExit(f"--drafter-steps {a.drafter_steps!r}: fused, fused_base, fused_torch_head, unfused; the fused "
                         "ones need --fuse layers")
    drafters = {}
    for name in steps:  # the same seeded weights; fusing merges gate|up of its own copy
        d = synthetic_drafter(cfg, dev, dtype, seed=0)
        d.set_top_k(a.centroid_top_k or None)
        if name != "unfused":
            # fused_base: without the q kernel and the attention's PDL, whatever --variant says
            extra = dict(attn_pdl=False, qkv_kernel=False) if name == "fused_base" else {}
            if name == "fused_torch_head":
                extra["head"] = None
            d = model.fuse_drafter(d, **extra)
        drafters[name] = d
    drafter = next(iter(drafters.values()))
    fixups = _on_off("--split-fixup", a.split_fixup)
    bookkeeping = _on_off("--bookkeeping", a.bookkeeping)
    epilogues = _on_off("--verify-epilogues", a.verify_epilogues)
    # the fused k+1-row pass's switches: record key -> its rows (on / off)
    switch_rows = {_switch_key(flag): _on_off(flag, getattr(a, _switch_key(flag))) for flag in VERIFY_SWITCHES}
    variant_mma = a.fuse == "layers" and "mma" in variant_options(a.variant)
    switch_rows["verify_mma"] = _on_off("--verify-mma", a.verify_mma or ("on" if variant_mma else "off"))
    switch_rows["verify_attn_qkv"] = _on_off("--verify-attn-qkv", a.verify_attn_qkv)
    if "on" in switch_rows["verify_mma"] and not variant_mma:
        raise SystemExit("--verify-mma on needs 'mma' in --variant (it gives the int4 linears the kernel's copy)")
    switch_sets = [dict(zip(switch_rows, rows)) for rows in itertools.product(*switch_rows.values())]
    fused_verify = model.fused_verify  # None without --fuse layers

    def verify_variant(switches: dict):
        """fused_verify with each switch on or off (VERIFY_KWARGS: the norm kernels or compiled torch,
        PDL launches, the q/k/v kernel or compiled torch, the attention's PDL, the tensor-core int4 kernel)."""
        keywords = {VERIFY_KWARGS[n]: v == "on" for n, v in switches.items()}
        return functools.partial(fused_verify.func, *fused_verify.args, **{**fused_verify.keywords, **keywords})
    sync()
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{gpu} | {cfg.name} synthetic | stack built in {time.time() - t0:.1f}s | drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params, {drafter.nbytes_per_step() / 1e6:.1f} MB "
          f"read per draft step (top-{drafter.top_k} centroids)", flush=True)
    lengths = a.prompt_len
    prompts, max_ctx = random_prompts(cfg, lengths, a.prompts, a.new)
    depths = [int(x) for x in a.depths.split(",") if x]
    max_rows = getattr(model, "max_verify_rows", None)  # fuse.batch_invariant on the tensor-core kernel: 8
    if max_rows is not None and max(depths + [a.mtp_depth]) + 1 > max_rows:
        raise SystemExit(f"--depths {a.depths} (--mtp-depth {a.mtp_depth}): with 'inv' in --variant the verify pass's "
                         f"int4 linears take at most {max_rows} rows, so depths <= {max_rows - 1}")
    profiles = [p for p in a.profiles.split(",") if p]
    rows = []
    profiled = False

    def emit(row, plen):
        row.update(gpu=gpu, model=cfg.name, head=a.head, compile=a.compile, prompts=a.prompts,
                   prompt_len=plen, new=a.new, variant=a.variant if a.fuse == "layers" else None)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for wname in a.windows.split(","):
        window = None if wname == "native" else int(wname)
        wlabel = window or cfg.sliding_window
        cache = KVCache(cfg, 1, max_ctx, window=window, device=dev, dtype=dtype)
        step = (GraphStep if cuda else StaticStep)(model, cache, sampler, compile=a.compile)
        ar = Generator(model, cache, step, sampler=sampler)
        step.prepare()
        base = {}  # each length's AR row on the first prompt path: the speculative rows' "x AR"
        ar_forced = None
        ar_by_prefill = {}  # (path, length): AR tokens, a speculative row's reference (bf16 paths round apart)
        for pname in prefills:
            use_prefill(ar, pname, max(lengths))
            for plen in lengths:
                ps = prompts[plen]
                # warm-up at the timed length, as the speculative rows warm up: the eager prompt path compiles its
                # kernels for each prompt shape on first use, which a 32-token warm-up left inside the timed TTFT
                # (the AR row's tok/s and so every row's "x AR": run LU, TTFT 2,006.6 ms in a first process)
                ar.generate(ps[0], 8)
                outs, wall = timed(ar, ps, a.new)
                # identity of a later prompt path's AR tokens against the first path's
                first = ar_by_prefill.get((prefills[0], plen))
                row = summarize("none", wlabel, 0, None, outs, wall, first)
                row["prefill"] = pname
                ar_by_prefill[pname, plen] = [o.tokens for o in outs]
                if first is None:
                    base[plen] = row
                    if a.agreement and plen == lengths[0]:
                        ar_forced = ar.forced(ps[0], ar_by_prefill[pname, plen][0])
                emit(row, plen)
        del step, ar, cache
        if cuda:
            torch.cuda.empty_cache()

        plan = ([("mtp", a.mtp_depth)] if a.mtp_depth else []) + [("replay", k) for k in depths]
        fv = fused_verify is not None
        plan = [(tiles, dname, fix, epi, sw, book, kind, k) for tiles in a.verify_tiles.split(",")
                for dname in drafters for fix in fixups for epi in epilogues
                for sw in (switch_sets if fv and epi == "on" else [dict.fromkeys(switch_rows)])
                for book in bookkeeping for kind, k in plan]
        for tiles, dname, fix, epi, sw, book, kind, k in plan:
            use_verify_tiles(tiles)
            w4a16.SPLIT_FIXUP = fix == "on"  # read at launch: holds for the graphs captured below
            # read when the verify step is traced
            model.fused_verify = verify_variant(sw) if fv and epi == "on" else None
            cache = KVCache(cfg, 1, max_ctx, window=window, device=dev, dtype=dtype)
            replay = Replay(profiles[0]) if kind == "replay" else None
            gen = SpecGenerator(model, cache, drafters[dname], k, sampler=sampler, replay=replay, graphs=cuda,
                                compile=a.compile, fused_bookkeeping=None if book == "on" else False)
            t = time.perf_counter()
            gen.prepare()
            prep_s = time.perf_counter() - t
            prime_s = 0.0
            phases = None
            if a.profile_phases and cuda and gen._graphs is not None and not profiled:
                gen._reset_state(lengths[0])
                phases = profile_phases(gen, a.profile_phases, floor=floor)
                profiled = True
            primed = set()
            for prof, pname, plen in [(p, q, n) for p in (profiles if replay is not None else [None])
                                      for q in prefills for n in lengths]:
                if prof:
                    gen.set_profile(prof)
                if plen == lengths[0]:
                    use_prefill(gen, pname, max(lengths))
                ps = prompts[plen]
                if replay is not None and (pname, plen) not in primed:
                    # the reference trace through the prefill path timed: in bf16 another path's
                    # first hidden state rounds differently and the trace would leave the engine's
                    t = time.perf_counter()
                    for p in ps:
                        gen.prime(p, a.new)
                    prime_s = time.perf_counter() - t
                    primed.add((pname, plen))
                gen.generate(ps[0], a.new)  # warm-up
                outs, wall = timed(gen, ps, a.new)
                ref = ar_by_prefill[pname, plen]  # the AR tokens of the same prompt path and length
                row = summarize(kind, wlabel, k, prof, outs, wall, ref)
                row.update(split_ms(gen, ps[0], a.new), speedup=row["tps"] / base[plen]["tps"],
                           prepare_s=prep_s, prime_s=prime_s, verify_tiles=tiles, drafter_step=dname, split_fixup=fix,
                           verify_epilogues=epi if fused_verify is not None else None, **sw, prefill=pname,
                           bookkeeping="kernels" if gen.fused_bookkeeping else "torch",
                           diverge_at=[common_prefix(o.tokens, r) for o, r in zip(outs, ref)])
                if phases:
                    row["phase_kernels"], phases = phases, None
                if ar_forced is not None and pname == prefills[0] and plen == lengths[0]:
                    # the k+1-row pass vs the AR step on AR's trace
                    agree = top1_agreement(ar_forced, gen.forced_verify(ps[0], ref[0]))
                    row.update(top1_agree=agree["top1"], top1_agree_confident=agree["top1_confident"],
                               max_abs_diff=agree["max_abs_diff"])
                emit(row, plen)
            del gen, cache
            if cuda:
                torch.cuda.empty_cache()
    use_verify_tiles("per_group")  # the table as imported
    w4a16.SPLIT_FIXUP = True
    model.fused_verify = fused_verify

    if cuda:  # the drafter's GEMVs (and any other shape in no table) take the autotuner's tiles, per process
        from ..kernels.fused_gemv import picks_line, tuned_picks

        stack["fused_tuned"] = tuned_picks()
        if stack["fused_tuned"]:
            print(picks_line(stack["fused_tuned"]))
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps({"stack": stack}) + "\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def f(x, nd=2):
        return "" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    fused = f" + fused one-row step ({a.variant})" if a.fuse == "layers" else ""
    stack_txt = (f"merged{fused} + int4 g128 body + {a.head} head + fused argmax + Triton attention + CUDA graphs"
                 f"{' + compile' if a.compile else ''}" if cuda else "cpu smoke test: torch twins, no graphs")
    print(f"\n{cfg.name} synthetic, {stack_txt}; {a.prompts} prompts x {' / '.join(map(str, lengths))} -> {a.new} "
          f"new; {gpu}")
    print("| prompt | window | spec | tiles | drafter | split fixup | epilogues | norms | pdl | qkv | attn pdl | mma | "
          "attn qkv | prefill | bookkeeping | "
          "profile | k | "
          "tok/s | x AR | tok/step | "
          "expected | accept_mean | draft ms | verify ms | accept ms | step ms | TTFT ms | identity | diverge at | "
          "top1 vs AR | top1 conf | accept_by_pos |")
    print("|" + "---|" * 32)
    for r in rows:
        abp = " ".join(f"{x:.2f}" for x in (r.get("accept_by_pos") or []) if x is not None)
        print(f"| {r['prompt_len']} | {r['window']} | {r['spec']} | {r.get('verify_tiles', '')} | "
              f"{r.get('drafter_step', '')} | "
              f"{r.get('split_fixup', '')} | {r.get('verify_epilogues') or ''} | {r.get('verify_norms') or ''} | "
              f"{r.get('verify_pdl') or ''} | {r.get('verify_qkv') or ''} | {r.get('attn_pdl') or ''} | "
              f"{r.get('verify_mma') or ''} | {r.get('verify_attn_qkv') or ''} | {r.get('prefill', '')} | "
              f"{r.get('bookkeeping', '')} | "
              f"{r['profile'] or ''} | {r['depth'] or ''} | {f(r['tps'], 1)} | "
              f"{f(r.get('speedup'))} | {f(r['tokens_per_step'])} | {f(r.get('expected_tokens_per_step'))} | "
              f"{f(r.get('accept_mean'))} | {f(r.get('draft_ms'), 3)} | {f(r.get('verify_ms'), 3)} | "
              f"{f(r.get('accept_ms'), 3)} | {f(r['step_ms'], 3)} | {f(r['ttft_ms'], 1)} | {f(r.get('identity_rate'))} | "
              f"{' '.join(str(x) for x in r.get('diverge_at') or [])} | {f(r.get('top1_agree'), 4)} | "
              f"{f(r.get('top1_agree_confident'), 4)} | {abp} |")


if __name__ == "__main__":
    main()
