#!/usr/bin/env bash
# The GPU benchmarks in one command, each part under its own time limit, logs under $OUT (or
# ./results/h200), short tables last. Parts (any order, default all):
#   profile   kernels per decode step and where the time goes (bench.profile)
#   gemv      our bf16 GEMV vs cuBLAS on every E4B shape, with a tile sweep (kernels.gemv.bench_shapes)
#   chain     the step's 252 body GEMVs alone in one CUDA graph: cuBLAS, plain, prefetch, PDL (bench.chain)
#   verifychain the verify pass's int4 GEMMs, PLE gate and residual-norm kernels alone in one CUDA graph, plain
#             vs PDL launches, alternating rounds, bit identity checked (bench.verify_chain; VERIFYCHAIN_ARGS,
#             e.g. "--qkv-kernel": kernels/qkv_finish.py between q|k|v and o)
#   int4      W4A16 kernel vs cuBLAS bf16 on every E4B shape, with a tile sweep (kernels.w4a16_bench); INT4_MS=8
#             sweeps the verify pass's row count instead of one row (INT4_MS=1,8: both), INT4_SHAPES=qkv,o
#             a subset, INT4_PER_GROUP=1 only the per-group tl.dot kernel's candidates, INT4_PACKED=0 the
#             per-group kernel on separate scales / zeros (default: the packed words, as the engine runs it)
#   mma       the int4 GEMV on the tensor cores (kernels/mma_w4a16.py) vs the current kernels, 1 and 8 rows,
#             every E4B shape (kernels/mma_bench.py); MMA_CASES=name,..., MMA_MS=1,8, MMA_TRY=1x4s4,2x4d2,...
#             (those configs instead of every candidate: TxW[dD][iI][sS][pR][f][nH][rG][g] or cudaWxS[cC][g]); MMA_HOT=1
#             each kernel also on weights kept in the L2 (one copy, called again and again); writes the entries
#             faster alone than the shipped table's to mma_faster.txt (`bench.stack --mma-table +$(cat ...)`)
#   rows      the dense rows GEMV (kernels/rows_gemv.py: the PLE gate at 1..16 rows) per tile against the skinny GEMM,
#             alone, outputs checked (ROWS_MS=1,8 the row counts); prints CONFIGS lines
#   stream    the fused one-row bf16 GEMV streamed by a few programs a multiprocessor (kernels/stream_gemv.py)
#             against the shipped one-program-per-tile launch, alone, outputs checked; STREAM_ARGS, e.g.
#             "--cases gate|up --tiles 8x512w4p2d8"; its last line is a `bench.stack --fused-table` value
#             (written to stream_table.txt) with each case's fastest tiles
#   int4fused the fused int4 GEMV's tiles per fuse=layers case, each output checked (fused_w4a16.bench_tiles;
#             prints TILES lines); INT4FUSED_CASES="gate|up,down" a subset (names of fused_w4a16.E4B_CASES)
#   stack     body (bf16 / int4 / int8 / nf4) x head (full / int8 / int4 / pruned) decode table (bench.stack;
#             STACK_ARGS, e.g. "--bodies int4 --variants base,attn_pdl+qkv": the fused step's options per
#             body; "--timeline 3 --floor $OUT/floor.jsonl" after the floor part: each kernel against its
#             boundary); nf4 needs bitsandbytes (a wheel in .whl)
#   loo       leave-one-out of the frontier AR step (bench.stack, window 188): the int4 body with every fused option,
#             then with each left out (an option that needs it leaves with it: afold, fold, attn_qkv, mma,
#             attn_pdl, tail, start, ple, adv, all), each with the full head and the frontier's pruned int8 rows,
#             in one process, so the `vs first variant` column is what each option buys; then two more processes,
#             the whole stack at the native window, and the bf16 and int8 (quant=int8) bodies' one-row steps at
#             window 188 (their steps against the first row: across processes). LOO_HEADS (default "pruned:12288:int8") for other heads
#   attention a store layer's attention with its q/k/v work at one row by path and tiles, full layers at
#             300-32k tokens of context (bench.attention; ATTENTION_ARGS, default --qkv; "" for the split
#             kernel alone vs its twin)
#   head      the LM head: full / int8 / int4 / pruned, fused argmax (bench.head)
#   drafthead the MTP drafter's centroid-masked head: torch's path vs kernels/draft_head.py (bench.draft_head)
#   draftloop the k-step draft loop: the fused drafter step vs kernels/draft_loop.py's persistent kernel, drafts
#             compared, and a grid barrier alone (bench.draft_loop; DRAFTLOOP_ARGS, e.g. "--programs 132,66
#             --splits 16,32 --barriers 1000")
#   floor     what one dependent kernel boundary costs: chains of tiny phases (read the previous vector, one
#             dot, write a share) as stream-ordered launches, PDL launches, or one launch with grid
#             barriers, per program count, each chain checked against its twin (bench.floor; FLOOR_ARGS,
#             default "--no-work": the boundary alone too)
#   l2ahead   the store layer's four int4 GEMVs (E4B shapes, the table's one-row configs, PDL) with the next
#             kernels' weights asked into the L2 from a side branch of the graph (kernels/l2_prefetch.py), per
#             plan TARGET[+1]@PHASE,..., outputs checked against the plan 'none' (bench.l2_ahead; L2AHEAD_ARGS,
#             e.g. "--plans none down@gu --layers 16 --chunk-kb 16")
#   floorstep a step's chain of phases at its own shapes: a layer's launches (programs, MB streamed each) repeated,
#             pdl vs pdl_ahead, checked against the twin (bench.floor_step; FLOORSTEP_ARGS, e.g. "--layer
#             96:4.2,64:0,... --layers 42"; default: the int4 frontier step's store layer)
#   prefill   time to first token per prompt length and prompt path: eager, compiled, graph (padded,
#             one CUDA graph per padded length), compiled_graph, layers / layers_graph (each decoder layer's
#             regions compiled instead of the whole forward) (bench.prefill; PREFILL_ARGS, e.g.
#             "--variants graph,compiled_graph --prompt-lens 100,256,1024"; compiling takes ~4 min)
#   spec      speculative decoding: depth x acceptance profile x window (bench.spec); compiled, as in
#             docs/results.md: SPEC_ARGS="--compile --depths 7 --profiles frontier --mtp-depth 0 --prompts 2
#             --prompt-len 256 --new 256" (~4 min per window: the k=7 graphs compile for ~200 s); with
#             --fuse layers, --verify-epilogues off,on compares the verify pass's GEMM epilogues in one run
#             (--verify-norms on,off: its norm kernels; --verify-pdl on,off: its PDL launches; --attn-pdl,
#             --verify-qkv: its attention's PDL and q/k/v kernel; --variant: the AR step's and drafter's;
#             --bookkeeping on,off: the accept bookkeeping's kernels against its torch ops;
#             --prompt-len 256 4096 16384 32768: rows per length, one cache sized for the longest;
#             --profile-phases 3 --floor $OUT/floor.jsonl after the floor part: each graph's kernels against their boundaries)
#   invariance each kernel's rows at one row vs among 8 (E4B shapes, bf16), and a k+1-row pass of the
#             fuse.batch_invariant step against k+1 one-row steps (bench.invariance; INVARIANCE_ARGS, e.g.
#             "--compile", "--variant attn_pdl+qkv+mma": the default step for contrast)
#   fold      the norm fold's consumer (gate|up after o, q|k|v after the PLE projection) on the table's one-row
#             entry (gate|up: the CUDA kernel) and on FOLD_TRY's configs (default "2x4d5p9fg": gate|up's Triton
#             entry), output and h checked against the twin, words rotated out of L2 (kernels/mma_fold.bench_fold;
#             FOLD_CASES="gate|up"; FOLD_PLAIN=1: each config's plain launch on the same rows too)
#   counters  Nsight Compute counters of the int4 kernels per E4B shape at 1 and 8 rows: time, DRAM, issue,
#             resident warps, stalls, instructions per weight (bench.counters; COUNTERS_ARGS, e.g. "--ms 8
#             --shapes gate|up,down --separate"; --mma 2x4d2,2x4d5p9f: the tensor-core kernel per config)
#   agreement each fast path's top-1 agreement with fp32 arithmetic on the same weights (bench.agreement)
#   gptq      GPTQ's rounding of every E4B linear shape with the column loop as torch ops against the Triton launch
#             a block (kernels/gptq_columns.py), codes compared, the model's total (bench.gptq; GPTQ_ARGS, e.g.
#             "--no-act-order --group-size 64")
#   cli       the CLI's bench task as a user runs it: `fastgemma $CLI_ARGS` (default: experiment=frontier on 8
#             challenge prompts, 2 warm-up requests), JSONL logger, its setup phases' seconds and result line
#             (CLI_NAME=NAME: its log NAME.log and run folder NAME/ instead of cli, so two CLI runs of one call
#             keep both, the time limit still CLI_S)
#   ladder    the decode ladder with identity against eager and transformers' own figure (bench.ladder)
# COMPILE_CACHE=DIR keeps torch.compile's and Triton's caches in DIR/inductor and DIR/triton, so a later
#   run on the same software skips most compiles (H200: compiling the prompt's forward took 177 s
#   fresh, 66 s with the caches of an earlier run).
# Environment: PART_S (seconds per part, default 420), STREAM_ARGS, LADDER_VARIANTS, AGREEMENT_VARIANTS, SPEC_ARGS, STACK_ARGS, ATTENTION_ARGS, PREFILL_ARGS, PROFILE_VARIANTS, COUNTERS_ARGS,
#   INT4_MS. The fused step: LADDER_VARIANTS=compiled_triton_merged_gemv,compiled_triton_fused_pdl,compiled_triton_fused
#   LADDER_ARGS="--hf-new 0 --hf-check 0" (skip transformers' figure), PROFILE_VARIANTS=compiled_triton_fused_pdl.
#   bash sweeps/h200.sh profile int4
# On a GPU box without a registry, wheels in ./.whl (downloaded beforehand on a machine with one,
# e.g. with bitsandbytes for the stack part's nf4 body) are installed first into /tmp/site.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/results/h200}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src"
if [ -n "${COMPILE_CACHE:-}" ]; then
  mkdir -p "$COMPILE_CACHE/inductor" "$COMPILE_CACHE/triton"
  export TORCHINDUCTOR_CACHE_DIR="$COMPILE_CACHE/inductor" TRITON_CACHE_DIR="$COMPILE_CACHE/triton"
