#!/usr/bin/env bash
# One-at-a-time ablation from the baseline: the baseline once, then each technique's choices alone
# on top of it (attention only acts on the static / captured step, so it rides on graphs=cuda_graph).
# Every run benches the workload and scores perplexity, so `fastgemma task=report` draws the
# marginal-gain bars and the tps-vs-ppl Pareto front. Extra arguments go to every run:
#   bash sweeps/ablation.sh                                  # E4B shapes, challenge workload, GPU
#   bash sweeps/ablation.sh model=gemma4_tiny workload=smoke graphs=static   # a quick CPU check (the int4 and
#                                                            # Triton attention runs need a GPU: reported as failed)
#   LAUNCHER=gpus bash sweeps/ablation.sh                    # one job per GPU
set -u
source "$(dirname "$0")/_common.sh"
common=(task=bench eval=ppl "$@")
sweep "${common[@]}"                                          # the baseline
sweep window=w256,w192,w188,w160,w128 "${common[@]}"
sweep ple=table "${common[@]}"
sweep fuse=merged "${common[@]}"
sweep quant=int4 "${common[@]}"
sweep graphs=static,cuda_graph,compiled "${common[@]}"
sweep attention=triton graphs=cuda_graph "${common[@]}"
finish
