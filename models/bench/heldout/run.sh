#!/bin/bash
# The README table: 50 held-out prompts, 128 new tokens, temps 0 and 0.7, float32 target, OpenBLAS.
set -e
cd "$(dirname "$0")/../../.."  # the repository root; run with its environment active
M=${MEDUSA:-models/medusa/SmolLM2-135M-Instruct}
E3=${EAGLE3:-models/eagle/SmolLM2-135M-Instruct}
D=${DRAFT:?DRAFT=the draft model folder (the one measured no longer ships: docs/training.md)}
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
mlxspec train measure --model default --prompts models/medusa/SmolLM2-135M-Instruct/heldout_prompts.jsonl \
  --max-tokens 128 --engine-prompts ${ENGINE_PROMPTS:-8} \
  -c "ngram γ4=--drafter ngram --num-draft-tokens 4" \
  -c "medusa chain_4=--drafter medusa --medusa-heads $M --medusa-tree chain_4 --num-draft-tokens 4" \
  -c "medusa small_15=--drafter medusa --medusa-heads $M --medusa-tree small_15 --num-draft-tokens 4" \
  -c "medusa mc_sim_7b_63=--drafter medusa --medusa-heads $M --medusa-tree mc_sim_7b_63 --num-draft-tokens 4" \
  -c "EAGLE-3 chain γ4=--drafter eagle --eagle-heads $E3 --eagle-top-k 1 --eagle-depth 4 --num-draft-tokens 4" \
  -c "EAGLE-3 tree 4×4→16=--drafter eagle --eagle-heads $E3 --eagle-depth 4 --eagle-top-k 4 --eagle-total-tokens 16" \
  -c "draft model γ4=--drafter draft --draft-model $D --draft-dtype float32 --num-draft-tokens 4" \
  --replay-only "medusa mc_sim_7b_63" "$@"
