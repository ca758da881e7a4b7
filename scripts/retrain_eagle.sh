#!/usr/bin/env bash
# The EAGLE layer on the heads' data (issue 45): every phase resumes where a stopped run left it, so
# the recipe can span sessions on one machine (`data/` is never committed). Run it on a quiet machine:
#   nohup bash scripts/retrain_eagle.sh > data/retrain_eagle.log 2>&1 &
#   1. ShareGPT first turns answered (SHAREGPT_ANSWERS of them, default 5,024: as many as the heads'
#      training answered, from the same prompts), the EAGLE taps captured while writing (no second forward);
#   2. the shipped layer continued on those answers alone (their features are read from what generation
#      captured: minutes, where the committed answers need hours of forwards) into SHAREGPT_OUT, with its
#      held-out report: the first result, on a 2-core CPU within a session of the answers;
#   3. EAGLE features of the committed answers (one teacher-forced forward per batch);
#   4. one epoch over all of it (EPOCHS, TTT_STEPS training-time-test steps) from the shipped layer into
#      EAGLE_OUT, with its held-out report.
# Ship a candidate (copy it over assets/eagle) only if it beats assets/eagle/report.json held out: the last
# line runs that comparison (`offline.eagle_verdict`: every figure side by side, and the rule's verdict);
# phase 4 continues whatever assets/eagle holds then.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH=. HF_HUB_OFFLINE=1
PY=.venv/bin/python
ANSWERS=${SHAREGPT_ANSWERS:-5024}
SHAREGPT_OUT=${SHAREGPT_OUT:-data/eagle_sharegpt}
EAGLE_OUT=${EAGLE_OUT:-data/eagle_candidate}
TRAIN=(--init assets/eagle --epochs "${EPOCHS:-1}" --num-heads "${TTT_STEPS:-5}" --lr "${LR:-1e-3}")
mkdir -p data
answered() { [ -f data/distill_chat.jsonl ] && wc -l < data/distill_chat.jsonl || echo 0; }
if [ "$(answered)" -lt "$ANSWERS" ]; then
  .venv/bin/pip install -q -r requirements-datagen.txt
  $PY -m offline.datagen --out data/distill_chat.jsonl --train-prompts 0 --self-prompts 0 --sharegpt 11000 \
      --max-new-tokens 256 --dtype fp32 --max-answers "$ANSWERS"
fi
$PY -m offline.eagle_features --data data/distill_chat.jsonl
[ -f "$SHAREGPT_OUT/report.json" ] || $PY -m offline.train_eagle --data data/distill_chat.jsonl --out "$SHAREGPT_OUT" "${TRAIN[@]}"
COMMITTED=assets/distill/distill.jsonl.gz,assets/distill/distill_clean.jsonl.gz
$PY -m offline.eagle_features --data "$COMMITTED"
$PY -m offline.train_eagle --data "$COMMITTED,data/distill_chat.jsonl" --out "$EAGLE_OUT" "${TRAIN[@]}"
$PY -m offline.eagle_verdict "$EAGLE_OUT/report.json" || echo "$EAGLE_OUT does not ship: keep assets/eagle"
