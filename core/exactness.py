"""Checking speculative output against plain decoding, and explaining any divergence.

In fp32 a tree forward and single-token forwards differ by ~5e-5 in the logits, so greedy
outputs match token for token unless the plain run faces a near-tie. In bf16 they round
differently and near-ties flip more often. A divergence is reported with the plain run's
top-2 logit gap at that position: a small gap means rounding, a large one would be a bug.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from core.model import BaseModel


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the generated tokens
    plain_token: int
    speculative_token: int
    logit_gap: float  # plain run's top-1 minus top-2 logit at that position


def first_divergence(plain: Sequence[int], speculative: Sequence[int]) -> int | None:
    """Index of the first differing generated token, or None when one is a prefix of the other."""
    for index, (a, b) in enumerate(zip(plain, speculative)):
        if a != b:
            return index
    return None


@torch.inference_mode()
def top2_gap(base: BaseModel, prompt_ids: Sequence[int], generated_prefix: Sequence[int]) -> float:
    """Top-1 minus top-2 logit of one plain forward over prompt + prefix (the next-token choice)."""
    ids = torch.tensor([list(prompt_ids) + list(generated_prefix)], device=base.device)  # [1, T]
    logits = base.model(input_ids=ids).logits[0, -1].float()  # [V]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def explain_divergence(base: BaseModel, prompt_ids: Sequence[int], plain: Sequence[int],
                       speculative: Sequence[int]) -> Divergence | None:
    """None when the outputs agree (over their common length), else where and how close the tie was."""
    index = first_divergence(plain, speculative)
    if index is None:
        return None
    return Divergence(position=index, plain_token=int(plain[index]), speculative_token=int(speculative[index]),
                      logit_gap=top2_gap(base, prompt_ids, plain[:index]))
