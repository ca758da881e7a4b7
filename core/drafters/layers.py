"""Pieces the drafter families' modules share."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / RMS(x) * weight, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]."""
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight
