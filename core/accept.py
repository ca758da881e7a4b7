"""Acceptance rules: which root-to-node path of a verified tree to keep, and the bonus token.

- `greedy`: the longest path whose every token equals the base model's argmax after its
  parent. Lossless: the output is plain greedy decoding's, token for token.
- `typical`: Medusa's typical acceptance. A token x is accepted after node u when
  p_u(x) > min(threshold, alpha * exp(-H(p_u))); the longest accepted path wins, ties broken
  by log-likelihood. Fast, but it does NOT preserve the sampling distribution.
- `speculative`: tree speculative sampling (SpecInfer / Sequoia style recursive rejection).
  At each node the children are tried in rank order; child x is accepted with probability
  r(x) where r starts as the base distribution p_u (the proposal of a deterministic top-k
  candidate is a point mass), and on rejection r <- normalise(r with x removed). The bonus
  token is drawn from the final r. Every emitted token is distributed exactly as plain sampling.

All rules take the verified tree (logits projected on demand) and return the accepted node path (root first)
and the bonus token, which is the next step's root.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.strategy import ACCEPT_RULES
from core.sampling import SamplingConfig, argmax_rows, argmax_token, next_token, sampling_probs
from core.tree import CandidateTree
from core.verify import VerifyOutput

RULES = ACCEPT_RULES


@dataclass(frozen=True)
class AcceptConfig:
    """Rule and its parameters. At temperature 0 every rule reduces to greedy."""

    rule: str = "greedy"
    sampling: SamplingConfig = SamplingConfig()
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"acceptance rule must be one of {RULES}, got {self.rule!r}")


@dataclass(frozen=True)
class AcceptResult:
    accepted_nodes: list[int]  # node indices, root first
    bonus_token: int


def _longest_rows(tree: CandidateTree, node_ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per retrieve row (root-to-leaf path): how many leading nodes are accepted. Returns (rows, lengths)."""
    retrieve = tree.buffers().retrieve_indices.to(node_ok.device)  # [L, D+1]
    ok = node_ok[retrieve.clamp_min(0)] & (retrieve >= 0)  # [L, D+1]
    return retrieve, ok.long().cumprod(dim=1).sum(dim=1)  # [L]


def _inner_nodes(tree: CandidateTree) -> list[int]:
    """Nodes with children (the root always): the only ones whose logits judge other nodes."""
    return sorted(set(tree.parents[1:]) | {0})


# Up to this many rows, projecting all of them costs one lm_head weight read, like projecting
# the inner ones alone (the matmul is bound by reading the weight): the bonus row comes free.
ALL_ROWS_UP_TO = 16


def _judging_rows(tree: CandidateTree) -> list[int]:
    """Rows to project in one call: the inner nodes, or every node when the tree is small."""
    if tree.num_nodes + 1 <= ALL_ROWS_UP_TO:
        return list(range(tree.num_nodes + 1))
    return _inner_nodes(tree)


def accept_greedy(tree: CandidateTree, node_tokens: torch.Tensor, verified: VerifyOutput) -> AcceptResult:
    """Longest path agreeing with the base argmax at every node; bonus = argmax after it."""
    rows = _judging_rows(tree)
    predicted = dict(zip(rows, argmax_rows(verified.logits(rows))))  # row -> the base model's token
    tokens = node_tokens.tolist()
    # a node is right when it is its parent's argmax (the root is the base model's own token); plain
    # lists: a tree of a few nodes costs a dozen small torch calls more than its arithmetic
    node_ok = [True] + [tokens[node] == predicted.get(parent) for node, parent in enumerate(tree.parents) if node]
    nodes = [0]
    for leaf in tree.leaves:  # the first root-to-leaf path with the most leading right nodes
        chain = tree.ancestors(leaf)
        right = next((i for i, node in enumerate(chain) if not node_ok[node]), len(chain))
        if right > len(nodes):
            nodes = chain[:right]
    last = nodes[-1]
    return AcceptResult(accepted_nodes=nodes, bonus_token=predicted[last] if last in predicted
                        else argmax_token(verified.row(last)))


