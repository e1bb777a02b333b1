#!/usr/bin/env bash
# Window grid: every sliding window (speed and perplexity), in one multirun. Add a second axis on
# the command line, e.g. quant=bf16,int4 for window x quant:
#   bash sweeps/window_grid.sh [quant=bf16,int4] [overrides]
set -u
source "$(dirname "$0")/_common.sh"
sweep window=native,w256,w192,w188,w160,w128 task=bench eval=ppl "$@"
finish
