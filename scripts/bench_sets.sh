#!/usr/bin/env bash
# The benchmark sets: every drafter family, alone and with prompt lookup, beside plain decoding and
# transformers' own generate and its prompt lookup, on MT-Bench (every STRIDE-th prompt),
# the second set and the collapse set, in the precision this machine decodes fastest in
# (core.precision.default_precision), plus fp32 where that is another one (DTYPES="bf16 fp32" asks for
# both wherever the default is). SETS picks the sets;
# REPEATS runs every strategy that many times per prompt (each row: the median-time run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH=. HF_HUB_OFFLINE=1
PY=.venv/bin/python
OUT=assets/results
TAG=${TAG:-$(date +%Y%m%d)}  # the output files are bench_<TAG>_<set>_<precision>.json
REPEATS=${REPEATS:-1}
STRIDE=${STRIDE:-8}
SETS=${SETS:-"mtbench specmix collapse"}
# STRATEGIES=... replaces the list (ar@hf, dynamic:auto@hf: the lean forward against transformers' in one run)
MAIN=${STRATEGIES:-ar,hf:greedy,dynamic:auto,dynamic:auto+lookup,hydra:auto,hydra:auto+lookup,eagle:auto,eagle:auto+lookup,hf:prompt_lookup}
DEFAULT=$($PY -c "from core.precision import default_precision; print(default_precision())")
DTYPES=${DTYPES:-$DEFAULT}; [ "$DTYPES" = "$DEFAULT" ] && [ "$DEFAULT" != fp32 ] && DTYPES="$DEFAULT fp32"
for DTYPE in $DTYPES; do
  for SET in $SETS; do
    case $SET in
      mtbench) FILE=mt_bench.jsonl; ARGS="--stride $STRIDE --max-new-tokens 128" ;;
      specmix) FILE=spec_mix.jsonl; ARGS="--stride $((STRIDE * 3 / 2)) --max-new-tokens 128" ;;
      collapse) FILE=adversarial.jsonl; ARGS="--stride 4 --max-new-tokens 64" ;;
    esac
    $PY -m offline.bench --prompts assets/data/$FILE $ARGS --dtype $DTYPE --strategies $MAIN --repeats "$REPEATS" \
        --out $OUT/bench_${TAG}_${SET}_$DTYPE.json
  done
done