def accept_typical(tree: CandidateTree, node_tokens: torch.Tensor, verified: VerifyOutput, config: AcceptConfig,
                   generator: torch.Generator | None) -> AcceptResult:
    """Medusa's typical acceptance (not distribution-preserving)."""
    inner = _inner_nodes(tree)
    device = verified.hidden.device
    probs = torch.softmax(verified.logits(inner) / config.sampling.temperature, dim=-1)  # [inner, V]
    entropy = -(probs * torch.log(probs + 1e-5)).sum(dim=-1)  # [inner]
    threshold = torch.clamp(config.typical_alpha * torch.exp(-entropy), max=config.typical_threshold)  # [inner]
    row_of = torch.zeros(tree.num_nodes + 1, dtype=torch.long, device=device)  # node -> row in `probs`
    row_of[inner] = torch.arange(len(inner), device=device)
    parents = row_of[torch.tensor(tree.parents, device=device).clamp_min(0)]  # [n+1] parent's row
    tokens = node_tokens.to(device)
    token_prob = probs[parents, tokens]  # [n+1] p_parent(token)
    node_ok = token_prob > threshold[parents]
    node_ok[0] = True
    retrieve, lengths = _longest_rows(tree, node_ok)
    longest = lengths.max()
    log_prob = torch.log(token_prob.clamp_min(1e-30))
    log_prob[0] = 0.0
    steps = torch.arange(retrieve.shape[1], device=device)[None]  # [1, D+1]
    in_prefix = steps < lengths[:, None]  # [L, D+1]
    likelihood = torch.where(in_prefix, log_prob[retrieve.clamp_min(0)], 0.0).sum(dim=1)  # [L]
    likelihood = likelihood.masked_fill(lengths < longest, float("-inf"))
    best = int(likelihood.argmax())
    nodes = retrieve[best, : int(longest)].tolist()
    return AcceptResult(accepted_nodes=nodes, bonus_token=next_token(verified.row(nodes[-1]), config.sampling, generator))


def accept_speculative(tree: CandidateTree, node_tokens: torch.Tensor, verified: VerifyOutput, config: AcceptConfig,
                       generator: torch.Generator | None) -> AcceptResult:
    """Recursive rejection sampling down the tree; exact in distribution."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents[1:], start=1):
        children.setdefault(parent, []).append(node)  # node order = rank order among siblings
    tokens = node_tokens.tolist()
    node = 0
    nodes = [0]
    while True:
        residual = sampling_probs(verified.row(node), config.sampling).cpu().double()  # [V]
        moved = False
        for child in children.get(node, []):
            token = tokens[child]
            mass = float(residual[token])
            if mass > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < mass:
                node, moved = child, True
                nodes.append(child)
                break
            residual[token] = 0.0
            total = float(residual.sum())
            if total <= 0:  # the child held all the mass but for rounding: nothing else can be drawn
                node, moved = child, True
                nodes.append(child)
                break
            residual /= total
        if not moved:
            bonus = int(torch.multinomial(residual.float(), 1, generator=generator))
            return AcceptResult(accepted_nodes=nodes, bonus_token=bonus)


def rows_to_project(tree: CandidateTree, config: AcceptConfig) -> list[int]:
    """The rows whose logits `accept` will read first: project them right after the forward
    (part of verification), so acceptance itself is only the tree walk."""
    if config.sampling.greedy or config.rule == "greedy":
        return _judging_rows(tree)
    if config.rule == "typical":
        return _inner_nodes(tree)
    # speculative sampling walks down from the root reading each node's row: one projection for all
    return _judging_rows(tree)


def accept(tree: CandidateTree, node_tokens: torch.Tensor, verified: VerifyOutput, config: AcceptConfig,
           generator: torch.Generator | None = None) -> AcceptResult:
    """Apply the configured rule. node_tokens: long [n+1]; `verified` gives logits per node on demand."""
    if config.sampling.greedy or config.rule == "greedy":
        if not config.sampling.greedy:
            raise ValueError("the greedy rule needs temperature 0; use typical or speculative to sample")
        return accept_greedy(tree, node_tokens, verified)
    if config.rule == "typical":
        return accept_typical(tree, node_tokens, verified, config, generator)
    return accept_speculative(tree, node_tokens, verified, config, generator)
