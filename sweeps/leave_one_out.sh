#!/usr/bin/env bash
# Leave-one-out from the full stack (experiment=frontier): the stack once, then the stack with each
# technique put back to its baseline choice, so each run shows what that technique was worth.
#   bash sweeps/leave_one_out.sh [overrides for every run]
set -u
source "$(dirname "$0")/_common.sh"
common=(task=bench eval=ppl experiment=frontier "$@")
sweep "${common[@]}"                                          # the full stack
sweep "${common[@]}" window=native
sweep "${common[@]}" ple=project                              # the PLE inputs computed per token, no table
sweep "${common[@]}" fuse=none
sweep "${common[@]}" quant=bf16
sweep "${common[@]}" lm_head=full                             # every head row, bf16
sweep "${common[@]}" lm_head.dtype=auto                       # the kept rows in the model's dtype, not int8
sweep "${common[@]}" graphs=eager
sweep "${common[@]}" attention=torch
finish
