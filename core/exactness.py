"""Checking speculative output against plain decoding, and explaining any divergence.

In fp32 a tree forward and single-token forwards differ by ~5e-5 in the logits, so greedy
outputs match token for token unless the plain run faces a near-tie. In bf16 they round
differently and near-ties flip more often. A divergence is reported with the plain run's
top-2 logit gap at that position: a small gap means rounding, a large one would be a bug.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from core.model import BaseModel

if TYPE_CHECKING:
    from core.decoder import DecodeSession


@dataclass(frozen=True)
class Divergence:
    """Where a speculative output first differs from the plain run, and how close the plain
    run's choice was there (from the logits the plain run itself used)."""

    position: int  # index into the generated tokens
    plain_token: int
    speculative_token: int
    logit_gap: float  # plain run's top-1 minus top-2 logit at that position
    top_logit: float = float("nan")  # plain run's top-1 logit there (sets bf16's rounding step)

    @property
    def bf16_steps(self) -> float:
        """The gap in bf16 rounding steps at the top logit's magnitude."""
        return self.logit_gap / bf16_rounding_step(self.top_logit)


def bf16_rounding_step(value: float) -> float:
    """Spacing of bf16 numbers at |value| (8 significant bits: 2^(floor(log2|value|) - 7))."""
    magnitude = max(abs(value), 2.0 ** -126)
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


def plain_margins(session: "DecodeSession") -> list[tuple[float, float]]:
    """Top-1 and top-2 logits behind every token of a plain (autoregressive) run, as it decoded:
    the prefill chose the first token, each plain step one more."""
    if any(r.top_logits is None for r in session.records):
        raise ValueError("margins come from a plain (autoregressive) run")
    return [session.prefill_top_logits] + [r.top_logits for r in session.records]


def divergence_from_margins(plain: Sequence[int], margins: Sequence[tuple[float, float]],
                            speculative: Sequence[int]) -> Divergence | None:
    """None when the outputs agree over their common length, else where, with the plain run's
    own margin there (no fresh forward: the logits that made the choice)."""
    index = first_divergence(plain, speculative)
    if index is None:
        return None
    top1, top2 = margins[index]
    return Divergence(position=index, plain_token=int(plain[index]), speculative_token=int(speculative[index]),
                      logit_gap=top1 - top2, top_logit=top1)


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
