"""Candidate trees: Medusa's fixed trees and the dynamic tree, one output type.

A tree is a list of rank paths (root excluded). Path (r1, ..., rd) is the node whose token
is head 1's rank-r1 token followed by ... head d's rank-rd token; the root (index 0) is the
base model's own next token. Both builders are pure: tensors/lists in, `CandidateTree` out.
"""
from __future__ import annotations

import heapq
import itertools
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # torch is imported where tensors are made: a recorded tree is drawn without it (replay)
    import torch

TREES_FILE = Path(__file__).resolve().parent.parent / "assets" / "trees.json"

RankPath = tuple[int, ...]


@dataclass(frozen=True)
class TreeBuffers:
    """What the verifier needs for one tree of n non-root nodes."""

    attn_mask: torch.Tensor  # bool [n+1, n+1]: row i true on i and its ancestors
    position_ids: torch.Tensor  # long [n+1]: depth, root 0
    retrieve_indices: torch.Tensor  # long [leaves, max_depth+1]: root-to-leaf node indices, -1 padded


@dataclass(frozen=True)
class CandidateTree:
    """A prefix-closed set of rank paths, parents before children.

    `scores` (optional) are the joint probabilities the builder ranked the paths by.
    """

    paths: list[RankPath]
    scores: list[float] | None = None
    kind: str = "fixed"
    _index: dict[RankPath, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[RankPath, int] = {}
        for i, path in enumerate(self.paths):
            # only the last rank needs checking: the parent, already indexed, checked the others
            # (a chain of d nodes costs O(d), not O(d^2): lookup chains run 10-40 deep)
            last = path[-1] if path else None
            if not isinstance(path, tuple) or not isinstance(last, int) or isinstance(last, bool) or last < 0:
                raise ValueError(f"path {path!r}: ranks must be non-negative integers")
            if path in index:
                raise ValueError(f"path {path!r} appears twice")
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(f"path {path!r} comes before (or without) its parent {path[:-1]!r}")
            index[path] = i + 1  # node index; 0 is the root
        object.__setattr__(self, "_index", index)

    @property
    def num_nodes(self) -> int:
        """Non-root nodes."""
        return len(self.paths)

    @cached_property
    def parents(self) -> list[int]:
        """Node index of each node's parent; the root's parent is -1. Length n+1."""
        return [-1] + [self._index[p[:-1]] if len(p) > 1 else 0 for p in self.paths]

    @cached_property
    def depths(self) -> list[int]:
        """Depth of each node (root 0). Length n+1."""
        return [0] + [len(p) for p in self.paths]

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        """Largest rank used at any depth (so the heads must supply top-(max_rank+1))."""
        return max((max(p) for p in self.paths), default=0)

    @cached_property
    def leaves(self) -> list[int]:
        """Node indices without children, in node order (the root when the tree is empty)."""
        has_child = set(self.parents[1:])
        return [i for i in range(self.num_nodes + 1) if i not in has_child]

    def __contains__(self, path: object) -> bool:
        return path in self._index

    def node_index(self, path: RankPath) -> int:
        return 0 if not path else self._index[path]

    def ancestors(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, inclusive."""
        return list(self._chains[node])

    @cached_property
    def _chains(self) -> list[list[int]]:
        """Root-to-node index chains, built parents first (each chain extends its parent's)."""
        chains = [[0]]
        for node in range(1, self.num_nodes + 1):
            chains.append(chains[self.parents[node]] + [node])
        return chains

    def mask_rows(self) -> list[list[bool]]:
        """The attention mask as lists ([n+1][n+1]: row i true on i and its ancestors), without torch."""
        size = self.num_nodes + 1
        rows = [[False] * size for _ in range(size)]
        for node, chain in enumerate(self._chains):
            for ancestor in chain:
                rows[node][ancestor] = True
        return rows

    def buffers(self) -> TreeBuffers:
        """Attention mask, position ids and retrieve indices (not cached: records stay small)."""
        import numpy as np
        import torch

        # built in numpy and handed over without a copy: a verify of a few nodes spent ~0.08 ms in
        # the small torch calls this took before
        size = self.num_nodes + 1
        chains = self._chains
        lengths = [len(chain) for chain in chains]
        rows = np.repeat(np.arange(size), lengths)  # [sum of depths + 1]: each node once per ancestor
        cols = np.fromiter(itertools.chain.from_iterable(chains), dtype=np.int64, count=len(rows))
        mask = np.zeros((size, size), dtype=np.bool_)  # [n+1, n+1]
        mask[rows, cols] = True
        leaf_chains = [chains[leaf] for leaf in self.leaves]
        width = max(len(c) for c in leaf_chains)
        retrieve = np.array([c + [-1] * (width - len(c)) for c in leaf_chains], dtype=np.int64)  # [leaves, D+1]
        return TreeBuffers(
            attn_mask=torch.from_numpy(mask),
            position_ids=torch.tensor(self.depths, dtype=torch.long),  # [n+1]
            retrieve_indices=torch.from_numpy(retrieve),
        )

    def node_tokens(self, root_token: int, head_token_ids: torch.Tensor) -> torch.Tensor:
        """Token of every node: root first, then head d's rank-r token for path (..., r).

        head_token_ids: long [K, m], each head's top-m token ids, best first.
        """
        import torch

        if self.num_nodes == 0:
            return torch.tensor([root_token], dtype=torch.long, device=head_token_ids.device)
        if head_token_ids.device.type == "cpu":  # a few list reads: ~5x faster than indexing tensors for small trees
            table = head_token_ids.tolist()
            return torch.tensor([root_token] + [table[len(p) - 1][p[-1]] for p in self.paths], dtype=torch.long)
        heads = torch.tensor([len(p) - 1 for p in self.paths], device=head_token_ids.device)  # [n]
        ranks = torch.tensor([p[-1] for p in self.paths], device=head_token_ids.device)  # [n]
        root = torch.tensor([root_token], dtype=torch.long, device=head_token_ids.device)
        return torch.cat([root, head_token_ids[heads, ranks]])  # [n+1]

    def path_scores(self, head_probs: torch.Tensor) -> list[float]:
        """Joint probability of every non-root node: product of the heads' marginals on its path."""
        probs = head_probs.tolist()
        scores = []
        for path in self.paths:
            score = 1.0
            for depth, rank in enumerate(path):
                score *= probs[depth][rank] if rank < len(probs[depth]) else 0.0
            scores.append(score)
        return scores


def fixed_tree(choices: Sequence[Sequence[int]]) -> CandidateTree:
    """A tree from Medusa-style rank paths ("medusa choices"), ordered as Medusa orders them.

    Raises ValueError for anything that is not a prefix-closed list of non-negative rank paths.
    """
    if not isinstance(choices, (list, tuple)):
        raise ValueError("a tree must be a list of rank paths, e.g. [[0], [1], [0, 0]]")
    paths = []
    for choice in choices:
        if not isinstance(choice, (list, tuple)) or not choice:
            raise ValueError(f"each path must be a non-empty list of ranks, got {choice!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in choice):
            raise ValueError(f"ranks must be integers, got {choice!r}")
        paths.append(tuple(int(r) for r in choice))
    paths = sorted(set(paths), key=lambda p: (len(p), p))  # Medusa's order: by depth, then ranks
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"path {list(path)} has no parent {list(path[:-1])} in the tree")
    return CandidateTree(paths=paths, kind="fixed")


def dynamic_tree(head_probs: torch.Tensor, budget: int) -> CandidateTree:
    """The `budget` rank paths with the largest product of per-head marginals.

    head_probs: float [K, m], each head's top-m probabilities sorted descending (renormalised
    here over the m). Best-first search: pop the best path, push its first child and its next
    sibling; both score at most the popped path, so paths come out in descending score order,
    parents first, prefix-closed even with ties. O(budget log budget), nothing of size m^K.
    """
    if head_probs.dim() != 2:
        raise ValueError(f"head_probs must be [K, m], got shape {tuple(head_probs.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    probs = head_probs.float()
    probs = (probs / probs.sum(dim=1, keepdim=True).clamp_min(1e-30)).tolist()  # one host transfer
    depth_limit, width = len(probs), len(probs[0]) if probs else 0
    paths: list[RankPath] = []
    scores: list[float] = []
    counter = 0  # insertion order breaks score ties deterministically
    # heap entries: (-score, counter, path, score of the path's parent)
    heap: list[tuple[float, int, RankPath, float]] = []
    if width and depth_limit:
        heap.append((-probs[0][0], counter, (0,), 1.0))
    while heap and len(paths) < budget:
        negative_score, _, path, parent_score = heapq.heappop(heap)
        score = -negative_score
        paths.append(path)
        scores.append(score)
        depth = len(path)
        if depth < depth_limit:
            counter += 1
            heapq.heappush(heap, (-score * probs[depth][0], counter, path + (0,), score))
        if path[-1] + 1 < width:
            counter += 1
            sibling_score = parent_score * probs[depth - 1][path[-1] + 1]
            heapq.heappush(heap, (-sibling_score, counter, path[:-1] + (path[-1] + 1,), parent_score))
    return CandidateTree(paths=paths, scores=scores, kind="dynamic")


def chain_tree(depth: int) -> CandidateTree:
    """The top-1 chain: each head's best guess only (a useful baseline)."""
    return CandidateTree(paths=[(0,) * d for d in range(1, depth + 1)], kind="fixed")


def load_named_trees(path: Path = TREES_FILE) -> dict[str, list[list[int]]]:
    """Named fixed trees shipped in assets/trees.json (Medusa's, and ours calibrated to our heads)."""
    return json.loads(path.read_text())["trees"]


def named_tree(name: str) -> CandidateTree:
    """A shipped fixed tree by name, e.g. `mc_sim_7b_63` or `calibrated`."""
    trees = load_named_trees()
    if name not in trees:
        raise ValueError(f"unknown tree {name!r}; known: {', '.join(sorted(trees))}")
    return fixed_tree(trees[name])
