"""Tree policies: drafters' candidates in, one `CandidateTree` (and its token table) out.

The heads' candidates become the dynamic tree (top-n joint scores) or fill a fixed tree;
each chain (prompt lookup, datastore) joins as a branch on its own reserved rank column
after the heads' top-m: the chain follows the tree's existing nodes while their tokens agree
(so no token is verified twice), then continues on its column. Pure: tensors and lists in,
`DraftTree` out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.drafters.interface import Chain, Proposal
from core.tree import CandidateTree, RankPath


@dataclass(frozen=True)
class DraftTree:
    """A step's tree with what the verifier and the adaptive budget need to know about it."""

    tree: CandidateTree  # scores: max(head score, chain estimate) per node, non-increasing with depth
    token_table: torch.Tensor  # [rows, ranks]: token of each (depth, rank); chain j on column first_chain_rank + j
    head_scores: dict[RankPath, float] = field(default_factory=dict)  # nodes the heads proposed: their own joint score
    chain_scores: dict[RankPath, float] = field(default_factory=dict)  # nodes on a chain: its estimate
    chain_paths: list[list[RankPath]] = field(default_factory=list)  # per chain: its node paths, depth 1 first
    chains: list[Chain] = field(default_factory=list)
    first_chain_rank: int = 0

    def keep(self, size: int | None = None, max_depth: int | None = None) -> "DraftTree":
        """The first `size` nodes of the best-first order, none deeper than `max_depth`.

        Any such selection of a prefix-closed, parents-first order is itself a tree."""
        paths = self.tree.paths[:size] if size is not None else self.tree.paths
        if max_depth is not None and self.tree.max_depth > max_depth:
            paths = [p for p in paths if len(p) <= max_depth]
        if len(paths) == self.tree.num_nodes:  # nothing cut
            return self
        return self._restricted(set(paths))

    def stop_after(self, root_token: int, stop_tokens: frozenset[int]) -> "DraftTree":
        """The tree without the descendants of any node whose token ends the text (EOS): a path
        stops there, as decoding does, so nothing after it is verified or accepted."""
        if not stop_tokens or self.tree.num_nodes == 0:
            return self
        tokens = self.tree.node_tokens(root_token, self.token_table).tolist()  # [n+1]
        if not stop_tokens.intersection(tokens[1:]):
            return self
        parents = self.tree.parents
        cut = [False] * len(tokens)  # node i is dropped: its parent ends the text or was dropped (parents first)
        for node in range(1, len(tokens)):
            parent = parents[node]
            cut[node] = parent > 0 and (cut[parent] or tokens[parent] in stop_tokens)
        return self._restricted({p for p, dropped in zip(self.tree.paths, cut[1:]) if not dropped})

    def _restricted(self, kept: set[RankPath]) -> "DraftTree":
        """This tree on the prefix-closed subset `kept` of its paths, order and scores kept."""
        paths = [p for p in self.tree.paths if p in kept]
        scores = self.tree.scores
        tree = CandidateTree(paths=paths, kind=self.tree.kind,
                             scores=[s for p, s in zip(self.tree.paths, scores) if p in kept] if scores else None)
        return DraftTree(tree=tree, token_table=self.token_table,
                         head_scores={p: s for p, s in self.head_scores.items() if p in kept},
                         chain_scores={p: s for p, s in self.chain_scores.items() if p in kept},
                         chain_paths=[[p for p in chain if p in kept] for chain in self.chain_paths],
                         chains=self.chains, first_chain_rank=self.first_chain_rank)

    def node_head_scores(self) -> list[float | None]:
        """[n+1] the heads' own score of each node, root 1.0; None where only a chain proposed it."""
        return [1.0] + [self.head_scores.get(path) for path in self.tree.paths]

    def node_scores(self) -> list[float]:
        """[n+1] each node's score as the tree view colours it, root 1.0: the builder's joint
        probability, else the heads' own (0 where only a chain proposed a node)."""
        scores = self.tree.scores if self.tree.scores is not None else [s or 0.0 for s in self.node_head_scores()[1:]]
        return [1.0] + list(scores)

    @property
    def verified_chain_depths(self) -> list[int]:
        """How deep each chain reaches in the (kept) tree."""
        return [len(paths) for paths in self.chain_paths]


