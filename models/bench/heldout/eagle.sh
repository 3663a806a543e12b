#!/bin/bash
# EAGLE rows of the README table. Usage: eagle.sh replay3|replay1|engine OUT [extra measure flags]
#   replay3 / replay1: the EAGLE-3 / EAGLE-1 contenders replayed on stored plain runs (no timing), e.g.
#     eagle.sh replay3 eagle3-replay-temp0.jsonl --temps 0 --plain-runs models/bench/heldout/replay-temp0.jsonl
#   engine: timed runs (fresh plain runs, interleaved) on the first prompts
set -e
cd "$(dirname "$0")/../../.."  # the repository root; run inside its environment
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
E3=${EAGLE3:-models/eagle/SmolLM2-135M-Instruct}
E1=${EAGLE1:-}  # an EAGLE-1 head for replay1 (the README rows used last session's epoch-1 head, not shipped)
MODE=$1; OUT=$2; shift 2
P=models/medusa/SmolLM2-135M-Instruct/heldout_prompts.jsonl
E3C="--drafter eagle --eagle-heads $E3"
if [ "$MODE" = replay1 ]; then  # the EAGLE-1 head (its 49k-wide LM head makes drafting slow to replay)
  mlxspec train measure --model default --prompts $P --max-tokens 128 --engine-prompts 0 \
    -c "EAGLE-1 chain γ4=--drafter eagle --eagle-heads $E1 --eagle-top-k 1 --eagle-depth 4 --num-draft-tokens 4" \
    -c "EAGLE-1 head, EAGLE-2 tree 6×10→60=--drafter eagle --eagle-heads $E1 --eagle-depth 6 --eagle-top-k 10 --eagle-total-tokens 60 --num-draft-tokens 6" \
    -o $OUT "$@"
elif [ "$MODE" = replay3 ]; then
  mlxspec train measure --model default --prompts $P --max-tokens 128 --engine-prompts 0 \
    -c "EAGLE-3 chain γ4=$E3C --eagle-top-k 1 --eagle-depth 4 --eagle-ngram 0 --num-draft-tokens 4" \
    -c "EAGLE-3 tree 6×10→60=$E3C --eagle-depth 6 --eagle-top-k 10 --eagle-total-tokens 60 --eagle-ngram 0 --num-draft-tokens 6" \
    -c "EAGLE-3 chain γ4 + n-gram=$E3C --eagle-top-k 1 --eagle-depth 4 --eagle-ngram 4 --num-draft-tokens 4" \
    -c "EAGLE-3 tree 6×10→60 + n-gram=$E3C --eagle-depth 6 --eagle-top-k 10 --eagle-total-tokens 60 --eagle-ngram 6 --num-draft-tokens 6" \
    -c "EAGLE-3 chain γ4 + n-gram 6=$E3C --eagle-top-k 1 --eagle-depth 4 --eagle-ngram 6 --num-draft-tokens 6" \
    -o $OUT "$@"
else
  mlxspec train measure --model default --prompts $P --max-tokens 128 \
    -c "ngram γ4=--drafter ngram --num-draft-tokens 4" \
    -c "EAGLE-3 chain γ4=$E3C --eagle-top-k 1 --eagle-depth 4 --eagle-ngram 0 --num-draft-tokens 4" \
    -c "EAGLE-3 chain γ4 + n-gram=$E3C --eagle-top-k 1 --eagle-depth 4 --eagle-ngram 4 --num-draft-tokens 4" \
    -c "EAGLE-3 tree 4×4→16 + n-gram=$E3C --eagle-depth 4 --eagle-top-k 4 --eagle-total-tokens 16 --eagle-ngram 4 --num-draft-tokens 4" \
    -c "EAGLE-3 tree 6×10→auto + n-gram=$E3C --eagle-depth 6 --eagle-top-k 10 --eagle-total-tokens auto --eagle-ngram 6 --num-draft-tokens 6" \
    -c "EAGLE-3 tree 6×10→60 + n-gram=$E3C --eagle-depth 6 --eagle-top-k 10 --eagle-total-tokens 60 --eagle-ngram 6 --num-draft-tokens 6" \
    -o $OUT "$@"
fi
