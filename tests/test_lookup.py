"""The prompt-lookup branch: the n-gram draft, grafting it onto a tree, and its acceptance record."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.lookup import LookupDraft, LookupStats, graft_chain, lookup_draft, token_table
from core.profile import CostProfile, best_prefix
from core.tree import dynamic_tree
from tests.test_tree import check_invariants


def test_draft_copies_after_the_latest_longest_match():
    #           0  1  2  3  4  5  6  7  8  9
    sequence = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    draft = lookup_draft(sequence, max_tokens=3)
    assert draft == LookupDraft(tokens=[2, 6, 7], ngram=2)  # "6 7" last seen at 6..7, then 2 6 7
    assert lookup_draft([1, 2, 3, 1, 2], max_tokens=10) == LookupDraft(tokens=[3, 1, 2], ngram=2)
    assert lookup_draft([4, 9, 4], max_tokens=2) == LookupDraft(tokens=[9, 4], ngram=1)
    assert lookup_draft([1, 2, 3], max_tokens=4) is None  # nothing recurs
    assert lookup_draft([1, 2, 1], max_tokens=0) is None
    assert lookup_draft([7], max_tokens=3) is None


def test_draft_matches_a_brute_force_search():
    sequence = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    for end in range(2, len(sequence) + 1):
        text = sequence[:end]
        expected = None
        for n in (3, 2, 1):
            if n >= len(text):
                continue
            starts = [s for s in range(len(text) - n) if text[s:s + n] == text[-n:]]
            if starts:
                expected = LookupDraft(tokens=text[starts[-1] + n:starts[-1] + n + 4], ngram=n)
                break
        assert lookup_draft(text, max_tokens=4) == expected, text


def heads_and_tree(seed: int, budget: int) -> tuple[torch.Tensor, list[list[int]], object]:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(4, 6, generator=generator).sort(dim=1, descending=True).values  # [K, m]
    ids = torch.randperm(40, generator=generator)[:24].reshape(4, 6)  # [K, m] distinct tokens
    return ids, ids.tolist(), dynamic_tree(probs, budget)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 30), st.lists(st.integers(0, 40), min_size=1, max_size=8))
def test_grafted_tree_is_valid_and_every_prefix_is_a_tree(seed, budget, chain_tokens):
    ids, id_rows, tree = heads_and_tree(seed, budget)
    draft = LookupDraft(tokens=chain_tokens, ngram=2)
    grafted, chain = graft_chain(tree, id_rows, draft, LookupStats().chances(draft), lookup_rank=6)
    check_invariants(grafted)
    assert len(chain) == len(chain_tokens) and [len(p) for p in chain] == list(range(1, len(chain) + 1))
    assert set(tree.paths) <= set(grafted.paths) and grafted.num_nodes <= tree.num_nodes + len(chain_tokens)
    for size in range(grafted.num_nodes + 1):  # what the adaptive budget keeps is a tree too
        check_invariants(type(grafted)(paths=grafted.paths[:size]))
    # the chain's nodes spell the draft, whether they are head nodes or lookup nodes
    tokens = grafted.node_tokens(99, token_table(ids, draft)).tolist()
    assert [tokens[grafted.node_index(p)] for p in chain] == chain_tokens


def test_chain_follows_head_nodes_that_agree_and_never_duplicates_them():
    ids, id_rows, tree = heads_and_tree(seed=3, budget=20)
    first, second = tree.paths[0], next(p for p in tree.paths if len(p) == 2 and p[0] == tree.paths[0][0])
    draft = LookupDraft(tokens=[id_rows[0][first[0]], id_rows[1][second[1]], 77], ngram=3)
    grafted, chain = graft_chain(tree, id_rows, draft, [0.9, 0.8, 0.7], lookup_rank=6)
    assert chain == [first, second, second + (6,)]
    assert grafted.num_nodes == tree.num_nodes + 1
    scores = dict(zip(grafted.paths, grafted.scores))
    assert scores[first] == pytest.approx(max(0.9, dict(zip(tree.paths, tree.scores))[first]))
    assert scores[second + (6,)] == 0.7


def test_chain_estimates_learn_from_acceptance():
    stats = LookupStats()
    draft = LookupDraft(tokens=[4, 5, 6], ngram=1)
    prior = stats.chances(draft)
    assert prior == sorted(prior, reverse=True) and prior[0] < 0.5
    for _ in range(20):
        stats.update(draft, verified_depth=3, accepted_tokens=[4, 5, 6])
    assert all(c > 0.9 for c in stats.chances(draft))
    for _ in range(40):
        stats.update(draft, verified_depth=3, accepted_tokens=[4, 9])
    learned = stats.chances(draft)
    assert learned[0] > 0.9 and learned[1] < 0.5 and learned[2] <= learned[1]
    stats.update(draft, verified_depth=1, accepted_tokens=[4, 5, 6])  # only depth 1 was verified
    assert stats.proposed[(1, 2)] == 60


def test_adaptive_budget_takes_a_likely_chain_and_leaves_an_unlikely_one():
    flat = CostProfile(sizes=[1, 16, 64], ms=[20.0, 21.0, 40.0])
    ids, id_rows, tree = heads_and_tree(seed=1, budget=6)
    draft = LookupDraft(tokens=[90, 91, 92, 93, 94, 95], ngram=3)
    for chance, wanted in ((0.95, True), (0.001, False)):
        grafted, chain = graft_chain(tree, id_rows, draft, [chance ** d for d in range(1, 7)], lookup_rank=6)
        size, _ = best_prefix(grafted.scores, grafted.depths[1:], flat, overhead_ms=2.0)
        kept = set(grafted.paths[:size])
        assert all(p in kept for p in chain) == wanted
