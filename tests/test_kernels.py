"""The fp32 CPU matmul path (`linear_rows`): same numbers as nn.Linear, wired into the fp32 model only."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from core.model import SKINNY_MAX_ROWS, SkinnyLinear, linear_rows


@pytest.mark.parametrize("rows", [1, 2, 3, 8, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 100])
def test_linear_rows_matches_linear(rows):
    torch.manual_seed(rows)
    layer = nn.Linear(64, 300)
    x = torch.randn(1, rows, 64)
    expected = layer(x)
    got = linear_rows(x, layer.weight, layer.bias)
    assert got.shape == expected.shape == (1, rows, 300)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(linear_rows(x[0], layer.weight), x[0] @ layer.weight.T, atol=1e-5, rtol=1e-5)


def test_bf16_takes_the_plain_path():
    layer = nn.Linear(16, 40).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(linear_rows(x, layer.weight, layer.bias), nn.functional.linear(x, layer.weight, layer.bias))


def test_fp32_model_uses_skinny_linears_with_tied_weights(base_fp32, base_bf16):
    linears = [m for m in base_fp32.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, SkinnyLinear) for m in linears)
    # SmolLM2 ties the output projection to the input embedding: still one tensor
    assert base_fp32.lm_head.weight is base_fp32.model.get_input_embeddings().weight
    assert not any(isinstance(m, SkinnyLinear) for m in base_bf16.model.modules())
