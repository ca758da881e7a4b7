"""Prompt lookup as one more branch of the candidate tree (hybrid drafting).

Prompt-lookup decoding (Saxena, 2023; `prompt_lookup_num_tokens` in transformers) drafts the
tokens that followed the latest earlier occurrence of the text's last n-gram: free, and strong
wherever the answer copies from the prompt or from itself (extraction, code, lists). Medusa's
heads are strong elsewhere. Here the copied continuation becomes one chain of the tree, so one
verify pass checks both.

The chain fits the rank-path trees unchanged: it uses a reserved rank, `lookup_rank` (the column
after the heads' top-m), whose token at depth d is the chain's d-th token. Where the chain agrees
with a head node already in the tree it follows that node, so no token is verified twice.
Everything here is pure (lists in, lists out) except `ChainStats`, the per-session acceptance
record that turns chain depths into acceptance estimates for the adaptive budget. Grafting
chains onto a tree is `core.tree_policy.graft_chains`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from core.drafters.interface import Chain, DraftContext, HeadProposal
from core.strategy import MAX_CHAIN_TOKENS


MAX_NGRAM = 3
# prior chance that a chain found by an n-gram match is right at depth 1; deeper tokens decay
PRIOR_FIRST = {1: 0.2, 2: 0.35, 3: 0.5}
PRIOR_DECAY = 0.85
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior


@dataclass(frozen=True)
class LookupDraft:
    """Tokens copied after the latest earlier match of the text's last `ngram` tokens."""

    tokens: list[int]
    ngram: int


def lookup_drafts(sequence: Sequence[int], max_tokens: int, max_chains: int,
                  max_ngram: int = MAX_NGRAM) -> list[LookupDraft]:
    """Up to `max_chains` continuations of earlier occurrences of the text's last n-gram, with
    distinct first tokens: the longest match first, then the latest (recent text predicts the
    next tokens best); the others are what followed the same n-gram elsewhere (branches). A
    continuation that reaches the end of the text goes on periodically (`_continuation`).

    `sequence` is the whole text so far (prompt and output, ending with the token the drafts
    follow). Empty when no n-gram of 1..max_ngram tokens recurs or max_tokens is 0.
    """
    size = len(sequence)
    if max_tokens <= 0 or size < 2 or max_chains <= 0:
        return []
    last = sequence[-1]
    ends = [i for i, token in enumerate(sequence[:-1]) if token == last]  # one C-speed pass
    matches = []
    for end in ends:
        length = 1
        while length < max_ngram and end - length >= 0 and sequence[end - length] == sequence[size - 1 - length]:
            length += 1
        matches.append((length, end))
    drafts: list[LookupDraft] = []
    firsts: set[int] = set()
    for length, end in sorted(matches, key=lambda m: (-m[0], -m[1])):
        tokens = _continuation(sequence, end, max_tokens)
        if tokens and tokens[0] not in firsts:
            firsts.add(tokens[0])
            drafts.append(LookupDraft(tokens=tokens, ngram=length))
            if len(drafts) == max_chains:
                break
    return drafts


def _continuation(sequence: Sequence[int], end: int, max_tokens: int) -> list[int]:
    """The `max_tokens` tokens after position `end`, copied as if the copy went on writing: where
    the text runs out, the copy continues from what it has just copied (period size-1-end).

    Why: a match close to the end (a repetition loop, a list that repeats its pattern) left a
    chain of only a few tokens, while the loop predicts many more; transformers' prompt lookup
    takes the earliest match, which has a full continuation, and was ahead of ours on such text."""
    extended = list(sequence)
    tokens = []
    for offset in range(max_tokens):
        token = extended[end + 1 + offset]  # always inside: `extended` grows by one per copied token
        tokens.append(token)
        extended.append(token)
    return tokens


def agreeing_prefix(chain: Sequence[int], accepted_tokens: Sequence[int]) -> int:
    """How many leading tokens of `chain` the base model accepted."""
    return next((i for i, (a, b) in enumerate(zip(chain, accepted_tokens)) if a != b),
                min(len(chain), len(accepted_tokens)))


@dataclass
class ChainStats:
    """How often a drafter's chains were accepted through depth d, kept per key (per session).

    The key is what the drafter found the chain by (prompt lookup: the n-gram length that
    matched). Estimates start from a prior (`prior_first[key] * prior_decay^(d-1)`, worth
    `PRIOR_WEIGHT` observations) and move to the observed rate.
    """

    prior_first: dict[int, float] = field(default_factory=lambda: dict(PRIOR_FIRST))
    prior_decay: float = PRIOR_DECAY
    proposed: dict[tuple[int, int], float] = field(default_factory=dict)
    accepted: dict[tuple[int, int], float] = field(default_factory=dict)

    def chance(self, key: int, depth: int) -> float:
        """Estimated probability that a chain found by `key` is accepted through `depth` (1-based)."""
        first = self.prior_first.get(key, self.prior_first[max(self.prior_first)])
        prior = first * self.prior_decay ** (depth - 1)
        at = (key, depth)
        return (self.accepted.get(at, 0.0) + PRIOR_WEIGHT * prior) / (self.proposed.get(at, 0.0) + PRIOR_WEIGHT)

    def chances(self, key: int, length: int) -> list[float]:
        """Per-depth estimates for a chain, made non-increasing (a deeper token needs the ones before)."""
        out: list[float] = []
        for depth in range(1, length + 1):
            out.append(min(self.chance(key, depth), out[-1] if out else 1.0))
        return out

    def update(self, key: int, tokens: Sequence[int], verified_depth: int, accepted_tokens: Sequence[int]) -> None:
        """Record one step: the chain `tokens` was verified through `verified_depth`;
        `accepted_tokens` are the tokens the base model accepted after the root (bonus excluded)."""
        matched = min(verified_depth, agreeing_prefix(tokens, accepted_tokens))
        for depth in range(1, verified_depth + 1):
            at = (key, depth)
            self.proposed[at] = self.proposed.get(at, 0.0) + 1.0
            self.accepted[at] = self.accepted.get(at, 0.0) + (1.0 if depth <= matched else 0.0)


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
