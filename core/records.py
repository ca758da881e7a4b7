"""Step records: what one decoding step did, for the UI, the benchmark and JSON traces.

Their own module so that viz/ and the benchmark depend on records, not on the decoder.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from core.families import grows_tree
from core.tree import CandidateTree


@dataclass(frozen=True)
class PhaseTimes:
    """Wall seconds per phase of one step."""

    heads: float = 0.0
    tree: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    commit: float = 0.0
    compare: float = 0.0  # the side-by-side fixed tree (UI only)
    texts: float = 0.0  # decoding node texts for the page (grows with the tree; 0 in benchmarks)

    @property
    def total(self) -> float:
        """The decoding step's own time (what the benchmark and the speed card compare)."""
        return self.heads + self.tree + self.verify + self.accept + self.commit

    @property
    def charged(self) -> float:
        """What the step cost the run that made it: decoding plus its node texts (the budget
        controller prices trees by this, so a page that names every node does not get trees
        that only pay without the names)."""
        return self.total + self.texts


@dataclass(frozen=True)
class TreeOutcome:
    """One verified tree: its nodes, what the base model accepted, and the bonus token."""

    tree: CandidateTree
    node_tokens: list[int]  # [n+1], root first
    node_scores: list[float]  # [n+1] joint head probability, root 1.0
    accepted_nodes: list[int]  # root first
    bonus_token: int
    node_texts: list[str] = field(default_factory=list)
    bonus_text: str = ""
    lookup_rank: int | None = None  # first rank of the chains' columns (chain j on lookup_rank + j), if any
    chain_sources: tuple[str, ...] = ()  # drafter of each chain column: "lookup", "store"
    head_scores: list[float | None] = field(default_factory=list)  # [n+1] the heads' own score; None: chain-only node
    base_top_tokens: list[int] = field(default_factory=list)  # [n+1] base argmax after each node; -1: not projected

    @property
    def accepted_length(self) -> int:
        """Tokens this tree yields: accepted head tokens + the bonus token."""
        return len(self.accepted_nodes)

    @property
    def accepted_tokens(self) -> list[int]:
        """The accepted tokens below the root, bonus excluded."""
        return [self.node_tokens[node] for node in self.accepted_nodes[1:]]

    @property
    def lookup_nodes(self) -> frozenset[int]:
        """Nodes that only a chain (prompt lookup, datastore) proposed (on a reserved rank)."""
        if self.lookup_rank is None:
            return frozenset()
        return frozenset(i for i, path in enumerate(self.tree.paths, start=1) if path[-1] >= self.lookup_rank)

    @property
    def grown(self) -> bool:
        """True for a tree a drafter grew node by node (Hydra, EAGLE): a node's column is not a rank,
        its children are its own."""
        return grows_tree(self.tree.kind)

    def sibling_ranks(self) -> list[int]:
        """[n+1] each node's rank among its siblings by score (0 best; the root 0). For the heads'
        trees this is the head's rank; for a grown tree it is computed from the scores."""
        if not self.grown:
            return [0] + [path[-1] for path in self.tree.paths]
        parents, scores, copied = self.tree.parents, self.node_scores, self.lookup_nodes
        ranks = [0] * (self.tree.num_nodes + 1)
        by_parent: dict[int, list[int]] = {}
        for node in range(1, self.tree.num_nodes + 1):
            if node not in copied:  # chain nodes are not the heads' guesses: not ranked among them
                by_parent.setdefault(parents[node], []).append(node)
        for children in by_parent.values():
            for rank, node in enumerate(sorted(children, key=lambda n: -scores[n])):
                ranks[node] = rank
        return ranks

    def token_paths(self) -> list[tuple[int, ...]]:
        """[n+1] each node's tokens from below the root down to itself (the root: ())."""
        paths: list[tuple[int, ...]] = [()]
        for node, parent in enumerate(self.tree.parents[1:], start=1):
            paths.append(paths[parent] + (self.node_tokens[node],))
        return paths

    def unverified_in(self, proposal: "TreeOutcome") -> frozenset[int]:
        """The nodes of `proposal` (a larger tree of the same step) that this verified tree lacks."""
        verified = set(self.token_paths())
        return frozenset(i for i, path in enumerate(proposal.token_paths()) if path not in verified)

    def node_source(self, node: int) -> str:
        """Who proposed `node`: "root", "heads" (head k = its depth), or a chain's drafter name."""
        if node == 0:
            return "root"
        rank = self.tree.paths[node - 1][-1]
        if self.lookup_rank is not None and rank >= self.lookup_rank:
            column = rank - self.lookup_rank
            return self.chain_sources[column] if column < len(self.chain_sources) else "lookup"
        return "heads"


class StepKind(StrEnum):
    """What a step verified (a str: traces write its value)."""

    TREE = "tree"  # the drafters' tree (with the run's chains, if it has any)
    PLAIN = "plain"  # the root alone: the base model's one token (plain decoding, or a step with no guess)
    CHAINS = "chains"  # the chains alone (prompt lookup, the datastore): the auto budget skipped the heads


@dataclass(frozen=True)
class StepRecord:
    """Everything one step did, for the UI, the benchmark and JSON traces."""

    index: int
    family: str  # the run's family (core.families): autoregressive | fixed | dynamic | hydra | eagle | ...
    kind: StepKind  # what this step verified: the drafters' tree, the root alone or the chains alone
    context_length: int  # tokens in the KV cache before the step
    head_token_ids: list[list[int]]  # [K][m] each head's top-m tokens
    head_probs: list[list[float]]  # [K][m] their (softmax) probabilities
    outcome: TreeOutcome
    new_tokens: list[int]  # emitted by this step (accepted head tokens + bonus, cut at EOS / limit)
    times: PhaseTimes
    comparison: TreeOutcome | None = None  # the fixed tree on the same head outputs and context
    head_texts: list[list[str]] = field(default_factory=list)
    top_logits: tuple[float, float] | None = None  # plain steps: the base model's top-1 and top-2 logits
    controller: str = ""  # dynamic:auto's state when it chose this step (core.budget.controller.AutoBudget.state)
    rival: TreeOutcome | None = None  # the other heads family's tree (Hydra <-> Medusa) on the same context
    # the page's: the whole tree the drafters proposed when the step verified only a part of it (the
    # budget cut it, or the controller skipped the heads); its nodes beyond `outcome.tree` were never verified
    proposal: TreeOutcome | None = None

    @property
    def top2_gap(self) -> float | None:
        """Plain steps: how far the chosen token's logit led the runner-up (a near-tie check)."""
        return None if self.top_logits is None else self.top_logits[0] - self.top_logits[1]
