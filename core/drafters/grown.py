"""Trees a drafter grows node by node (Hydra's heads, the EAGLE draft layer): the shared result type
and the best-first cut.

A grower expands, depth by depth, the best nodes so far by joint score (the product of its
conditional probabilities along the path), then keeps the `budget` best nodes of everything grown.
The cut is prefix-closed because a child never scores above its parent; ties go to the shallower
node. Columns of the token table are renumbered per depth (best first), so the tree is an ordinary
`CandidateTree`: grafting, verification, acceptance and the KV commit are the ones every tree uses.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from core.tree import CandidateTree, RankPath


@dataclass(frozen=True)
class GrownTree:
    """A tree a path-aware drafter grew node by node, in best-first order.

    `token_table[d-1, c]` is the token of the node at depth d whose path ends in column c;
    `probs`/`token_ids` are the drafter's conditional top-m along its greedy path (row d: what it
    guessed at depth d after the top guesses of the rows above; for the heads table)."""

    tree: CandidateTree  # scores: joint probability (product of conditionals along the path)
    token_table: torch.Tensor  # [D, columns] long
    probs: torch.Tensor  # [D, m]
    token_ids: torch.Tensor  # [D, m]

    def candidate_tree(self, budget: int, top_m: int, depth: int, fixed: CandidateTree | None = None
                       ) -> tuple[CandidateTree, torch.Tensor]:
        """The step's tree and its token table: the tree as grown (to the drafter's budget already)."""
        return self.tree, self.token_table


@dataclass
class GrownNode:
    """A node while growing: its creation path (unique, prefix-structured), tokens and joint score."""

    path: tuple[int, ...]  # creation columns, root excluded
    tokens: tuple[int, ...]  # tokens from depth 1 down to this node
    score: float


@dataclass
class Growth:
    """Nodes grown so far and the drafter's greedy row per depth (the heads table's rows)."""

    nodes: list[GrownNode]
    greedy_probs: list[torch.Tensor]  # per depth [m]
    greedy_ids: list[torch.Tensor]  # per depth [m]

    def best(self, budget: int, kind: str) -> GrownTree:
        """The `budget` best nodes as a tree (`core.drafters.grown.best_first`)."""
        shown = min(len(row) for row in self.greedy_ids)
        return best_first(self.nodes, budget, torch.stack([r[:shown] for r in self.greedy_probs]),
                          torch.stack([r[:shown] for r in self.greedy_ids]), kind=kind)


def deeper_could_enter(frontier: list[GrownNode], grown: list[GrownNode], budget: int) -> bool:
    """Whether a child of a `frontier` node could be among the `budget` best of `grown` and below.
    A child scores at most its parent and loses ties to the shallower nodes, so once `budget` grown
    nodes score at least as much as every frontier node, growing deeper cannot change the cut:
    the grower stops there (exactly the same tree, fewer draft calls)."""
    if len(grown) < budget:
        return True
    kth = heapq.nlargest(budget, (node.score for node in grown))[-1]
    return any(node.score > kth for node in frontier)


def expand(parents: list[GrownNode], probs: list[list[float]], ids: list[list[int]],
           budget: int | None = None) -> list[GrownNode]:
    """The children of `parents`: row r of `probs` / `ids` holds parent r's ranked guesses (best
    first), each child scored by its parent's joint score times its own probability. With `budget`,
    a parent's first `budget` children only: a child ranked lower has `budget` siblings scoring at
    least as much, so it can enter neither the best-`budget` cut nor a frontier."""
    return [GrownNode(path=node.path + (c,), tokens=node.tokens + (t,), score=node.score * p)
            for node, row_probs, row_ids in zip(parents, probs, ids)
            for c, (p, t) in enumerate(zip(row_probs[:budget], row_ids[:budget]))]


def grow_parallel(nodes: list[GrownNode], head_probs: torch.Tensor, head_ids: torch.Tensor, *, first_depth: int,
                  beam: int, children: int) -> list[GrownNode]:
    """Gumiho's later depths: from `first_depth` on, the `beam` best nodes of the depth above each get
    parallel head d's top `children` guesses (`head_probs` / `head_ids` [D, m]: head d at row d-1,
    read from the root's hidden state alone, so every parent gets the same guesses), scored by the
    parent's joint score times the head's probability. Returns `nodes` and the new ones."""
    grown = list(nodes)
    for depth in range(first_depth, head_probs.shape[0] + 1):
        above = [n for n in grown if len(n.path) == depth - 1]
        frontier = sorted(above, key=lambda n: -n.score)[:beam]
        row_probs, row_ids = head_probs[depth - 1, :children].tolist(), head_ids[depth - 1, :children].tolist()
        grown += expand(frontier, [row_probs] * len(frontier), [row_ids] * len(frontier))
    return grown


def best_first(grown: list[GrownNode], budget: int, greedy_probs: torch.Tensor, greedy_ids: torch.Tensor,
               kind: str) -> GrownTree:
    """The `budget` best grown nodes (parents first on ties), columns renumbered per depth."""
    kept = sorted(grown, key=lambda n: (-n.score, len(n.path)))[:budget]
    columns: dict[tuple[int, ...], RankPath] = {(): ()}
    used_per_depth: dict[int, int] = {}
    rows: dict[int, list[int]] = {}
    # parents before children: renumber in order of depth, then score, so columns read best first
    for node in sorted(kept, key=lambda n: (len(n.path), -n.score)):
        depth = len(node.path)
        column = used_per_depth.get(depth, 0)
        used_per_depth[depth] = column + 1
        columns[node.path] = columns[node.path[:-1]] + (column,)
        rows.setdefault(depth, []).append(node.tokens[-1])
    depth_count = max(rows, default=0)
    table = torch.zeros(depth_count, max((len(r) for r in rows.values()), default=0), dtype=torch.long)  # [D, cols]
    for depth, tokens in rows.items():
        table[depth - 1, : len(tokens)] = torch.tensor(tokens)
    tree = CandidateTree(paths=[columns[n.path] for n in kept], scores=[n.score for n in kept], kind=kind)
    return GrownTree(tree=tree, token_table=table, probs=greedy_probs, token_ids=greedy_ids)


def accepted_depth(grown: GrownTree, answer: list[int], start: int) -> int:
    """How many of answer[start+1:] the grown tree's nodes match, following one path from the root
    (greedy acceptance when `answer` is the base model's own greedy text)."""
    table = grown.token_table.tolist()
    child = {(path[:-1], table[len(path) - 1][path[-1]]): path for path in grown.tree.paths}
    path: tuple[int, ...] = ()
    depth = 0
    while start + depth + 1 < len(answer):
        found = child.get((path, answer[start + depth + 1]))
        if found is None:
            break
        path, depth = found, depth + 1
    return depth


def cut_grown(grown: GrownTree, budget: int) -> GrownTree:
    """The first `budget` nodes of a grown tree (its best-first order keeps every prefix a tree)."""
    tree = CandidateTree(paths=grown.tree.paths[:budget], scores=grown.tree.scores[:budget], kind=grown.tree.kind)
    return GrownTree(tree=tree, token_table=grown.token_table, probs=grown.probs, token_ids=grown.token_ids)
