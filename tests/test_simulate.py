"""The greedy simulation reproduces the real decoder's tokens per step."""
from __future__ import annotations

import dataclasses

import pytest

from core.decoder import DecodeConfig, decode
from core.model import BaseModel
from offline.simulate import parse_tree_spec, simulate


@pytest.mark.parametrize("spec, config", [
    ("fixed:mc_sim_7b_63", DecodeConfig(spec="fixed", max_new_tokens=48)),
    ("dynamic:15", DecodeConfig(spec="dynamic:15", max_new_tokens=48)),
])
def test_simulation_matches_decoder(base_fp32, shipped_heads, mt_bench_prompts, spec, config, monkeypatch):
    # the heads draft in fp32 here: where bf16 is fast they draft in bf16, and a bf16 product of one
    # row (a decoding step) and of a whole answer's rows (the simulation) can round a near-tie
    # among the heads' ranks apart (CI on an AVX512-BF16 CPU: 1.958 vs 2.000 tokens per step)
    monkeypatch.setattr("core.drafters.interface.fast_bf16_batched", lambda: False)
    # both on transformers' forward: the lean forward picks its projection kernels by timing on each
    # machine, so its rounding (and with it a near-tie among the heads' ranks) can differ from the
    # teacher-forced forward the simulator runs; on one forward the simulation is exact
    hf_base = BaseModel(model=base_fp32.model, tokenizer=base_fp32.tokenizer, source=base_fp32.source,
                        config=dataclasses.replace(base_fp32.config, engine="hf"))
    real_steps = real_tokens = 0
    rows = []
    for prompt in mt_bench_prompts[30:32]:
        session = decode(hf_base, shipped_heads, prompt, config)
        real_steps += len(session.records)
        real_tokens += sum(len(r.new_tokens) for r in session.records)
        rows.append({"prompt_ids": session.prompt_ids, "answer_ids": session.output_ids})
    simulated = simulate(hf_base, shipped_heads, rows, [parse_tree_spec(spec)])[spec]
    assert simulated == pytest.approx(real_tokens / real_steps, abs=1e-9)


def test_gumiho_simulation_walks_eagle_and_the_dynamic_tree_as_their_own_simulations():
    """`offline.gumiho` measures EAGLE alone and Medusa's dynamic tree over the same answers with the
    same walk as `offline.train_eagle` and `offline.simulate` (tiny random models), so its Gumiho
    configurations are compared like with like; each configuration hands over to the heads below its
    serial depths."""
    from offline.eagle_features import extract
    from offline.gumiho import answer_tokens_per_step, configurations
    from offline.simulate import TreeSpec, head_proposals, simulate_answer
    from offline.train_eagle import eagle_tokens_per_step
    from tests.tiny import greedy_reference, tiny_base, tiny_eagle, tiny_heads
    base = tiny_base("llama", num_hidden_layers=4)
    layer, heads = tiny_eagle(base, std=0.3, seed=1), tiny_heads(base, std=0.5)
    prompt = list(b"the cat sat on the mat and the cat sat on the")
    row = {"prompt_ids": prompt, "answer_ids": greedy_reference(base, prompt, 40)}
    budgets = (6, 20)
    totals = answer_tokens_per_step(layer, base, heads, row, budgets)
    eagle_alone = eagle_tokens_per_step(layer, base, extract(base, [row]), budgets)
    probs, ids = head_proposals(base, heads, row["prompt_ids"], row["answer_ids"], 32)
    for budget in budgets:
        steps, emitted = totals[f"eagle:{budget}"]
        assert emitted / steps == pytest.approx(eagle_alone[f"eagle:{budget}"], abs=1e-12)
        expected = simulate_answer(probs, ids, row["answer_ids"], TreeSpec(label="", budget=budget), 32)
        assert totals[f"dynamic:{budget}"] == list(expected)
    assert set(configurations(4)) == {"eagle", "gumiho(eagle 1 + medusa 2-4)", "gumiho(eagle 2 + medusa 3-4)",
                                      "gumiho(eagle 3 + medusa 4)"}
    for label in configurations(4):
        steps, emitted = totals[f"{label}:20"]
        assert emitted == len(row["answer_ids"]) - 1 and steps <= emitted
