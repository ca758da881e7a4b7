"""A datastore drafter: retrieval from the model's own earlier answers (after REST, He et al. 2024).

A small model repeats its own phrasing ("Here are some ...", "In conclusion, ..."), so the
continuations that followed the current text's last few tokens in its earlier answers are good
guesses. The store is a suffix array over all answers, sorted on each suffix's first
`KEY_TOKENS` tokens; the longest suffix of the current text (up to `MAX_MATCH` tokens) found in
it gives a range of occurrences, and their most frequent continuations become branches of the
tree, scored by how often each was seen (times a per-match-length reliability learned online).

    store = default_store()                 # the committed distillation answers
    store.search([..., 504, 5997])          # -> (match length, occurrence positions)

The shipped index covers the committed answers of `assets/distill/distill.jsonl.gz`; a larger local one is
built from more generated answers with `MEDUSA_LAB_STORE=data/distill_chat.jsonl` (JSONL rows
with `answer_ids`, comma-separated paths), which need not be committed.
"""
from __future__ import annotations

import functools
import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from core import settings
from core.drafters.interface import Chain, DraftContext, HeadProposal
from core.drafters.lookup import ChainStats
from core.model import REPO_ROOT

KEY_TOKENS = 12  # suffixes are sorted on this many tokens: matches + continuations up to it
MAX_MATCH = 6
MIN_MATCH = 3  # two-token matches are everywhere in 406k tokens and predict little
MAX_OCCURRENCES = 128  # occurrences read per search: an evenly spaced sample of all of them
SEPARATOR = -1  # between answers: no match or continuation crosses it
SHIPPED_ANSWERS = REPO_ROOT / "assets" / "distill" / "distill.jsonl.gz"
# prior chance that the most frequent continuation is right at depth 1, by match length: cautious,
# since a too-hopeful prior makes every step verify branches that bf16 CPUs pay dearly for
STORE_PRIOR = {3: 0.2, 4: 0.25, 5: 0.3, 6: 0.35}
STORE_DECAY = 0.8


class TokenStore:
    """A suffix array over token sequences, searchable by the longest matching suffix."""

    def __init__(self, sequences: Iterable[Sequence[int]]) -> None:
        parts = []
        for seq in sequences:
            parts.extend(seq)
            parts.append(SEPARATOR)
        self.tokens = np.asarray(parts, dtype=np.int32)  # [N]
        padded = np.concatenate([self.tokens, np.full(KEY_TOKENS, SEPARATOR, dtype=np.int32)])  # [N + K]
        windows = np.lib.stride_tricks.sliding_window_view(padded, KEY_TOKENS)[: len(self.tokens)]  # [N, K]
        starts = np.flatnonzero(self.tokens != SEPARATOR)  # [S] suffixes that start on a token
        # np.lexsort sorts by its last key first: reversed columns give lexicographic order
        order = np.lexsort(tuple(windows[starts, k] for k in range(KEY_TOKENS - 1, -1, -1)))
        self.suffixes = starts[order]  # [S] suffix start positions in sorted order
        self.columns = [np.ascontiguousarray(windows[self.suffixes, k]) for k in range(KEY_TOKENS)]  # K x [S]

    def __len__(self) -> int:
        return int((self.tokens != SEPARATOR).sum())

    def __deepcopy__(self, memo: dict) -> "TokenStore":
        return self  # read-only: forked sessions share one store

    def search(self, context: Sequence[int], max_match: int = MAX_MATCH) -> tuple[int, np.ndarray]:
        """(length, suffix positions) of the longest suffix of `context` (at most `max_match`
        tokens) that occurs in the store; (0, empty) when not even its last token does."""
        best_length, best = 0, (0, 0)
        for length in range(min(max_match, len(context), KEY_TOKENS - 1), 0, -1):
            lo, hi = 0, len(self.suffixes)
            for k, token in enumerate(context[-length:]):
                column = self.columns[k]
                lo, hi = (lo + int(np.searchsorted(column[lo:hi], token, side="left")),
                          lo + int(np.searchsorted(column[lo:hi], token, side="right")))
                if lo == hi:
                    break
            if hi > lo:
                best_length, best = length, (lo, hi)
                break
        lo, hi = best
        return best_length, self.suffixes[lo:hi]

    def continuations(self, context: Sequence[int], depth: int, branches: int,
                      min_match: int = MIN_MATCH) -> tuple[int, list[tuple[list[int], list[float]]]]:
        """(match length, [(tokens, per-depth frequency)]) of the most frequent continuations.

        The frequency at depth d is the share of occurrences that continue with the branch's
        first d tokens (non-increasing). Branches are distinct at their first differing token."""
        length, positions = self.search(context)
        if length < min_match or not len(positions):
            return length, []
        positions = fair_sample(positions, MAX_OCCURRENCES)
        if depth <= 0:
            return length, []
        starts = positions + length  # [occ] where the continuation begins
        idx = starts[:, None] + np.arange(depth)[None, :]  # [occ, depth]
        idx = np.minimum(idx, len(self.tokens) - 1)
        follow = self.tokens[idx]  # [occ, depth]
        total = len(follow)
        rows = [tuple(int(t) for t in row) for row in follow]
        rows = [row[: row.index(SEPARATOR)] if SEPARATOR in row else row for row in rows]
        counts = Counter(rows)
        chosen: list[tuple[list[int], list[float]]] = []
        # most frequent first; among equally frequent ones the longest (it drafts deeper)
        for row, _ in sorted(counts.items(), key=lambda item: (-item[1], -len(item[0]))):
            if not row or any(row[0] == c[0][0] for c in chosen):
                continue  # one branch per first token: the most frequent one
            prefix_counts = [sum(1 for r in rows if r[: d + 1] == row[: d + 1]) for d in range(len(row))]
            chosen.append((list(row), [c / total for c in prefix_counts]))
            if len(chosen) == branches:
                break
        return length, chosen


