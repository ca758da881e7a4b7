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
import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn

from core.drafters.medusa import DraftProjection, MedusaHeads
from core.drafters.grown import GrownTree
from core.drafters.hydra import HydraHeads, PrefixCache, grow_tree
from core.drafters.lookup import ChainStats, agreeing_prefix, lookup_drafts
from core.model import BaseModel, fast_bf16_batched
from core.strategy import MAX_CHAIN_TOKENS
from core.tree import CandidateTree, dynamic_tree



def drafting_dtype(base: BaseModel, *, products_on_kernels: bool = False) -> torch.dtype:
    """The precision the heads draft in: bf16 where torch's many-row products measured fast
    (`core.model.fast_bf16_batched`: a draft multiplies several rows, Medusa's heads at once or
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


# heads and their projection cast once per precision (read-only, shared by every session)
_CAST: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def heads_for_drafting(heads: MedusaHeads | HydraHeads, base: BaseModel, *, products_on_kernels: bool = False
                       ) -> tuple[MedusaHeads | HydraHeads, DraftProjection | None, torch.dtype]:
    """`heads` in the drafting precision (`drafting_dtype`) with their draft projection (None: own lm_head)."""
    dtype = drafting_dtype(base, products_on_kernels=products_on_kernels)
    cast = _CAST.setdefault(heads, {})
    if dtype not in cast:
        own = isinstance(heads, MedusaHeads) and heads.config.own_lm_head
        projection = None if own else heads.draft_projection(base.lm_head)
        if projection is not None and projection.weight.dtype != dtype:
            projection = projection.to(dtype)
        if projection is not None and base.engine is not None:
            # Medusa projects once onto its widest rows; Hydra multiplies every depth's own rows
            rows = (projection.widest_rows,) if isinstance(heads, MedusaHeads) else ()
            # on the exact engine, through its kernels: the GGUF's Q8_0 rows (gguf) or bf16 ones
            projection = (projection.with_products(base.engine.draft_product, rows) if base.exact
                          else projection.with_measured_kernels(rows))
        drafting_heads = heads if next(heads.parameters()).dtype == dtype else copy.deepcopy(heads).to(dtype)
        cast[dtype] = (drafting_heads, projection)
    drafting, projection = cast[dtype]
    return drafting, projection, dtype


def drafting_embedding(base: BaseModel, dtype: torch.dtype) -> nn.Embedding:
    """The base model's token embedding in the drafting precision (a copy only when it differs):
    what drafters that read their path's tokens embed them with."""
    embed = base.model.get_input_embeddings()
    if embed.weight.dtype == dtype:
        return embed
    return nn.Embedding.from_pretrained(embed.weight.to(dtype), freeze=True)


def _check_heads(heads: object, kind: type, name: str, config) -> None:
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


class HeadsDrafter:
    """Medusa heads: head k guesses token t+k+1 from the hidden state at t alone."""

    name = "heads"

    def __init__(self, heads: MedusaHeads, base: BaseModel, width: int, depth: int) -> None:
        self.heads, self.projection, self.dtype = heads_for_drafting(heads, base)
        self.width = width
        self.depth = depth

    @classmethod
    def for_session(cls, heads: object, base: BaseModel, config, fixed: CandidateTree | None = None
                    ) -> "HeadsDrafter":
        """The drafter a fixed or dynamic session drafts with (config: a `core.decoder.DecodeConfig`;
        `fixed`: the fixed tree it decodes or the page draws beside, whose ranks it must cover)."""
        _check_heads(heads, MedusaHeads, "Medusa heads", config)
        width = max(config.top_m, fixed.max_rank + 1 if fixed else 1)
        # `depth` bounds the dynamic tree; a fixed tree brings its own depth
        depth = max(config.depth, fixed.max_depth if fixed else 0)
        return cls(heads, base, width=width, depth=depth)

    def propose(self, context: DraftContext) -> HeadProposal:
        hidden = context.hidden.to(self.dtype)  # [H]
        probs, ids = self.heads.propose(hidden, self.width, self.projection, depth=self.depth)  # [D, m] each
        return HeadProposal(probs=probs, token_ids=ids)

    def observe(self, proposed: HeadProposal | list[Chain], verified_depths: Sequence[int],
                accepted_tokens: Sequence[int]) -> None:
        """The heads are frozen; their calibration lives in the adaptive budget (`core.budget.controller`)."""


