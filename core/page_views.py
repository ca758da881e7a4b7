"""What the page draws beside a decoding step: never committed, never charged to the step's phases.

A session built with `PageViews` asks its `PageObserver` at each step for the whole tree its drafters
proposed when the budget verified less, Medusa's fixed tree over the same heads' guesses and another
family's tree of the same size, each verified on the step's context and dropped from the cache again
(`core.decoder.DecodeSession.step`). The observer borrows the session's own verify, accept and text
helpers, so what it shows is judged exactly as the step is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
import torch
from torch import nn

from core.budget.controller import StepPlan
from core.drafters.interface import Chain, Proposal
from core.kvcache import cache_length, truncate
from core.records import StepRecord, TreeOutcome
from core.tree import RankPath
from core.tree_policy import DraftTree, build_draft_tree
from core.verify import WalkedRows, forward_tokens


@dataclass(frozen=True)
class PageViews:
    """What a session records beside its steps for the page; none of it changes a token, none of it
    is in a step's timed phases.

    fixed: verify Medusa's fixed tree (`DecodeConfig.fixed_tree`) over the same heads' guesses at
    every step of a family the table draws it beside (a second forward, never committed). rival:
    another family's weights, growing a tree of the same size from the same context. texts: node
    texts, and the drafters' whole proposal where a step verified a part of it (off in benchmarks).
    """

    fixed: bool = False
    rival: nn.Module | None = None
    texts: bool = True


@dataclass(frozen=True)
class ProposedTree:
    """The whole tree the drafters proposed at a step, of which the step verified a part."""

    draft: DraftTree
    node_tokens: list[int]  # [n+1] root first
    node_texts: list[str]

    def outcome(self, verified: TreeOutcome) -> TreeOutcome:
        """The proposal as the record keeps it: the verified step's accepted path and bonus token,
        found in this tree by their tokens (the verified tree is a part of it)."""
        tree = self.draft.tree
        children: dict[tuple[int, int], int] = {}
        for node, parent in enumerate(tree.parents[1:], start=1):
            children.setdefault((parent, self.node_tokens[node]), node)
        accepted = [0]
        for token in verified.accepted_tokens:
            child = children.get((accepted[-1], token))
            if child is None:
                break
            accepted.append(child)
        return TreeOutcome(tree=tree, node_tokens=self.node_tokens, node_scores=self.draft.node_scores(),
                           accepted_nodes=accepted, bonus_token=verified.bonus_token, node_texts=self.node_texts,
                           bonus_text=verified.bonus_text,
                           lookup_rank=self.draft.first_chain_rank if self.draft.chains else None,
                           chain_sources=tuple(c.source for c in self.draft.chains),
                           head_scores=self.draft.node_head_scores())


@dataclass(frozen=True)
class Asides:
    """What the page draws beside a step (`PageObserver.asides`); none of it is committed."""

    proposal: ProposedTree | None = None
    comparison: TreeOutcome | None = None
    rival: TreeOutcome | None = None
    # greedy: the fixed tree, judged after the step by the greedy tokens it verified (`PageObserver.greedy_comparison`)
    fixed_to_judge: DraftTree | None = None


class PageObserver:
    """The page's asides of one session (module docstring)."""

    def __init__(self, session) -> None:
        """`session`: the `core.decoder.DecodeSession` it serves (it lends its verify, accept and text helpers)."""
        self.session = session

    def asides(self, heads: Proposal | None, chains: list[Chain], draft: DraftTree | None, plan: StepPlan,
                max_depth: int) -> "Asides":
        """What the page shows beside the step (never committed, never charged): the whole tree the
        drafters proposed when the budget verified less (the heads drafted here when the controller
        skipped them), the fixed tree over the same heads' guesses, and the rival family's tree of
        the same size, both verified on this step's context."""
        shown = heads
        if shown is None and self.session.page.texts and self.session.heads_drafter is not None and max_depth >= 1:
            shown = self.session.heads_drafter.propose(replace(self.session._draft_context(plan), max_nodes=self.session.config.budget))
        if shown is None:
            return Asides()
        asides = Asides(proposal=self._proposal(shown, chains, draft, max_depth) if self.session.page.texts else None)
        if self.session.fixed_aside:  # a dynamic run: the heads proposed a HeadProposal
            fixed = build_draft_tree(shown, [], self.session.config.budget, self.session.config.top_m, self.session.config.depth, self.session.fixed)
            fixed = fixed.stop_after(self.session.root_token, self.session.eos_token_ids).keep(max_depth=max_depth)
            asides = (replace(asides, fixed_to_judge=fixed) if self.session.config.accept.sampling.greedy
                      else replace(asides, comparison=self._verify_aside(fixed)))
        if self.session.rival_drafter is not None:
            nodes = max(draft.tree.num_nodes if draft is not None else 0, 1)
            proposal = self.session.rival_drafter.propose(self.session._draft_context(plan))
            theirs = build_draft_tree(proposal, [], nodes, self.session.config.top_m, self.session.config.depth)
            asides = replace(asides, rival=self._verify_aside(
                theirs.stop_after(self.session.root_token, self.session.eos_token_ids).keep(max_depth=max_depth, size=nodes)))
        return asides

    def _proposal(self, heads: Proposal, chains: list[Chain], draft: DraftTree | None,
                  max_depth: int) -> "ProposedTree | None":
        """The tree of the whole node budget from these guesses, when it is larger than what the step
        verifies (a sized family: the controller cut it, or skipped the heads)."""
        if not self.session.family.sized:
            return None
        full = build_draft_tree(heads, chains, self.session.config.budget, self.session.config.top_m, self.session.config.depth)
        full = full.stop_after(self.session.root_token, self.session.eos_token_ids).keep(max_depth=max_depth)
        if draft is not None and full.tree.num_nodes <= draft.tree.num_nodes:
            return None
        tokens = full.tree.node_tokens(self.session.root_token, full.token_table).tolist()  # [n+1]
        with self.session._page_texts():
            return ProposedTree(draft=full, node_tokens=tokens, node_texts=self.session._texts(tokens))

    def _verify_aside(self, draft: DraftTree) -> TreeOutcome:
        """A tree verified and judged on the current context, then dropped from the cache (UI only).

        It sees a copy of the session's random state: the draws the real tree will see, never
        advanced (ticking a comparison must not change the sampled text). Speculative sampling reads
        only the rows of the path it walks: those alone are computed, one token at a time (`WalkedRows`)."""
        context = cache_length(self.session.cache)
        twin = torch.Generator()
        twin.set_state(self.session.generator.get_state())
        if self.session.config.accept.rule == "speculative" and not self.session.config.accept.sampling.greedy:
            tokens = draft.tree.node_tokens(self.session.root_token, draft.token_table).tolist()  # [n+1]
            verified = WalkedRows(self.session.base, self.session.cache, draft.tree.parents, tokens)
        else:
            verified = self.session._verify(draft)
        with self.session._page_texts():
            outcome = self.session._dressed(self.session._accept(draft, verified, twin), verified)
        truncate(self.session.cache, context)
        return outcome

    def greedy_comparison(self, fixed: DraftTree, record: StepRecord) -> TreeOutcome:
        """Greedy acceptance of the fixed tree on this step's context, from what the step verified:
        its greedy tokens (the accepted path, then the bonus) decide every node the fixed tree shares
        with them, since such a node's row is the base model's row for the same tokens at the same
        positions (bitwise on the exact kernels). Only where the fixed tree matches all of them does
        greedy acceptance walk on below them, one row at a time (`_walk_below`). A 64-node verify
        beside every step becomes a row or a few."""
        greedy = record.outcome.accepted_tokens + [record.outcome.bonus_token]  # argmax after root, node 1, ...
        tokens = fixed.tree.node_tokens(record.outcome.node_tokens[0], fixed.token_table).tolist()  # [n+1]
        child = {(path[:-1], token): node for node, (path, token) in enumerate(zip(fixed.tree.paths, tokens[1:]), 1)}
        accepted, path = [0], ()
        while len(accepted) <= len(greedy) and (path, greedy[len(accepted) - 1]) in child:
            accepted.append(child[(path, greedy[len(accepted) - 1])])
            path = fixed.tree.paths[accepted[-1] - 1]
        top = {node: greedy[i] for i, node in enumerate(accepted) if i < len(greedy)}  # rows the step computed
        if len(accepted) <= len(greedy):  # it left the greedy path: the next greedy token is its bonus
            bonus = greedy[len(accepted) - 1]
        else:  # it matched every greedy token the step has: walk on below its last node
            below, bonus, below_top = self._walk_below(fixed, tokens, child, accepted[-1],
                                                       record.context_length + len(greedy))
            accepted += below
            top.update(below_top)
        with self.session._page_texts():
            return TreeOutcome(tree=fixed.tree, node_tokens=tokens, node_scores=fixed.node_scores(),
                               accepted_nodes=accepted, bonus_token=bonus, head_scores=fixed.node_head_scores(),
                               node_texts=self.session._texts(tokens), bonus_text="".join(self.session._texts([bonus])),
                               base_top_tokens=[top.get(node, -1) for node in range(len(tokens))])

    def _walk_below(self, fixed: DraftTree, tokens: list[int], child: dict[tuple[RankPath, int], int], node: int,
                    committed: int) -> tuple[list[int], int, dict[int, int]]:
        """Greedy acceptance below fixed-tree `node`, whose token (the step's last greedy token) is not
        in the cache yet: one-token forwards on top of the `committed` positions down the path the base
        model's argmax picks, as plain decoding runs them, then those rows are dropped again. Returns
        the accepted nodes below `node`, the bonus token and the argmax after each node walked."""
        path, below, top = fixed.tree.paths[node - 1], [], {}
        while True:
            out = forward_tokens(self.session.base, self.session.cache, torch.tensor([tokens[node]]),
                                 torch.tensor([cache_length(self.session.cache)]))
            top[node] = argmax = int(out.row(0).argmax())
            if (path, argmax) not in child:
                break
            node = child[(path, argmax)]
            below.append(node)
            path = fixed.tree.paths[node - 1]
        truncate(self.session.cache, committed)
        return below, argmax, top
