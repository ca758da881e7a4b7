#!/usr/bin/env bash
# This round's drafter recipe, one phase after another on a quiet machine (each phase resumes):
#   1. self-distillation data: the base model's greedy answers to ShareGPT first turns, with the
#      training features captured while it writes them (needs requirements-datagen.txt; the text is
#      never committed). Skipped when GENERATE=0 (the data under data/ is used as it is).
#   2. Medusa heads (offline.train) and Hydra heads (offline.train_hydra) on the same features; each
#      writes its report.json (held-out accuracy on MT-Bench and the second set; Hydra also
#      tokens per step of its grown tree beside the Medusa heads' dynamic tree).
#   3. tokens per step of the fixed and dynamic Medusa trees on both held-out sets.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH=. HF_HUB_OFFLINE=1
PY=.venv/bin/python
CHAT=${CHAT:-data/distill_chat.jsonl}
EPOCHS=${EPOCHS:-1.0}
# round 12's recipe (README, "Drafters and results at a glance")
RECIPE=(--epochs "$EPOCHS" --depth-vocab 16384,4096,2048,2048 --weight-decay 0.1 --noise 0.1 --dropout 0.1)
if [ "${GENERATE:-1}" = "1" ]; then
  .venv/bin/pip install -q -r requirements-datagen.txt
  $PY -m offline.datagen --out "$CHAT" --train-prompts 0 --self-prompts 0 --sharegpt 11000 --max-new-tokens 256
fi
# the older 406k instruction-answer tokens ship compressed; their features are extracted once, cached beside them
[ -f data/distill.jsonl ] || zcat assets/distill/distill.jsonl.gz > data/distill.jsonl
DATA="$CHAT,data/distill.jsonl"
$PY -m offline.train_hydra --data "$DATA" --extract-missing true --out assets/hydra "${RECIPE[@]}"
$PY -m offline.train --data "$DATA" --extract-missing true --out assets/heads "${RECIPE[@]}"
TREES=fixed:mc_sim_7b_63,fixed:calibrated,dynamic:8,dynamic:16,dynamic:32,dynamic:63,dynamic:128
$PY -m offline.simulate --answers assets/results/mt_bench_answers.jsonl --trees $TREES \
    --out assets/results/tokens_per_step.json
$PY -m offline.simulate --answers assets/results/spec_mix_answers.jsonl --trees $TREES \
    --out assets/results/tokens_per_step_second_set.json