def chain_token_table(head_ids: torch.Tensor, chains: list[Chain]) -> torch.Tensor:
    """The heads' [D, m] token table plus one column per chain: [max(D, longest chain), m + chains]."""
    depth, width = head_ids.shape
    rows = max([depth] + [len(c.tokens) for c in chains])
    table = torch.zeros(rows, width + len(chains), dtype=torch.long)  # [rows, m + chains]
    table[:depth, :width] = head_ids.cpu()
    for j, chain in enumerate(chains):
        table[: len(chain.tokens), width + j] = torch.tensor(chain.tokens, dtype=torch.long)
    return table


def graft_chains(tree: CandidateTree, token_table: torch.Tensor, chains: list[Chain],
                 first_chain_rank: int) -> tuple[CandidateTree, list[list[RankPath]], dict[RankPath, float]]:
    """`tree` with every chain added as a branch; returns the tree (sorted by score, depth
    breaking ties, so parents come first and every prefix is a tree), each chain's node paths
    and each chain node's estimate. A node shared by several sources scores their maximum."""
    table = token_table.tolist()
    scores = dict(zip(tree.paths, tree.scores or [0.0] * tree.num_nodes))
    child = {(p[:-1], table[len(p) - 1][p[-1]]): p for p in tree.paths}  # (parent, token) -> node
    chain_paths: list[list[RankPath]] = []
    chain_scores: dict[RankPath, float] = {}
    for j, chain in enumerate(chains):
        path: RankPath = ()
        nodes: list[RankPath] = []
        for token, chance in zip(chain.tokens, chain.chances):
            found = child.get((path, token))
            path = found if found is not None else path + (first_chain_rank + j,)
            child[(path[:-1], token)] = path
            scores[path] = max(scores.get(path, 0.0), chance)
            chain_scores[path] = max(chain_scores.get(path, 0.0), chance)
            nodes.append(path)
        chain_paths.append(nodes)
    order = sorted(scores, key=lambda p: (-scores[p], len(p)))
    return CandidateTree(paths=order, scores=[scores[p] for p in order], kind=tree.kind), chain_paths, chain_scores


def build_draft_tree(heads: Proposal | None, chains: list[Chain], budget: int, top_m: int,
                     depth: int, fixed: CandidateTree | None = None) -> DraftTree:
    """The step's tree: the heads' own (`Proposal.candidate_tree`: the fixed tree over their guesses,
    the dynamic tree of their top-m marginals, or the tree they grew), with every chain grafted on."""
    if heads is None:
        return _with_chains(CandidateTree(paths=[], scores=[], kind="dynamic"),
                            torch.zeros(0, top_m, dtype=torch.long), chains)  # [0, m]: chains alone
    tree, table = heads.candidate_tree(budget, top_m, depth, fixed)
    return _with_chains(tree, table, chains)


def _with_chains(tree: CandidateTree, head_ids: torch.Tensor, chains: list[Chain]) -> DraftTree:
    """A heads' tree (token table [D, columns]) with every chain grafted on its own column."""
    head_scores = dict(zip(tree.paths, tree.scores or []))
    if not chains:
        return DraftTree(tree=tree, token_table=head_ids, head_scores=head_scores)
    width = head_ids.shape[1]
    table = chain_token_table(head_ids, chains)  # [rows, m + chains]
    grafted, chain_paths, chain_scores = graft_chains(tree, table, chains, first_chain_rank=width)
    return DraftTree(tree=grafted, token_table=table, head_scores=head_scores, chain_scores=chain_scores,
                     chain_paths=chain_paths, chains=chains, first_chain_rank=width)