fi
[[ "${CLI_NAME:-cli}" =~ ^[a-z][a-z0-9_]*$ ]] || { echo "CLI_NAME is lower-case letters, digits and _ (a log's name), got '${CLI_NAME}'" >&2; exit 2; }
part_s="${PART_S:-420}"  # or per part: LOO_S, LOO_NATIVE_S, LOO_BODIES_S, GEMV_S, STREAM_S, CHAIN_S, VERIFYCHAIN_S, INT4_S, INT4FUSED_S, STACK_S, ATTENTION_S, FLOOR_S, PROFILE_S, HEAD_S, PREFILL_S, SPEC_S, GPTQ_S, AGREEMENT_S, CLI_S, LADDER_S
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(profile int4 head spec ladder)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$out/gpu.txt"

run() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS limit_var="${name^^}_S"
  timeout "${!limit_var:-$part_s}" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

for p in "${parts[@]}"; do
  case $p in
    profile) run profile python3 -m fastgemma.bench.profile \
               --variants "${PROFILE_VARIANTS:-graph_triton_merged,compiled_triton_merged,compiled_triton_merged_int4}" \
               --out "$out/profile.jsonl" ;;
    gemv) run gemv python3 -c 'from fastgemma.kernels.gemv import bench_shapes; bench_shapes(sweep=True, rep_ms=10)' ;;
    chain) run chain python3 -m fastgemma.bench.chain --out "$out/chain.jsonl" ;;
    int4) run int4 python3 -c "from fastgemma.kernels.w4a16_bench import bench_shapes, E4B_SHAPES as S
