"""The greedy simulation reproduces the real decoder's tokens per step."""
from __future__ import annotations

import pytest

from core.decoder import DecodeConfig, decode
from offline.simulate import parse_tree_spec, simulate


@pytest.mark.parametrize("spec, config", [
    ("fixed:mc_sim_7b_63", DecodeConfig(strategy="fixed", max_new_tokens=48)),
    ("dynamic:15", DecodeConfig(strategy="dynamic", budget=15, max_new_tokens=48)),
])
def test_simulation_matches_decoder(base_fp32, shipped_heads, mt_bench_prompts, spec, config):
    real_steps = real_tokens = 0
    rows = []
    for prompt in mt_bench_prompts[30:32]:
        session = decode(base_fp32, shipped_heads, prompt, config)
        real_steps += len(session.records)
        real_tokens += sum(len(r.new_tokens) for r in session.records)
        rows.append({"prompt_ids": session.prompt_ids, "answer_ids": session.output_ids})
    simulated = simulate(base_fp32, shipped_heads, rows, [parse_tree_spec(spec)])[spec]
    assert simulated == pytest.approx(real_tokens / real_steps, abs=1e-9)
