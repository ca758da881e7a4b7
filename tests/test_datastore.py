"""The datastore drafter: suffix-array search, continuation counts, and exact decoding with it."""
from __future__ import annotations

import pytest

import random

from core.drafters.datastore import SEPARATOR, StoreDrafter, TokenStore
from core.decoder import DecodeConfig, decode
from core.drafters.interface import DraftContext
from tests.tiny import greedy_reference, tiny_base, tiny_heads


def brute_force_match(sequences: list[list[int]], context: list[int], max_match: int) -> tuple[int, int]:
    """(longest suffix length of `context` found inside one sequence, its number of occurrences)."""
    for length in range(min(max_match, len(context)), 0, -1):
        key = context[-length:]
        count = sum(1 for seq in sequences for i in range(len(seq) - length + 1) if seq[i:i + length] == key)
        if count:
            return length, count
    return 0, 0


def test_search_finds_the_longest_suffix_and_every_occurrence():
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    store = TokenStore(sequences)
    assert len(store) == sum(len(s) for s in sequences)
    for _ in range(200):
        context = [rng.randrange(7) for _ in range(rng.randrange(1, 9))]
        length, positions = store.search(context, max_match=6)
        assert (length, len(positions)) == brute_force_match(sequences, context, 6)
        for start in positions:  # each occurrence really spells the suffix, inside one answer
            assert store.tokens[start:start + length].tolist() == context[-length:]


def test_continuations_are_counted_and_stop_at_answer_ends():
    store = TokenStore([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 4, 5, 7], [8, 2, 3, 4]])
    length, branches = store.continuations([0, 2, 3, 4], depth=3, branches=3)
    assert length == 3  # "2 3 4" occurs four times; one answer ends right after it
    # followers: [5] | [6] | [5, 7] | [] (an answer ends): one branch per first token, the longest
    # of the equally frequent ones; frequency at depth d = share of the 4 occurrences agreeing so far
    assert branches == [([5, 7], [0.5, 0.25]), ([6], [0.25])]
    assert all(SEPARATOR not in tokens for tokens, _ in branches)


def test_drafter_chains_are_non_increasing_and_learn():
    store = TokenStore([[0, 1, 2, 3, 4, 5, 6]] * 5)
    drafter = StoreDrafter(store, max_tokens=4)
    assert drafter.propose(DraftContext(tokens=[7, 1, 2], hidden=None)) is None  # a 2-token match is too weak
    chains = drafter.propose(DraftContext(tokens=[7, 0, 1, 2], hidden=None))
    assert chains[0].tokens == [3, 4, 5, 6]
    assert chains[0].chances == sorted(chains[0].chances, reverse=True)
    before = chains[0].chances[0]
    for _ in range(10):
        drafter.observe(chains, [4], [3, 4, 5, 6])
    assert drafter.propose(DraftContext(tokens=[7, 0, 1, 2], hidden=None))[0].chances[0] > before


def test_decoding_with_the_store_is_exact_and_accepts_its_branches():
    """A store of the model's own answers: its branches are accepted, the text is plain greedy's."""
    base = tiny_base("llama", max_positions=256)
    heads = tiny_heads(base)
    prompts = [[(7 * i + j) % 256 for j in range(12)] for i in range(6)]
    answers = [greedy_reference(base, p, 40) for p in prompts]
    store = TokenStore(answers[1:])
    config = DecodeConfig(spec="dynamic:6+store", max_new_tokens=40)
    for prompt, answer in zip(prompts, answers):
        session = decode(base, heads, prompt, config, store=store)
        assert session.output_ids == answer
    stored = decode(base, heads, prompts[2], config, store=store)
    from_store = sum(1 for r in stored.records for n in r.outcome.accepted_nodes[1:]
                     if r.outcome.node_source(n) == "store")
    assert from_store >= 10 and stored.tokens_per_step > 2


def test_forks_share_the_read_only_store():
    import copy

    store = TokenStore([[1, 2, 3, 4]])
    drafter = StoreDrafter(store, max_tokens=2)
    twin = copy.deepcopy(drafter)
    assert twin.store is store and twin.stats is not drafter.stats


def test_many_occurrences_are_sampled_fairly():
    """300 occurrences of one context: 200 continue with token 7, 100 with token 9 (which sorts
    after 7). A sample taken from one end of the sorted suffixes would see only 9s; the store
    must rank 7 first with about its true share."""
    from core.drafters.datastore import MAX_OCCURRENCES, TokenStore
    sequences = [[1, 2, 3, 7, 7] for _ in range(200)] + [[1, 2, 3, 9, 9] for _ in range(100)]
    store = TokenStore(sequences)
    length, positions = store.search([5, 1, 2, 3])
    assert length == 3 and len(positions) == 300 > MAX_OCCURRENCES
    _, branches = store.continuations([5, 1, 2, 3], depth=2, branches=2)
    (first, first_share), (second, second_share) = branches
    assert first == [7, 7] and second == [9, 9]
    assert first_share[0] == pytest.approx(2 / 3, abs=0.02) and second_share[0] == pytest.approx(1 / 3, abs=0.02)
