"""The base model's next-token distribution under temperature / top-k / top-p, and drawing from it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (as plain sampling applies them)."""
    logits = logits.float() / max(config.temperature, 1e-6)  # [..., V]
    if config.top_k > 0:
        kth = torch.topk(logits, min(config.top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [..., V]
    if config.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the best token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def next_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    """Argmax when greedy, else one draw from `sampling_probs`. logits: [V]."""
    if config.greedy:
        return int(logits.argmax())
    probs = sampling_probs(logits, config)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
