"""The base model's next-token distribution under temperature / top-k / top-p, and drawing from it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
        drop_sorted = outside_top_p(sorted_probs, config.top_p)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def outside_top_p(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's rule on probabilities sorted best first [..., n]: a token is dropped when the mass before it
    already reaches top_p (the best token always stays)."""
    return (sorted_probs.cumsum(-1) - sorted_probs) >= top_p


def _host_array(logits: torch.Tensor) -> np.ndarray | None:
    """A numpy view of CPU logits numpy can read (fp32, fp64, fp16), else None. Why: a greedy step
    reads the argmax of 49,152 logits, which torch computes in ~29 us on two cores (a parallel
    reduction's start-up) and numpy in ~2 us: a few percent of a plain step."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64, torch.float16):
        return None
    return logits.detach().numpy()


def argmax_token(logits: torch.Tensor) -> int:
    """The index of the largest logit [V] (the first of equal ones, as torch.argmax)."""
    array = _host_array(logits)
    return int(array.argmax()) if array is not None else int(logits.argmax())


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's `argmax_token`, logits [n, V] -> n token ids."""
    array = _host_array(logits)
    return array.argmax(axis=-1).tolist() if array is not None else logits.argmax(dim=-1).tolist()


def top_two(logits: torch.Tensor) -> tuple[float, float]:
    """The largest and second-largest logit [V] (equal when the maximum is tied)."""
    array = _host_array(logits)
    if array is None:
        first, second = torch.topk(logits, 2).values.tolist()
        return first, second
    best = int(array.argmax())
    second = max(array[:best].max(initial=-np.inf), array[best + 1:].max(initial=-np.inf))
    return float(array[best]), float(second)


def next_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    """Argmax when greedy, else one draw from `sampling_probs`. logits: [V]."""
    if config.greedy:
        return argmax_token(logits)
    probs = sampling_probs(logits, config)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


NUCLEUS_CANDIDATES = 1024  # a row's best tokens `sample_rows` reads first: a top-p set almost always lies within


def sample_rows(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of logits [b, V] from `sampling_probs`'s distribution: [b] token ids.

    With top-p alone (top_k 0) each row is read through its NUCLEUS_CANDIDATES best tokens (their
    probabilities normalised over the whole vocabulary), so nothing is sorted at the vocabulary's width
    (64 rows of 49,152: ~165 -> ~16 ms on two cores); a row whose top-p set reaches past them falls back
    to `sampling_probs`, so every row's distribution is the same either way."""
    if config.greedy:
        return logits.argmax(-1)
    if config.top_k > 0 or config.top_p >= 1.0 or logits.shape[-1] <= NUCLEUS_CANDIDATES:
        return torch.multinomial(sampling_probs(logits, config), 1, generator=generator).squeeze(-1)
    scaled = logits.float() / config.temperature  # [b, V]
    top = torch.topk(scaled, NUCLEUS_CANDIDATES, dim=-1)  # sorted, best first
    probs = torch.exp(top.values - torch.logsumexp(scaled, dim=-1, keepdim=True))  # [b, C]
    kept = probs.masked_fill(outside_top_p(probs, config.top_p), 0.0)  # [b, C]
    inside = probs.sum(-1) >= config.top_p  # [b] the next token past the candidates would be dropped
    chosen = top.indices.gather(-1, torch.multinomial(kept, 1, generator=generator)).squeeze(-1)  # [b]
    outside = (~inside).nonzero().flatten()
    if len(outside):
        chosen[outside] = torch.multinomial(sampling_probs(logits[outside], config), 1,
                                            generator=generator).squeeze(-1)
    return chosen
