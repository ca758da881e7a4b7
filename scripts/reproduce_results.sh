#!/usr/bin/env bash
# Re-creates every committed CPU result from the shipped model and heads (about 2 h on 2 CPU cores):
# tokens per step (exact greedy simulation), the MT-Bench benchmarks in bf16 and fp32 (fp32 in two
# runs: every strategy, then the prompt-lookup hybrid against its peers), the adversarial-set
# benchmark, and the HTML report. LIMIT=10 for a quick look; FP32_STRIDE=2 runs fp32 on every other
# MT-Bench prompt (40, all 8 categories). The committed fp32 run was made as two such halves
# (--stride 2 --offset 0 / 1) joined with `python -m offline.bench --merge`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH=. HF_HUB_OFFLINE=1
PY=.venv/bin/python
LIMIT=${LIMIT:-80}
FP32_STRIDE=${FP32_STRIDE:-1}
OUT=assets/results
STRATEGIES=ar,fixed:mc_sim_7b_63,fixed:calibrated,dynamic:64,dynamic:auto,hf:greedy,hf:prompt_lookup
HYBRID=ar,dynamic:auto,dynamic:auto+lookup,hf:prompt_lookup
$PY -m offline.simulate --answers $OUT/mt_bench_answers.jsonl \
    --trees fixed:mc_sim_7b_63,fixed:calibrated,dynamic:8,dynamic:16,dynamic:32,dynamic:63,dynamic:128 \
    --out $OUT/tokens_per_step.json
$PY -m offline.bench --prompts assets/data/mt_bench.jsonl --limit "$LIMIT" --max-new-tokens 128 \
    --dtype bf16 --strategies ${STRATEGIES/dynamic:auto,/dynamic:auto,dynamic:auto+lookup,} --out $OUT/bench_mtbench_bf16.json
$PY -m offline.bench --prompts assets/data/mt_bench.jsonl --limit "$LIMIT" --stride "$FP32_STRIDE" --max-new-tokens 128 \
    --dtype fp32 --strategies $STRATEGIES --out $OUT/bench_mtbench_fp32.json
$PY -m offline.bench --prompts assets/data/mt_bench.jsonl --limit "$LIMIT" --stride "$FP32_STRIDE" --max-new-tokens 128 \
    --dtype fp32 --strategies $HYBRID --out $OUT/bench_mtbench_fp32_lookup.json
$PY -m offline.bench --prompts assets/data/adversarial.jsonl --max-new-tokens 64 \
    --dtype bf16 --strategies ar,dynamic:auto,dynamic:auto+lookup,dynamic:63 --out $OUT/bench_adversarial_bf16.json
# the second evaluation set (translation, summarization, RAG, math, QA, extraction, code edits;
# prompts of 10 to 1,400 tokens), and the drafters side by side on both sets
DRAFTERS=ar,dynamic:auto,dynamic:auto+lookup,dynamic:auto+lookup+store,hf:prompt_lookup
SPEC_STRIDE=${SPEC_STRIDE:-1}
MT_STRIDE=${MT_STRIDE:-1}
for DTYPE in bf16 fp32; do
  $PY -m offline.bench --prompts assets/data/spec_mix.jsonl --stride "$SPEC_STRIDE" --max-new-tokens 128 \
      --dtype $DTYPE --strategies $DRAFTERS --out $OUT/bench_specmix_$DTYPE.json
  $PY -m offline.bench --prompts assets/data/mt_bench.jsonl --stride "$MT_STRIDE" --max-new-tokens 128 \
      --dtype $DTYPE --strategies $DRAFTERS --out $OUT/bench_mtbench_drafters_$DTYPE.json
done
$PY -m viz.bench_plot $OUT/bench_mtbench_bf16.json $OUT/bench_mtbench_fp32.json $OUT/bench_mtbench_fp32_lookup.json \
    $OUT/bench_adversarial_bf16.json $OUT/bench_mtbench_drafters_bf16.json $OUT/bench_mtbench_drafters_fp32.json \
    $OUT/bench_specmix_bf16.json $OUT/bench_specmix_fp32.json --html $OUT/bench.html
