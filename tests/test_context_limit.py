"""Stops near the model's context limit: plain decoding reserves nothing, a tree step shrinks to
the depth that still fits, and every strategy emits what `generate` emits (tiny model, fp32)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core.decoder import DecodeConfig, decode
from core.strategy import StrategySpec
from core.budget.cost_profile import CostProfile
from tests.tiny import greedy_reference, tiny_base, tiny_heads

MAX_POSITIONS = 256
FLAT = CostProfile(sizes=[1, 256], ms=[10.0, 10.5])  # a tree costs what a token costs: auto grows trees

STRATEGIES = {
    "ar": DecodeConfig(spec="ar"),
    "fixed": DecodeConfig(spec="fixed", fixed_tree=((0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0))),
    "dynamic": DecodeConfig(spec="dynamic:10"),
    "dynamic+lookup": DecodeConfig(spec="dynamic:10+lookup"),
    "auto+lookup": DecodeConfig(spec=StrategySpec("dynamic", budget=64, auto=True, lookup=True)),
}


@pytest.fixture(scope="module")
def tiny():
    base = tiny_base("llama", max_positions=MAX_POSITIONS)
    return base, tiny_heads(base, num_heads=4)


def repetitive_prompt(length: int) -> list[int]:
    """Random text that repeats itself, so the lookup chain is proposed and often accepted."""
    generator = torch.Generator().manual_seed(length)
    phrase = torch.randint(0, 256, (23,), generator=generator).tolist()
    return (phrase * (length // len(phrase) + 1))[:length]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("prompt_length, new_tokens", [(180, 60), (196, 60), (230, 60), (255, 8)])
def test_every_strategy_emits_what_generate_emits_near_the_limit(tiny, name, prompt_length, new_tokens):
    base, heads = tiny
    prompt = repetitive_prompt(prompt_length)
    plain = greedy_reference(base, prompt, new_tokens)
    config = replace(STRATEGIES[name], max_new_tokens=new_tokens)
    session = decode(base, heads, prompt, config, profile=FLAT)
    fits = MAX_POSITIONS - prompt_length  # the text never grows past the model's positions
    assert session.output_ids == plain[:min(new_tokens, fits)]
    assert session.stop_reason == ("max_new_tokens" if new_tokens <= fits else "context")
    deepest = max((len(p) for r in session.records for p in r.outcome.tree.paths), default=0)
    assert prompt_length + deepest <= MAX_POSITIONS
    # every node of every step sits at a position the model has: the root at the step's context
    # length, a node of depth d at context + d (without the pruning, trees reach past the end)
    highest = max((r.context_length + r.outcome.tree.max_depth for r in session.records), default=0)
    assert highest <= MAX_POSITIONS - 1


def test_a_prompt_that_fills_the_context_is_refused(tiny):
    base, heads = tiny
    with pytest.raises(ValueError, match="no room"):
        decode(base, heads, repetitive_prompt(MAX_POSITIONS), DecodeConfig(spec="ar"))
