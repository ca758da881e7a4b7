"""Prompt lookup as one more branch of the candidate tree (hybrid drafting).

Prompt-lookup decoding (Saxena, 2023; `prompt_lookup_num_tokens` in transformers) drafts the
tokens that followed the latest earlier occurrence of the text's last n-gram: free, and strong
wherever the answer copies from the prompt or from itself (extraction, code, lists). Medusa's
heads are strong elsewhere. Here the copied continuation becomes one chain of the tree, so one
verify pass checks both.

The chain fits the rank-path trees unchanged: it uses a reserved rank, `lookup_rank` (the column
after the heads' top-m), whose token at depth d is the chain's d-th token. Where the chain agrees
with a head node already in the tree it follows that node, so no token is verified twice.
Everything here is pure (lists in, lists out) except `LookupStats`, the per-session acceptance
record that turns chain depths into acceptance estimates for the adaptive budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from core.tree import CandidateTree, RankPath

MAX_NGRAM = 3
CHAIN_TOKENS = 10  # the chain length the benchmark and the app use, as transformers' prompt_lookup_num_tokens
# prior chance that a chain found by an n-gram match is right at depth 1; deeper tokens decay
PRIOR_FIRST = {1: 0.2, 2: 0.35, 3: 0.5}
PRIOR_DECAY = 0.85
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior


@dataclass(frozen=True)
class LookupDraft:
    """Tokens copied after the latest earlier match of the text's last `ngram` tokens."""

    tokens: list[int]
    ngram: int


def lookup_draft(sequence: Sequence[int], max_tokens: int, max_ngram: int = MAX_NGRAM) -> LookupDraft | None:
    """The continuation of the latest earlier occurrence of the last n tokens (longest n first).

    `sequence` is the whole text so far (prompt and output, ending with the token the next
    draft follows). None when no n-gram of 1..max_ngram tokens recurs or max_tokens is 0.
    """
    size = len(sequence)
    if max_tokens <= 0 or size < 2:
        return None
    last = sequence[-1]
    ends = [i for i, token in enumerate(sequence[:-1]) if token == last]  # one C-speed pass
    best_length, best_end = 0, -1
    for end in reversed(ends):  # latest first: recent text predicts the next tokens best
        length = 1
        while length < max_ngram and end - length >= 0 and sequence[end - length] == sequence[size - 1 - length]:
            length += 1
        if length > best_length:
            best_length, best_end = length, end
            if length == max_ngram:
                break
    if not best_length:
        return None
    return LookupDraft(tokens=list(sequence[best_end + 1:best_end + 1 + max_tokens]), ngram=best_length)


@dataclass
class LookupStats:
    """How often a chain found by an n-gram match was accepted through depth d (per session)."""

    proposed: dict[tuple[int, int], float] = field(default_factory=dict)
    accepted: dict[tuple[int, int], float] = field(default_factory=dict)

    def chance(self, ngram: int, depth: int) -> float:
        """Estimated probability that the chain is accepted through `depth` (1-based)."""
        prior = PRIOR_FIRST.get(ngram, PRIOR_FIRST[MAX_NGRAM]) * PRIOR_DECAY ** (depth - 1)
        key = (ngram, depth)
        return (self.accepted.get(key, 0.0) + PRIOR_WEIGHT * prior) / (self.proposed.get(key, 0.0) + PRIOR_WEIGHT)

    def chances(self, draft: LookupDraft) -> list[float]:
        """Per-depth estimates for a chain, made non-increasing (a deeper token needs the ones before)."""
        out: list[float] = []
        for depth in range(1, len(draft.tokens) + 1):
            out.append(min(self.chance(draft.ngram, depth), out[-1] if out else 1.0))
        return out

    def update(self, draft: LookupDraft, verified_depth: int, accepted_tokens: Sequence[int]) -> None:
        """Record one step: the chain was verified through `verified_depth`; `accepted_tokens` are
        the head-depth tokens the base model accepted (bonus excluded)."""
        matched = 0
        while matched < min(verified_depth, len(accepted_tokens)) and draft.tokens[matched] == accepted_tokens[matched]:
            matched += 1
        for depth in range(1, verified_depth + 1):
            key = (draft.ngram, depth)
            self.proposed[key] = self.proposed.get(key, 0.0) + 1.0
            self.accepted[key] = self.accepted.get(key, 0.0) + (1.0 if depth <= matched else 0.0)


def token_table(head_ids: torch.Tensor, draft: LookupDraft) -> torch.Tensor:
    """The heads' [K, m] token table plus the lookup column: [max(K, L), m+1].

    Column m (the lookup rank) holds the chain's d-th token in row d-1; rows past the heads'
    depth hold only that column (their other entries are never addressed).
    """
    depth, width = head_ids.shape
    rows = max(depth, len(draft.tokens))
    table = torch.zeros(rows, width + 1, dtype=head_ids.dtype, device=head_ids.device)  # [max(K, L), m+1]
    table[:depth, :width] = head_ids
    table[: len(draft.tokens), width] = torch.tensor(draft.tokens, dtype=head_ids.dtype, device=head_ids.device)
    return table


def graft_chain(tree: CandidateTree, head_ids: list[list[int]], draft: LookupDraft, chances: list[float],
                lookup_rank: int) -> tuple[CandidateTree, list[RankPath]]:
    """`tree` with the lookup chain added: the chain follows the tree's own nodes while their
    tokens agree, then continues on the lookup rank. Pure; the tree must carry scores.

    Scores stay acceptance estimates that never grow with depth: a node shared with the chain
    scores max(its head score, the chain's estimate at that depth); a new node scores the chain's
    estimate. Sorting by score (depth breaks ties) therefore lists parents first, and every
    prefix of the result is itself a tree, as the adaptive budget needs. Also returns the chain's
    node paths, depth 1 first.
    """
    scores = dict(zip(tree.paths, tree.scores or [0.0] * tree.num_nodes))
    chain: list[RankPath] = []
    path: RankPath = ()
    for depth, (token, chance) in enumerate(zip(draft.tokens, chances)):
        same = None
        if not path or path[-1] != lookup_rank:
            row = head_ids[depth] if depth < len(head_ids) else []
            same = next((path + (rank,) for rank, t in enumerate(row) if t == token and path + (rank,) in scores), None)
        path = same if same is not None else path + (lookup_rank,)
        scores[path] = max(scores.get(path, 0.0), chance)
        chain.append(path)
    order = sorted(scores, key=lambda p: (-scores[p], len(p)))
    return CandidateTree(paths=order, scores=[scores[p] for p in order], kind=tree.kind), chain
