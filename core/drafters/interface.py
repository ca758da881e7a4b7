"""Drafters: what proposes the next tokens. One small interface, two kinds of candidates.

A drafter looks at the current context (the tokens so far and the base model's last hidden
state) and proposes scored candidates for the tree builder (`core.tree_policy`):

- `HeadProposal`: per-depth marginals of parallel heads (Medusa): head d's top-m tokens and
  probabilities; a candidate is any rank path, scored by the product of its marginals.
- `GrownTree` (`core.drafters.hydra`): a tree a path-aware drafter grew node by node (Hydra heads),
  with each node's own token and joint score.
- `Chain`: one token sequence with a per-depth acceptance estimate (prompt lookup, the
  datastore): it joins the tree as a branch on a reserved rank column.

Verification, acceptance and the KV commit never know which drafter proposed a node. After a
step each drafter `observe`s what was accepted, to sharpen its estimates.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from core.drafters.layers import DRAFTER_EIGHT_BIT, BuiltOnce
from core.model import BaseModel
from core.precision import fast_bf16_batched
from core.tree import CandidateTree, dynamic_tree



def drafting_dtype(base: BaseModel, *, products_on_kernels: bool = False) -> torch.dtype:
    """The precision the heads draft in: bf16 where torch's many-row products measured fast
    (`core.precision.fast_bf16_batched`: a draft multiplies several rows, Medusa's heads at once or
    Hydra's beam), even under an fp32 base model, since a draft only proposes and the fp32 verify
    decides every token. On a Xeon with AMX, where the lab's default stays fp32, Hydra's propose
    measured 14.1-14.9 ms in fp32 and 8.5-9.2 in bf16, Medusa's 8.3 and 2.7-4.1.

    A drafter whose products all run in the exact engine's kernels (`products_on_kernels`: EAGLE's
    layer there) keeps the base model's dtype: the kernels multiply in fp32 whatever comes in, so bf16
    activations only add casts (2-core EPYC Zen 4 with AVX512-BF16, gguf-q8: a 16-node EAGLE propose
    10.2-10.9 ms with bf16 activations, 6.9-7.2 ms in fp32)."""
    if base.dtype == torch.float32 and fast_bf16_batched() and not (products_on_kernels and base.exact):
        return torch.bfloat16
    return base.dtype


_CAST = BuiltOnce()  # heads and their projection per drafting precision and base model


def heads_for_drafting(heads: nn.Module, base: BaseModel, *, products_on_kernels: bool = False
                       ) -> tuple[nn.Module, Any, torch.dtype]:
    """`heads` in the drafting precision (`drafting_dtype`) with their draft projection (a
    `core.drafters.medusa.DraftProjection`, built by the heads' own `draft_projection`; None: their own
    lm_head). Any heads with a `config` and `projects_once` serve: the interface knows no family.
    Built once per precision and base model, shared by every session."""
    dtype = drafting_dtype(base, products_on_kernels=products_on_kernels)
    drafting, projection = _CAST.get(heads, (dtype, id(base)), lambda: _cast(heads, base, dtype))
    return drafting, projection, dtype


def _cast(heads: nn.Module, base: BaseModel, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """`heads` in `dtype` (a copy where they differ) and their projection, with its products."""
    own = getattr(heads.config, "own_lm_head", False)
    projection = None if own else heads.draft_projection(base.lm_head)
    if projection is not None and projection.weight.dtype != dtype:
        projection = projection.to(dtype)
    if projection is not None and base.engine is not None:
        # heads that project once onto their widest rows (Medusa's) or every depth onto its own (Hydra's)
        rows = (projection.widest_rows,) if heads.projects_once else ()
        # on the exact engine, through its kernels: the GGUF's Q8_0 rows or the rows rounded to Q8_0,
        # times 8-bit inputs (`core.drafters.layers.DRAFTER_EIGHT_BIT`)
        projection = (projection.with_products(partial(base.engine.draft_product, eight_bit=DRAFTER_EIGHT_BIT),
                                               rows) if base.exact
                      else projection.with_measured_kernels(rows))
    drafting_heads = heads if next(heads.parameters()).dtype == dtype else copy.deepcopy(heads).to(dtype)
    return drafting_heads, projection


def drafting_embedding(base: BaseModel, dtype: torch.dtype) -> nn.Embedding:
    """The base model's token embedding in the drafting precision (a copy only when it differs):
    what drafters that read their path's tokens embed them with."""
    embed = base.model.get_input_embeddings()
    if embed.weight.dtype == dtype:
        return embed
    # one copy per precision, not one per session (14 ms each)
    return _EMBEDDINGS.get(embed, dtype, lambda: nn.Embedding.from_pretrained(embed.weight.to(dtype), freeze=True))


