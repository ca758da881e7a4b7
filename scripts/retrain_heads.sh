#!/usr/bin/env bash
# The drafter recipe, one phase after another on a quiet machine (each phase resumes):
#   1. self-distillation data. The licence-clean answers ship as token ids in assets/distill/
#      (the base model's greedy answers to the Apache-2.0 / MIT prompts of assets/data and to
#      prompts it wrote itself): they are unpacked into data/ and their features extracted once
#      (cached beside them, bf16 where bf16 is fast). GENERATE=1 first answers the licence-clean
#      prompts not answered yet (resumable) and goes on with the sampled answers in the page's
#      precision (4 a prompt, distill_q8_s4: resumes where the committed part stops); SHAREGPT=1 adds
#      ShareGPT first turns (needs requirements-datagen.txt; their text is never committed, licence unstated).
#   2. Medusa heads (offline.train) and Hydra heads (offline.train_hydra), into
#      candidate folders (MEDUSA_OUT, HYDRA_OUT); each writes its report.json (held-out accuracy on
#      MT-Bench and the second set; Hydra also tokens per step of its grown tree). Ship a candidate
#      (`offline.ship_heads` for Medusa; copy over assets/hydra) only if it beats the shipped heads held out.
#   3. tokens per step of the fixed and dynamic Medusa trees on both held-out sets (after shipping).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH=. HF_HUB_OFFLINE=1
PY=.venv/bin/python
EPOCHS=${EPOCHS:-1.0}
MEDUSA_OUT=${MEDUSA_OUT:-assets/heads_candidate}
HYDRA_OUT=${HYDRA_OUT:-assets/hydra_candidate}
# the shipped heads' recipes (docs/RESULTS.md); HYDRA_EXTRA adds flags to both Hydra stages
SHARED=(--depth-vocab 16384,4096,2048,2048 --weight-decay 0.1 --noise 0.1 --dropout 0.1)
MEDUSA_LAYERS=${MEDUSA_LAYERS:-3}  # ResBlocks per Medusa head
RECIPE=(--epochs "$EPOCHS" --num-layers "$MEDUSA_LAYERS" "${SHARED[@]}" --precision gguf-q8)
mkdir -p data
unpack() {  # a committed answer file into data/, unless a (possibly longer) copy is there already
  if [ -f "assets/distill/$1" ] && [ ! -s "data/$2" ]; then
    zcat "assets/distill/$1" > "data/$2.partial" && mv "data/$2.partial" "data/$2"
  fi
}
unpack distill.jsonl.gz distill.jsonl
unpack distill_clean.jsonl.gz distill_clean.jsonl
unpack self_prompts.jsonl.gz distill_clean.self_prompts.jsonl
unpack distill_self1.jsonl.gz distill_self1.jsonl
unpack self_prompts_s1.jsonl.gz distill_self1.self_prompts.jsonl
unpack distill_q8_s4.jsonl.gz distill_q8_s4.jsonl
if [ "${GENERATE:-0}" = "1" ]; then
  $PY -m offline.datagen --out data/distill_clean.jsonl --train-prompts 12335 --self-prompts 1380 \
      --families gpteacher,self-instruct/user,self-instruct/seed,self/ \
      --skip-answered assets/distill/distill.jsonl.gz --max-new-tokens 256
  $PY -m offline.datagen --out data/distill_self1.jsonl --train-prompts 0 --self-prompts 1380 --seed 1 \
      --max-new-tokens 256
  $PY -m offline.datagen --out data/distill_q8_s4.jsonl --train-prompts 12335 --self-prompts 0 --samples 4 \
      --no-features --max-new-tokens 256
fi
DATA=data/distill.jsonl
for EXTRA in data/distill_clean.jsonl data/distill_self1.jsonl data/distill_q8_s4.jsonl; do
  [ -s "$EXTRA" ] && DATA=$DATA,$EXTRA
done
if [ "${SHAREGPT:-0}" = "1" ]; then
  .venv/bin/pip install -q -r requirements-datagen.txt
  $PY -m offline.datagen --out data/distill_chat.jsonl --train-prompts 0 --self-prompts 0 --sharegpt 11000 \
      --max-new-tokens 256
  DATA=$DATA,data/distill_chat.jsonl
fi
# Hydra, the shipped recipe: Hydra++'s prefix layer on batches of 64-position stretches,
# 2 epochs over the chat data (ShareGPT + the older instruction answers), then 1 epoch over all
# of it at lr 1e-3 from there (--init). Where ShareGPT's answers are absent stage 1 reads all data.
CHAT=data/distill.jsonl
if [ -s data/distill_chat.jsonl ]; then  # answered now or by an earlier session on this machine
  CHAT=data/distill_chat.jsonl,$CHAT
  case $DATA in *distill_chat*) ;; *) DATA=$DATA,data/distill_chat.jsonl ;; esac
fi
HYDRA=("${SHARED[@]}" --prefix-layer true --prefix-stretch 64)
# shellcheck disable=SC2086
$PY -m offline.train_hydra --data "$CHAT" --extract-missing true --out "$HYDRA_OUT.stage1" --epochs 2 "${HYDRA[@]}" \
    ${HYDRA_EXTRA:-}
# shellcheck disable=SC2086
$PY -m offline.train_hydra --data "$DATA" --extract-missing true --out "$HYDRA_OUT" --epochs 1 --lr 1e-3 "${HYDRA[@]}" \
    --init "$HYDRA_OUT.stage1" ${HYDRA_EXTRA:-}
# Medusa, the shipped recipe: the committed greedy answers (1.59M tokens) and the last 20,540 sampled
# gguf-q8 answers of distill_q8_s4 (3.39M tokens: the ones whose features were captured while they were
# written; elsewhere extracted once, ~25 min), gguf-q8 features, 1 epoch. Ship a winner with
# `python -m offline.ship_heads "$MEDUSA_OUT" --depth-vocab 4096,4096,2048,2048` (decoding ranks 4,096
# rows at depths 1-2: the same tokens a step as 16,384, a quarter of the rows read).
sed -n 26593,47132p data/distill_q8_s4.jsonl > data/q8_captured.jsonl  # its committed rows 26,593-47,132
if [ -d data/distill_q8_s4.features ] && [ ! -e data/q8_captured.features ]; then
  ln -s distill_q8_s4.features data/q8_captured.features  # captured features are keyed by row id
fi
$PY -m offline.train --data data/distill.jsonl,data/distill_clean.jsonl,data/q8_captured.jsonl --extract-missing true \
    --out "$MEDUSA_OUT" "${RECIPE[@]}"
if [ "${SIMULATE:-0}" = "1" ]; then  # after shipping new Medusa heads
  TREES=fixed:mc_sim_7b_63,fixed:calibrated,dynamic:8,dynamic:16,dynamic:32,dynamic:63,dynamic:128
  $PY -m offline.simulate --answers assets/results/mt_bench_answers.jsonl --trees $TREES \
      --out assets/results/tokens_per_step.json
  $PY -m offline.simulate --answers assets/results/spec_mix_answers.jsonl --trees $TREES \
      --out assets/results/tokens_per_step_second_set.json
fi