class HydraDrafter:
    """Hydra heads: each guess reads the path before it; the tree is grown depth by depth."""

    name = "hydra"

    def __init__(self, heads: HydraHeads, base: BaseModel, *, width: int, beam: int, depth: int, budget: int) -> None:
        self.heads, self.projection, self.dtype = heads_for_drafting(heads, base)
        self.embed = drafting_embedding(base, self.dtype)
        self.width, self.beam, self.depth, self.budget = width, beam, depth, budget
        # the prefix layer's cache over context.history[:seen] (copy.copy of the drafter forks it:
        # a cache is never changed in place)
        self.prefix_cache: PrefixCache | None = None
        self.seen = 0
        self.last_state: torch.Tensor | None = None

    @classmethod
    def for_session(cls, heads: object, base: BaseModel, config, fixed: CandidateTree | None = None
                    ) -> "HydraDrafter":
        """The drafter of a hydra session (config: a `core.decoder.DecodeConfig`; a grown tree reads no
        fixed tree)."""
        _check_heads(heads, HydraHeads, "Hydra heads", config)
        return cls(heads, base, width=config.top_m, beam=config.beam, depth=config.depth, budget=config.budget)

    @property
    def reads_history(self) -> bool:
        """True when proposing needs DraftContext.history (heads with a prefix layer)."""
        return self.heads.prefix is not None

    def propose(self, context: DraftContext) -> GrownTree:
        """The grown tree of `budget` nodes, or of `context.max_nodes` when fewer: the same nodes as
        the full growth's best `max_nodes` up to exact score ties (a node's ancestors score at least
        as high, so none lies deeper than `max_nodes` or outside the best `max_nodes` of its depth),
        for fewer head calls."""
        budget = self.budget if context.max_nodes is None else max(1, min(self.budget, context.max_nodes))
        return grow_tree(self.heads, self.embed, self.projection, self._state(context), int(context.tokens[-1]),
                         budget=budget, width=self.width, beam=self.beam, depth=min(self.depth, budget))

    @torch.inference_mode()
    def _state(self, context: DraftContext) -> torch.Tensor:
        """[H] what the heads read: the hidden state, or the prefix layer's output after it."""
        if self.heads.prefix is None:
            return context.hidden
        if not context.history:
            raise ValueError("Hydra heads with a prefix layer need the answer's hidden states (DraftContext.history)")
        if self.seen > len(context.history):  # a shorter history than the one cached: start over
            self.prefix_cache, self.seen = None, 0
        if self.seen < len(context.history):
            fresh = torch.cat([chunk.to(self.dtype) for chunk in context.history[self.seen:]])  # [n, H]
            outputs, self.prefix_cache = self.heads.prefix.extend(self.prefix_cache, fresh)  # [n, H]
            self.seen, self.last_state = len(context.history), outputs[-1]
        return self.last_state

    def observe(self, proposed: Proposal | list[Chain], verified_depths: Sequence[int],
                accepted_tokens: Sequence[int]) -> None:
        """The heads are frozen; their calibration lives in the adaptive budget (`core.budget.controller`)."""


class LookupDrafter:
    """Prompt lookup: copy what followed earlier occurrences of the text's last n-gram.

    The latest longest match gives the main chain; the same n-gram matched elsewhere with a
    different next token gives extra branches. Chains grow while copies run long: after a step
    that accepted a whole chain the next ones are twice as long (up to `max_tokens * 4`, at most
    32), and they shrink back once a chain is rejected early.
    """

    name = "lookup"

    def __init__(self, max_tokens: int, chains: int = 1) -> None:
        self.base_tokens = max_tokens
        self.length = max_tokens
        self.chains = chains
        self.stats = ChainStats()

    def propose(self, context: DraftContext) -> list[Chain] | None:
        drafts = lookup_drafts(context.tokens, self.length, self.chains)
        return [Chain(tokens=d.tokens, chances=self.stats.chances(d.ngram, len(d.tokens)), source=self.name,
                      key=d.ngram) for d in drafts] or None

    def observe(self, proposed: HeadProposal | list[Chain], verified_depths: Sequence[int],
                accepted_tokens: Sequence[int]) -> None:
        for chain, depth in zip(proposed, verified_depths):
            self.stats.update(chain.key, chain.tokens, depth, accepted_tokens)
        if proposed and verified_depths:
            main, depth = proposed[0], verified_depths[0]
            copied = agreeing_prefix(main.tokens, accepted_tokens)
            if depth and copied >= depth == len(main.tokens):
                self.length = min(2 * self.length, 4 * self.base_tokens, MAX_CHAIN_TOKENS)
            elif copied < depth // 2:
                self.length = self.base_tokens
