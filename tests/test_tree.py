"""Tree invariants, the dynamic builder against brute force, and Medusa's buffers for its trees."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.tree import CandidateTree, chain_tree, dynamic_tree, fixed_tree, load_named_trees, named_tree
from tests.medusa_reference import medusa_buffers


def check_invariants(tree: CandidateTree) -> None:
    """Every property a verifier relies on."""
    paths = tree.paths
    seen = set()
    for path in paths:
        assert len(path) == 1 or path[:-1] in seen, f"{path} before its parent"
        seen.add(path)
    assert len(seen) == len(paths)
    buffers = tree.buffers()
    n = tree.num_nodes
    index = {path: i + 1 for i, path in enumerate(paths)}

    def ancestors(node: int) -> list[int]:  # from the paths alone, independent of the tree's own helpers
        path = paths[node - 1] if node else ()
        return [0] + [index[path[:j]] for j in range(1, len(path) + 1)]

    assert buffers.attn_mask.shape == (n + 1, n + 1) and buffers.attn_mask.dtype == torch.bool
    assert buffers.position_ids.tolist() == [0] + [len(p) for p in paths]
    for node in range(n + 1):
        chain = set(ancestors(node))
        assert set(torch.nonzero(buffers.attn_mask[node]).flatten().tolist()) == chain
        assert len(chain) == buffers.position_ids[node] + 1
    has_child = {index[p[:-1]] if len(p) > 1 else 0 for p in paths}
    leaves = [i for i in range(n + 1) if i not in has_child]
    rows = buffers.retrieve_indices
    assert rows.shape[0] == len(leaves)
    assert sorted(int(r[r >= 0][-1]) for r in rows) == leaves
    for row in rows:
        nodes = row[row >= 0].tolist()
        assert (row[len(nodes):] == -1).all()
        assert nodes == ancestors(nodes[-1])  # a root-to-leaf path


head_probs_strategy = st.integers(1, 5).flatmap(
    lambda k: st.integers(1, 8).flatmap(
        lambda m: st.lists(st.lists(st.floats(0.0, 1.0), min_size=m, max_size=m), min_size=k, max_size=k)))


@settings(max_examples=200, deadline=None)
@given(head_probs_strategy, st.integers(0, 80), st.booleans())
def test_dynamic_tree_invariants(rows, budget, quantise):
    probs = torch.tensor(rows).sort(dim=1, descending=True).values + 1e-3
    if quantise:  # many exact ties
        probs = (probs * 4).round() / 4 + 0.25
        probs = probs.sort(dim=1, descending=True).values
    tree = dynamic_tree(probs, budget)
    assert tree.num_nodes == min(budget, sum(probs.shape[1] ** d for d in range(1, probs.shape[0] + 1)))
    check_invariants(tree)
    assert all(a >= b - 1e-12 for a, b in zip(tree.scores, tree.scores[1:])), "scores must not increase"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), min_size=1, max_size=30))
def test_fixed_tree_invariants(raw):
    closed = {tuple(p[:i]) for p in raw for i in range(1, len(p) + 1)}  # make it prefix-closed
    tree = fixed_tree([list(p) for p in closed])
    assert tree.num_nodes == len(closed)
    check_invariants(tree)


def brute_force_top(probs: torch.Tensor, budget: int) -> list[tuple[float, tuple[int, ...]]]:
    k, m = probs.shape
    normed = probs / probs.sum(dim=1, keepdim=True)
    scored = []
    for depth in range(1, k + 1):
        for path in itertools.product(range(m), repeat=depth):
            score = 1.0
            for d, r in enumerate(path):
                score *= float(normed[d, r])
            scored.append((score, path))
    scored.sort(key=lambda x: -x[0])
    return scored[:budget]


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_equals_brute_force(seed):
    generator = torch.Generator().manual_seed(seed)
    k, m = 3 + seed % 2, 4 + seed % 3
    probs = torch.rand(k, m, generator=generator).sort(dim=1, descending=True).values  # distinct: no ties
    budget = 5 + 7 * (seed % 6)
    tree = dynamic_tree(probs, budget)
    expected = brute_force_top(probs, budget)
    assert set(tree.paths) == {p for _, p in expected}
    assert tree.scores == pytest.approx([s for s, _ in expected], rel=1e-5)


def test_dynamic_never_materialises_the_product(monkeypatch):
    """m=32, K=4 has 1.08M paths; the search touches O(budget) of them."""
    probs = torch.softmax(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)), dim=1)
    probs = probs.sort(dim=1, descending=True).values
    import core.tree as tree_module
    pushes = []
    real_push = tree_module.heapq.heappush
    monkeypatch.setattr(tree_module.heapq, "heappush", lambda heap, item: (pushes.append(1), real_push(heap, item)))
    tree = dynamic_tree(probs, 63)
    assert tree.num_nodes == 63 and len(pushes) <= 2 * 63


def test_shipped_mc_sim_7b_63_matches_medusa_buffers():
    choices = load_named_trees()["mc_sim_7b_63"]
    tree = named_tree("mc_sim_7b_63")
    assert tree.num_nodes == 63
    assert len(tree.leaves) == 42
    per_depth = [sum(1 for p in tree.paths if len(p) == d) for d in range(1, 5)]
    assert per_depth == [10, 28, 23, 2]
    reference = medusa_buffers(choices)
    buffers = tree.buffers()
    assert torch.equal(buffers.attn_mask, reference["attn_mask"])
    assert torch.equal(buffers.position_ids, reference["position_ids"])
    assert {tuple(r) for r in buffers.retrieve_indices.tolist()} == {tuple(r) for r in reference["retrieve_indices"].tolist()}
    check_invariants(tree)


@pytest.mark.parametrize("name", sorted(load_named_trees()))
def test_every_shipped_tree_matches_medusa_buffers(name):
    choices = load_named_trees()[name]
    buffers = fixed_tree(choices).buffers()
    reference = medusa_buffers(choices)
    assert torch.equal(buffers.attn_mask, reference["attn_mask"])
    assert torch.equal(buffers.position_ids, reference["position_ids"])
    assert sorted(buffers.retrieve_indices.tolist()) == sorted(reference["retrieve_indices"].tolist())


@pytest.mark.parametrize("bad, message", [
    ("[[0]]", "list of rank paths"),
    ([[0], [-1]], "non-negative"),
    ([[0], [1, 0]], "no parent"),
    ([[0], []], "non-empty"),
    ([[0], [0.5]], "integers"),
])
def test_malformed_fixed_trees_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        fixed_tree(bad)


def test_node_tokens_and_chain():
    tree = chain_tree(3)
    head_ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    assert tree.node_tokens(5, head_ids).tolist() == [5, 10, 20, 30]
    tree = fixed_tree([[1], [0], [1, 1]])
    assert tree.paths == [(0,), (1,), (1, 1)]
    assert tree.node_tokens(5, head_ids).tolist() == [5, 10, 11, 21]
    assert tree.leaves == [1, 3]