def fair_sample(positions: np.ndarray, size: int) -> np.ndarray:
    """At most `size` of `positions`, evenly spaced over them. The suffix array sorts occurrences
    by what follows them, so an even spacing keeps each continuation's share (a slice from one
    end would keep the continuations that sort last and drop the most frequent one)."""
    if len(positions) <= size:
        return positions
    return positions[np.linspace(0, len(positions) - 1, size).round().astype(np.int64)]


def read_answers(paths: Iterable[Path]) -> list[list[int]]:
    """The `answer_ids` of every row of JSONL files (gzipped or not)."""
    answers = []
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as lines:
            answers.extend(json.loads(line)["answer_ids"] for line in lines if line.strip())
    return answers


def store_paths() -> tuple[Path, ...]:
    """The shipped answers, plus the local files named by MEDUSA_LAB_STORE, if any."""
    extra = [Path(p) for p in settings.SETTINGS.store.split(",") if p.strip()]
    return (SHIPPED_ANSWERS, *extra)


@functools.lru_cache(maxsize=2)
def default_store(paths: tuple[Path, ...] | None = None) -> TokenStore:
    """The store over the model's own answers (built once per process: about a second)."""
    return TokenStore(read_answers(paths or store_paths()))


class StoreDrafter:
    """Proposes the store's most frequent continuations of the current text as chains."""

    name = "store"

    def __init__(self, store: TokenStore, max_tokens: int, branches: int = 3) -> None:
        self.store = store
        self.max_tokens = max_tokens
        self.branches = branches
        self.stats = ChainStats(prior_first=dict(STORE_PRIOR), prior_decay=STORE_DECAY)

    def propose(self, context: DraftContext) -> list[Chain] | None:
        length, found = self.store.continuations(context.tokens, self.max_tokens, self.branches)
        if not found:
            return None
        key = min(length, MAX_MATCH)
        # the top branch's acceptance is learned directly; the others are scaled by their counts
        top = self.stats.chances(key, len(found[0][0]))
        top_freqs = found[0][1]
        chains = []
        for tokens, freqs in found:
            chances = [top[min(d, len(top) - 1)] * min(1.0, f / top_freqs[min(d, len(top_freqs) - 1)])
                       for d, f in enumerate(freqs)]
            chances = [min(chances[: d + 1]) for d in range(len(chances))]  # non-increasing
            chains.append(Chain(tokens=tokens, chances=chances, source=self.name, key=key))
        return chains

    def observe(self, proposed: HeadProposal | list[Chain], verified_depths: Sequence[int],
                accepted_tokens: Sequence[int]) -> None:
        """Reliability is learned from the most frequent branch (the others are scaled by count)."""
        if proposed and verified_depths:
            top = proposed[0]
            self.stats.update(top.key, top.tokens, verified_depths[0], accepted_tokens)