sh = '${INT4_SHAPES:-}'
bench_shapes(ms=(${INT4_MS:-1},), shapes={k: S[k] for k in sh.split(',')} if sh else None, sweep=True, rep_ms=10,
             per_group_only='${INT4_PER_GROUP:-0}' == '1', packed='${INT4_PACKED:-1}' == '1')" ;;
    stack) run stack python3 -m fastgemma.bench.stack ${STACK_ARGS:-} --out "$out/stack.jsonl" ;;
    loo) c=attn_pdl+mma+attn_qkv n=tail+start+ple+adv f=$c+fold+afold+$n h="${LOO_HEADS:-pruned:12288:int8}"
         v="$f,$c+fold+$n,$c+$n,attn_pdl+mma+fold+$n,attn_pdl+attn_qkv+$n,mma+attn_qkv+fold+afold+$n,$c+fold+afold"
         v="$v+start+ple+adv,$c+fold+afold+tail+ple+adv,$c+fold+afold+tail+start+adv,$c+fold+afold+tail+start+ple,base"
         run loo python3 -m fastgemma.bench.stack --bodies int4 --heads $h --window 188 --new 256 --out "$out/loo.jsonl" \
           --variants "$v"
         run loo_native python3 -m fastgemma.bench.stack --bodies int4 --heads $h --window native --new 256 --variants "$f"
         run loo_bodies python3 -m fastgemma.bench.stack --bodies bf16 int8 --heads $h --window 188 --new 256 \
           --variants attn_pdl+attn_qkv ;;
    attention) run attention python3 -m fastgemma.bench.attention ${ATTENTION_ARGS---qkv} ;;
    int4fused) run int4fused python3 -c "from fastgemma.kernels.fused_w4a16 import bench_tiles, E4B_CASES as C
