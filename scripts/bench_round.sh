#!/usr/bin/env bash
# This round's benchmarks (about 25 min on 2 cores): both drafter families, alone and with prompt
# lookup, beside plain decoding and transformers' prompt lookup, on MT-Bench (every 4th prompt),
# the second set (every 6th) and the collapse set (every 4th), in the precision this machine
# decodes fastest in (core.model.default_precision), plus fp32 where that is another one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH=. HF_HUB_OFFLINE=1
PY=.venv/bin/python
OUT=assets/results
ROUND=${ROUND:-round7}
MAIN=ar,dynamic:auto,dynamic:auto+lookup,hydra:auto,hydra:auto+lookup,hf:prompt_lookup
DEFAULT=$($PY -c "from core.model import default_precision; print(default_precision())")
DTYPES=$DEFAULT; [ "$DEFAULT" != fp32 ] && DTYPES="$DEFAULT fp32"
for DTYPE in $DTYPES; do
  $PY -m core.bench --prompts assets/data/mt_bench.jsonl --stride 4 --max-new-tokens 128 --dtype $DTYPE \
      --strategies $MAIN --out $OUT/bench_${ROUND}_mtbench_$DTYPE.json
  $PY -m core.bench --prompts assets/data/spec_mix.jsonl --stride 6 --max-new-tokens 128 --dtype $DTYPE \
      --strategies $MAIN --out $OUT/bench_${ROUND}_specmix_$DTYPE.json
  $PY -m core.bench --prompts assets/data/adversarial.jsonl --stride 4 --max-new-tokens 64 --dtype $DTYPE \
      --strategies ar,dynamic:auto,dynamic:auto+lookup,hydra:auto,hydra:auto+lookup --out $OUT/bench_${ROUND}_collapse_$DTYPE.json
done
