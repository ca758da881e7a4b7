"""Shared fixtures: the real shipped model (loaded once per test run) and MT-Bench prompts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.drafters.medusa import HeadsConfig, MedusaHeads, default_heads
from core.drafters.hydra import default_hydra_heads
from core.model import ModelConfig, load_base_model

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@pytest.fixture(scope="session")
def mt_bench_prompts() -> list[str]:
    rows = [json.loads(line) for line in (ASSETS / "data" / "mt_bench.jsonl").read_text().splitlines() if line.strip()]
    return [row["turns"][0] for row in rows]


@pytest.fixture(scope="session")
def base_fp32():
    return load_base_model(ModelConfig(dtype="fp32", device="cpu"))


@pytest.fixture(scope="session")
def base_bf16():
    return load_base_model(ModelConfig(dtype="bf16", device="cpu"))


@pytest.fixture(scope="session")
def shipped_heads(base_fp32):
    heads, _ = default_heads(base_fp32.model.config.hidden_size, base_fp32.model.config.vocab_size)
    return heads


@pytest.fixture(scope="session")
def shipped_hydra():
    heads = default_hydra_heads()
    assert heads is not None, "assets/hydra is missing"
    return heads


@pytest.fixture(scope="session")
def random_heads(base_fp32) -> MedusaHeads:
    """Heads with random (non-zero) weights: they propose varied, mostly wrong tokens."""
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(hidden_size=base_fp32.model.config.hidden_size,
                                    vocab_size=base_fp32.model.config.vocab_size))
    for block in heads.heads:
        torch.nn.init.normal_(block[0].linear.weight, std=0.05)
    return heads.eval().requires_grad_(False)


# The quick subset (`pytest -m "not slow"`): logic on tiny in-process models, trees, lookup, the
# datastore, viz. Everything that loads the shipped model, serves the app or drives the browser,
# and the 20,000-draw sampling statistics, is `slow`.
SLOW_FIXTURES = {"base_fp32", "base_bf16", "shipped_heads", "shipped_hydra", "random_heads", "plain_fp32",
                 "mt_bench_prompts"}
SLOW_MODULES = {"test_app", "test_browser", "test_replay_browser", "test_robustness", "test_datagen", "test_train", "test_kernels",
                "test_simulate", "test_sampling"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