_EMBEDDINGS = BuiltOnce()  # the base model's embedding per drafting precision


def check_heads(heads: object, kind: type, name: str, config) -> None:
    """ValueError unless `heads` are `kind` with at least the `config.depth` heads a session asks for."""
    if not isinstance(heads, kind):
        raise ValueError(f"strategy {config.strategy!r} needs {name}")
    if config.depth > heads.config.num_heads:
        raise ValueError(f"depth {config.depth} exceeds the {heads.config.num_heads} heads loaded")


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may read at the start of a step."""

    tokens: Sequence[int]  # prompt + output so far, ending with the step's root token
    hidden: torch.Tensor  # [H] the base model's last hidden state (it predicted the root)
    # the hidden states of the answer so far, one [k, H] chunk per step (the prefill's last
    # position first); the last row is `hidden`. Read by drafters that attend over the answer
    history: Sequence[torch.Tensor] = ()
    # the step's node budget (the controller's `StepPlan.max_nodes`); None: the drafter's own
    max_nodes: int | None = None
    # per chunk of `history`, the same rows' tapped states and last hidden state, [k, (taps + 1) * H]
    # (low | mid | high): read by a drafter with `taps` (the EAGLE layer)
    features: Sequence[torch.Tensor] = ()


@dataclass(frozen=True)
class HeadProposal:
    """Parallel heads' guesses: row d holds head d+1's top-m tokens, sorted by probability."""

    probs: torch.Tensor  # [D, m]
    token_ids: torch.Tensor  # [D, m]

    def candidate_tree(self, budget: int, top_m: int, depth: int, fixed: CandidateTree | None = None
                       ) -> tuple[CandidateTree, torch.Tensor]:
        """The step's tree and its token table [D, m]: `fixed` over these guesses (scored by the joint
        probability of each path), else the dynamic tree of the `budget` best paths of the first
        `depth` heads' top-`top_m`."""
        if fixed is not None:
            scored = CandidateTree(paths=fixed.paths, kind=fixed.kind, scores=fixed.path_scores(self.probs))
            return scored, self.token_ids
        return dynamic_tree(self.probs[:depth, :top_m], budget), self.token_ids


class Proposal(Protocol):
    """What a heads drafter proposes (`HeadProposal`, `core.drafters.grown.GrownTree`): it makes the
    step's tree itself, so the tree policy never asks which family proposed it."""

    probs: torch.Tensor  # [D, m] what the heads table shows
    token_ids: torch.Tensor  # [D, m]

    def candidate_tree(self, budget: int, top_m: int, depth: int, fixed: CandidateTree | None = None
                       ) -> tuple[CandidateTree, torch.Tensor]: ...


@dataclass(frozen=True)
class Chain:
    """A continuation of the root proposed as one branch, with per-depth acceptance estimates."""

    tokens: list[int]
    chances: list[float]  # non-increasing: chance that the chain is right through depth d
    source: str  # the drafter's name, shown in the tree view
    key: int = 0  # what the drafter's statistics are kept by (e.g. the n-gram length that matched)


class Drafter(Protocol):
    """Proposes candidates for the next tokens and learns from what the base model accepted."""

    name: str

    def propose(self, context: DraftContext) -> Proposal | list[Chain] | None:
        """Candidates for the tokens after `context.tokens[-1]`, or None when it has none."""

    def observe(self, proposed: HeadProposal | list[Chain], verified_depths: Sequence[int],
                accepted_tokens: Sequence[int]) -> None:
        """One step's result: how deep each proposed chain was verified, and the accepted tokens
        after the root (bonus excluded)."""
