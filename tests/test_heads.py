"""Medusa heads: project format and both official Medusa layouts round-trip to the same outputs."""
from __future__ import annotations

import pytest
import safetensors.torch
import torch

from core.heads import HeadsConfig, MedusaHeads, load_heads, load_official_medusa


def random_heads(config: HeadsConfig) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(config)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return heads.eval()


@pytest.fixture
def own_projection() -> MedusaHeads:
    return random_heads(HeadsConfig(num_heads=5, num_layers=1, hidden_size=32, vocab_size=100, own_lm_head=True))


def test_official_pt_layout(own_projection, tmp_path):
    state = own_projection.heads.state_dict()
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "4.1.weight"} <= set(state)
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    loaded = load_official_medusa(tmp_path / "medusa_lm_head.pt")
    assert loaded.config.num_heads == 5 and loaded.config.own_lm_head and loaded.config.vocab_size == 100
    hidden = torch.randn(3, 32)
    assert torch.allclose(loaded(hidden), own_projection(hidden))


def test_official_safetensors_layout_with_prefix(own_projection, tmp_path):
    state = {f"medusa_head.{k}": v.contiguous() for k, v in own_projection.heads.state_dict().items()}
    safetensors.torch.save_file(state, tmp_path / "medusa_lm_head.safetensors")
    loaded = load_official_medusa(tmp_path / "medusa_lm_head.safetensors")
    hidden = torch.randn(2, 7, 32)
    assert loaded(hidden).shape == (5, 2, 7, 100)
    assert torch.allclose(loaded(hidden), own_projection(hidden))


def test_shared_lm_head_layout_and_project_format(tmp_path):
    heads = random_heads(HeadsConfig(num_heads=3, num_layers=2, hidden_size=32, vocab_size=100))
    lm_head = torch.nn.Linear(32, 100, bias=False)
    safetensors.torch.save_file({k: v.contiguous() for k, v in heads.heads.state_dict().items()},
                                tmp_path / "medusa_lm_head.safetensors")
    official = load_official_medusa(tmp_path / "medusa_lm_head.safetensors")
    assert official.config.num_layers == 2 and not official.config.own_lm_head
    heads.save(tmp_path / "ours")
    ours = load_heads(tmp_path / "ours")
    hidden = torch.randn(4, 32)
    expected = heads(hidden, lm_head)
    assert torch.allclose(official(hidden, lm_head), expected) and torch.allclose(ours(hidden, lm_head), expected)
    with pytest.raises(ValueError, match="lm_head"):
        ours(hidden)


def test_pickled_code_is_refused(tmp_path):
    """weights_only loading: a checkpoint that carries code objects is not executed."""
    class Payload:
        def __reduce__(self):
            return (print, ("owned",))
    torch.save({"0.0.linear.weight": Payload()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_official_medusa(tmp_path / "medusa_lm_head.pt")


def test_unknown_layout_is_rejected(tmp_path):
    torch.save({"model.layers.0.weight": torch.zeros(2)}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="Medusa head layout"):
        load_official_medusa(tmp_path / "medusa_lm_head.pt")


def test_zero_initialised_heads_start_as_identity():
    heads = MedusaHeads(HeadsConfig(num_heads=2, hidden_size=8, vocab_size=10))
    hidden = torch.randn(3, 8)
    assert torch.equal(heads.head_states(hidden), torch.stack([hidden, hidden]))