cs = '${INT4FUSED_CASES:-}'
bench_tiles({k: C[k] for k in cs.split(',')} if cs else None)" ;;
    mma) run mma python3 -c "from fastgemma.kernels.mma_bench import bench_mma, faster_entries
from fastgemma.kernels.mma_table import parse_config
from fastgemma.kernels.fused_w4a16 import E4B_CASES as C
cs, try_ = '${MMA_CASES:-}', '${MMA_TRY:-}'
rows = bench_mma({k: C[k] for k in cs.split(',')} if cs else None, ms=tuple(int(m) for m in '${MMA_MS:-1,8}'.split(',')),
                 configs=[parse_config(c) for c in try_.split(',')] if try_ else None, hot='${MMA_HOT:-0}' == '1')
e = faster_entries(rows)
open('$out/mma_faster.txt', 'w').write(e)
print('# faster alone than the table (bench.stack --mma-table +ENTRIES):', e or 'none')" ;;
    fold) run fold python3 -c "from fastgemma.kernels.mma_fold import bench_fold, FOLD_CASES as C
from fastgemma.kernels.mma_table import parse_config
cs, try_ = '${FOLD_CASES:-}', '${FOLD_TRY-2x4d5p9fg}'
bench_fold({k: C[k] for k in cs.split(',')} if cs else None, configs=[parse_config(c) for c in try_.split(',') if c],
           plain='${FOLD_PLAIN:-0}' == '1')" ;;
    rows) run rows python3 -c "from fastgemma.kernels.rows_gemv import bench_rows
