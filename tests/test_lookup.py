"""The prompt-lookup branch: the n-gram draft, grafting it onto a tree, and its acceptance record."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.drafters.interface import Chain, HeadProposal
from core.drafters.lookup import ChainStats, LookupDraft, lookup_drafts
from core.budget.cost_profile import CostProfile, best_prefix
from core.tree import CandidateTree, dynamic_tree
from core.tree_policy import chain_token_table, graft_chains
from tests.test_tree import check_invariants


def lookup_draft(sequence: list[int], max_tokens: int) -> LookupDraft | None:
    """The main chain: the latest longest match's continuation."""
    drafts = lookup_drafts(sequence, max_tokens, max_chains=1)
    return drafts[0] if drafts else None


def test_draft_copies_after_the_latest_longest_match():
    #           0  1  2  3  4  5  6  7  8  9
    sequence = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    draft = lookup_draft(sequence, max_tokens=3)
    assert draft == LookupDraft(tokens=[2, 6, 7], ngram=2)  # "6 7" last seen at 6..7, then 2 6 7
    # the copy reaches the end of the text and goes on with what it copied: the loop continues
    assert lookup_draft([1, 2, 3, 1, 2], max_tokens=10) == LookupDraft(tokens=[3, 1, 2, 3, 1, 2, 3, 1, 2, 3], ngram=2)
    assert lookup_draft([4, 9, 4], max_tokens=2) == LookupDraft(tokens=[9, 4], ngram=1)
    assert lookup_draft([1, 2, 3], max_tokens=4) is None  # nothing recurs
    assert lookup_draft([1, 2, 1], max_tokens=0) is None
    assert lookup_draft([7], max_tokens=3) is None


def test_a_repetition_loop_gives_a_full_length_chain():
    """A model caught in a loop of period 3: the latest match is 3 tokens back, yet the chain is
    as long as asked (transformers' earliest-match rule had that advantage before)."""
    loop = [7, 8, 9] * 4 + [7]
    draft = lookup_draft(loop, max_tokens=10)
    assert draft.tokens == [8, 9, 7, 8, 9, 7, 8, 9, 7, 8] and draft.ngram == 3


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
                copied = list(text)  # the copy of a match near the end goes on periodically
                for offset in range(4):
                    copied.append(copied[starts[-1] + n + offset])
                expected = LookupDraft(tokens=copied[len(text):], ngram=n)
                break
        assert lookup_draft(text, max_tokens=4) == expected, text


def heads_and_tree(seed: int, budget: int) -> tuple[torch.Tensor, list[list[int]], object]:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(4, 6, generator=generator).sort(dim=1, descending=True).values  # [K, m]
    ids = torch.randperm(40, generator=generator)[:24].reshape(4, 6)  # [K, m] distinct tokens
    return ids, ids.tolist(), dynamic_tree(probs, budget)


def graft_one(tree: CandidateTree, ids: torch.Tensor, tokens: list[int], chances: list[float]):
    """Graft one chain on rank 6 (after the heads' top-6): (tree, the chain's node paths)."""
    chain = Chain(tokens=tokens, chances=chances, source="lookup")
    grafted, paths, _ = graft_chains(tree, chain_token_table(ids, [chain]), [chain], first_chain_rank=6)
    return grafted, paths[0]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 30), st.lists(st.integers(0, 40), min_size=1, max_size=8))
def test_grafted_tree_is_valid_and_every_prefix_is_a_tree(seed, budget, chain_tokens):
    ids, id_rows, tree = heads_and_tree(seed, budget)
    grafted, chain = graft_one(tree, ids, chain_tokens, ChainStats().chances(2, len(chain_tokens)))
    check_invariants(grafted)
    assert len(chain) == len(chain_tokens) and [len(p) for p in chain] == list(range(1, len(chain) + 1))
    assert set(tree.paths) <= set(grafted.paths) and grafted.num_nodes <= tree.num_nodes + len(chain_tokens)
    for size in range(grafted.num_nodes + 1):  # what the adaptive budget keeps is a tree too
        check_invariants(type(grafted)(paths=grafted.paths[:size]))
    # the chain's nodes spell the draft, whether they are head nodes or lookup nodes
    tokens = grafted.node_tokens(99, chain_token_table(ids, [Chain(chain_tokens, [], "lookup")])).tolist()
    assert [tokens[grafted.node_index(p)] for p in chain] == chain_tokens


def test_chain_follows_head_nodes_that_agree_and_never_duplicates_them():
    ids, id_rows, tree = heads_and_tree(seed=3, budget=20)
    first, second = tree.paths[0], next(p for p in tree.paths if len(p) == 2 and p[0] == tree.paths[0][0])
    grafted, chain = graft_one(tree, ids, [id_rows[0][first[0]], id_rows[1][second[1]], 77], [0.9, 0.8, 0.7])
    assert chain == [first, second, second + (6,)]
    assert grafted.num_nodes == tree.num_nodes + 1
    scores = dict(zip(grafted.paths, grafted.scores))
    assert scores[first] == pytest.approx(max(0.9, dict(zip(tree.paths, tree.scores))[first]))
    assert scores[second + (6,)] == 0.7


def test_chain_estimates_learn_from_acceptance():
    stats = ChainStats()
    tokens = [4, 5, 6]
    prior = stats.chances(1, 3)
    assert prior == sorted(prior, reverse=True) and prior[0] < 0.5
    for _ in range(20):
        stats.update(1, tokens, verified_depth=3, accepted_tokens=[4, 5, 6])
    assert all(c > 0.9 for c in stats.chances(1, 3))
    for _ in range(40):
        stats.update(1, tokens, verified_depth=3, accepted_tokens=[4, 9])
    learned = stats.chances(1, 3)
    assert learned[0] > 0.9 and learned[1] < 0.5 and learned[2] <= learned[1]
    stats.update(1, tokens, verified_depth=1, accepted_tokens=[4, 5, 6])  # only depth 1 was verified
    assert stats.proposed[(1, 2)] == 60