bench_rows(ms=tuple(int(m) for m in '${ROWS_MS:-1,8}'.split(',')))" ;;
    head) run head python3 -m fastgemma.bench.head --m 1 16 ;;
    stream) run stream python3 -m fastgemma.kernels.stream_gemv ${STREAM_ARGS:-}
            grep '^fused table: ' "$out/stream.log" | tail -1 | sed 's/^fused table: //' > "$out/stream_table.txt" ;;
    drafthead) run drafthead python3 -m fastgemma.bench.draft_head ;;
    draftloop) run draftloop python3 -m fastgemma.bench.draft_loop ${DRAFTLOOP_ARGS:-} ;;
    floor) run floor python3 -m fastgemma.bench.floor ${FLOOR_ARGS:---no-work} --out "$out/floor.jsonl" ;;
    l2ahead) run l2ahead python3 -m fastgemma.bench.l2_ahead ${L2AHEAD_ARGS:-} --out "$out/l2ahead.jsonl" ;;
    floorstep) run floorstep python3 -m fastgemma.bench.floor_step ${FLOORSTEP_ARGS:-} --out "$out/floorstep.jsonl" ;;
    prefill) run prefill python3 -m fastgemma.bench.prefill ${PREFILL_ARGS:-} --out "$out/prefill.jsonl" ;;
    invariance) run invariance python3 -m fastgemma.bench.invariance ${INVARIANCE_ARGS:-} --out "$out/invariance.jsonl" ;;
    spec) run spec python3 -m fastgemma.bench.spec ${SPEC_ARGS:---prompts 2 --prompt-len 256 --new 256} --out "$out/spec.jsonl" ;;
    verifychain) run verifychain python3 -m fastgemma.bench.verify_chain ${VERIFYCHAIN_ARGS:-} --out "$out/verifychain.jsonl" ;;
    counters) run counters python3 -m fastgemma.bench.counters ${COUNTERS_ARGS:-} --out "$out" ;;
    gptq) run gptq python3 -m fastgemma.bench.gptq ${GPTQ_ARGS:-} --out "$out/gptq.jsonl" ;;
    agreement) run agreement python3 -m fastgemma.bench.agreement \
                 --variants "${AGREEMENT_VARIANTS:-eager,compiled_triton_merged,compiled_triton_merged_gemv}" --out "$out/agreement.jsonl" ;;
    cli) n="${CLI_NAME:-cli}"
         v="${n^^}_S"; [ "$n" = cli ] || [ -n "${!v:-}" ] || export "$v=${CLI_S:-$part_s}"
         run "$n" python3 -c "import sys; from fastgemma.cli import main; sys.argv[0] = 'fastgemma'; main()" \
           ${CLI_ARGS:-experiment=frontier workload.num_prompts=8 workload.warmup=2} logger=jsonl progress=false \
           task.table=true "hydra.run.dir=$out/$n" ;;
    ladder) run ladder python3 -m fastgemma.bench.ladder --prompts 2 --prompt-len 256 --new 512 ${LADDER_ARGS:-} \
              --variants "${LADDER_VARIANTS:-eager,graph_triton_merged,compiled_triton_merged}" --out "$out/ladder.jsonl" ;;
    *) echo "unknown part $p (profile, gemv, chain, verifychain, int4, int4fused, mma, fold, stream, stack, loo, attention, head, drafthead, draftloop, floor, floorstep, prefill, invariance, spec, counters, gptq, agreement, cli, ladder)"; exit 2 ;;
  esac
done
# the short tables: everything from each log's last blank-line-separated tables
for p in "${parts[@]}"; do
  log=$p; [ "$p" = cli ] && log="${CLI_NAME:-cli}"
  echo; echo "##### $log"
  case $p in
    profile) grep -E '^## |^\| (gemv|attention|fused|torch|int4|head|other|group)' "$out/profile.log" | head -40 ;;
    gemv) grep -vE '^ +skip' "$out/gemv.log" | tail -40 ;;
    int4) grep -E "best|per-group|WRONG|^ +[a-z/|_]+ +[0-9]+ +[0-9]+ +[0-9]+ \|" "$out/int4.log" | head -60
          grep -A40 '^# CONFIGS' "$out/int4.log" ;;
    int4fused) grep -E "WRONG|skip" "$out/int4fused.log" | head; grep -A20 '^# TILES' "$out/int4fused.log" ;;
    mma) grep -E ' \| ' "$out/mma.log" | head -120 ;;
    rows) grep -E ' \| |WRONG|^    \(' "$out/rows.log" | head -60 ;;
    fold) grep -E ' \| ' "$out/fold.log" | head -40 ;;
    stream) grep -E ' \| |skip|^fused table' "$out/stream.log" | tail -40 ;;
    draftloop) grep -E ' \| |barrier|programs:' "$out/draftloop.log" | tail -30 ;;
    loo) for l in loo loo_native loo_bodies; do grep -E '^\|' "$out/$l.log" | tail -16; done ;;
    cli) grep -E '^\[bench\]|^\||\.\.\.$|: [0-9.]+ s( \([0-9]+ graphs? compiled\))?$|^timed:|error' "$out/$log.log" | tail -30 ;;
    *) grep -E '^\|' "$out/$p.log" | tail -60 ;;
  esac
  tail -3 "$out/$log.log" | grep -iE 'error|Traceback|Killed' || true
done