def test_adaptive_budget_takes_a_likely_chain_and_leaves_an_unlikely_one():
    flat = CostProfile(sizes=[1, 16, 64], ms=[20.0, 21.0, 40.0])
    ids, id_rows, tree = heads_and_tree(seed=1, budget=6)
    for chance, wanted in ((0.95, True), (0.001, False)):
        grafted, chain = graft_one(tree, ids, [90, 91, 92, 93, 94, 95], [chance ** d for d in range(1, 7)])
        size, _ = best_prefix(grafted.scores, grafted.depths[1:], flat, overhead_ms=2.0)
        kept = set(grafted.paths[:size])
        assert all(p in kept for p in chain) == wanted


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 20),
       st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=4))
def test_several_chains_share_prefixes_and_every_prefix_is_a_tree(seed, budget, chains_tokens):
    """Chains that agree on their first tokens share those nodes; each spells its own tokens."""
    ids, _, tree = heads_and_tree(seed, budget)
    chains = [Chain(tokens=t, chances=[0.9 ** d for d in range(1, len(t) + 1)], source="store") for t in chains_tokens]
    table = chain_token_table(ids, chains)
    grafted, paths, chain_scores = graft_chains(tree, table, chains, first_chain_rank=6)
    check_invariants(grafted)
    for size in range(grafted.num_nodes + 1):
        check_invariants(CandidateTree(paths=grafted.paths[:size]))
    tokens = grafted.node_tokens(99, table).tolist()
    for chain, nodes in zip(chains, paths):
        assert [tokens[grafted.node_index(p)] for p in nodes] == chain.tokens
    # no two nodes with one parent carry the same token: nothing is verified twice
    siblings = [(p[:-1], tokens[grafted.node_index(p)]) for p in grafted.paths]
    assert len(siblings) == len(set(siblings))
    assert set(chain_scores) == {p for nodes in paths for p in nodes}


def test_several_lookup_drafts_have_distinct_first_tokens_longest_match_first():
    #           0  1  2  3  4  5  6  7  8  9  10 11 12
    sequence = [1, 2, 3, 9, 2, 3, 8, 5, 3, 7, 4, 2, 3]
    drafts = lookup_drafts(sequence, max_tokens=2, max_chains=3)
    # "2 3" matched at 1..2 (then 9 2) and 4..5 (then 8 5): latest first; "3" alone at 8 (then 7 4)
    assert drafts == [LookupDraft([8, 5], 2), LookupDraft([9, 2], 2), LookupDraft([7, 4], 1)]
    assert lookup_drafts(sequence, max_tokens=2, max_chains=1) == drafts[:1]
    assert lookup_drafts([1, 2, 3], max_tokens=2, max_chains=3) == []


def test_lookup_chains_grow_while_copies_run_long_and_shrink_after_a_miss():
    from core.drafters.interface import DraftContext
    from core.drafters.lookup import LookupDrafter

    text = list(range(100)) * 2 + list(range(5))  # the text is copying itself
    drafter = LookupDrafter(max_tokens=4, chains=2)
    context = DraftContext(tokens=text, hidden=torch.zeros(1))
    chains = drafter.propose(context)
    assert [len(c.tokens) for c in chains] == [4] and chains[0].tokens == [5, 6, 7, 8]
    drafter.observe(chains, [4], [5, 6, 7, 8])  # all of it was verified and accepted
    assert len(drafter.propose(context)[0].tokens) == 8
    drafter.observe(drafter.propose(context), [8], list(range(5, 13)))
    assert len(drafter.propose(context)[0].tokens) == 16  # capped at 4x the base length
    drafter.observe(drafter.propose(context), [16], list(range(5, 21)))
    assert len(drafter.propose(context)[0].tokens) == 16
    drafter.observe(drafter.propose(context), [16], [5, 99])  # rejected early: back to the base
    assert len(drafter.propose(context)[0].tokens) == 4


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 30), st.lists(st.integers(0, 40), min_size=1, max_size=12),
       st.sets(st.integers(0, 40), max_size=4), st.integers(0, 40), st.integers(1, 14))
def test_stop_after_and_keep_cut_what_their_definitions_say(seed, budget, chain_tokens, stops, size, depth):
    """`stop_after` drops exactly the nodes below a stop token (the node itself stays), `keep` the
    first `size` nodes no deeper than `depth`: checked against the definitions on grafted trees."""
    from core.tree_policy import build_draft_tree

    ids, _, tree = heads_and_tree(seed, budget)
    proposal = HeadProposal(probs=torch.ones(4, 6) / 6, token_ids=ids)
    chain = Chain(tokens=chain_tokens, chances=ChainStats().chances(2, len(chain_tokens)), source="lookup")
    draft = build_draft_tree(proposal, [chain], budget, top_m=6, depth=4)
    tokens = dict(zip(draft.tree.paths, draft.tree.node_tokens(99, draft.token_table).tolist()[1:]))
    stopped = draft.stop_after(99, frozenset(stops))
    ends = {path for path, token in tokens.items() if token in stops}
    assert stopped.tree.paths == [p for p in draft.tree.paths if not any(p[:d] in ends for d in range(1, len(p)))]
    check_invariants(stopped.tree)
    kept = draft.keep(size=size, max_depth=depth)
    assert kept.tree.paths == [p for p in draft.tree.paths[:size] if len(p) <= depth]
    assert kept.chain_paths == [[p for p in paths if p in kept.tree] for paths in draft.chain_paths]
    check_invariants(kept.tree)
