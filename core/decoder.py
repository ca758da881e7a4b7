"""The decoder: one stepping API for autoregressive, fixed-tree and dynamic-tree decoding.

    session = start_session(base, heads, prompt, DecodeConfig(strategy="dynamic"))
    while not session.finished:
        record = session.step()      # a StepRecord: everything a viewer needs

A step (tree strategies): heads propose -> tree builder -> buffers -> one verify forward over
the whole tree -> acceptance rule -> KV commit of the accepted path. The root of each tree is
the base model's own next token (the previous step's bonus token); a step emits the accepted
head tokens plus the bonus token, so the autoregressive step (a tree with only the root)
emits exactly one. With `lookup_tokens`, a prompt-lookup chain joins each dynamic tree
(`core.lookup`); while dynamic:auto skips the heads, a step verifies that chain alone.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

from core.accept import AcceptConfig, accept, rows_to_project
from core.heads import MedusaHeads
from core.kvcache import cache_length, keep_accepted, truncate
from core.lookup import LookupDraft, LookupStats, graft_chain, lookup_draft, token_table
from core.model import BaseModel
from core.records import AUTOREGRESSIVE, DYNAMIC, FIXED, LOOKUP, STRATEGIES, PhaseTimes, StepRecord, TreeOutcome
from core.profile import CostProfile, DepthCalibration, best_prefix, plain_rate, verify_profile
from core.sampling import next_token
from core.tree import CandidateTree, RankPath, dynamic_tree, fixed_tree, named_tree
from core.verify import VerifyOutput, forward_tokens, verify_tree

MAX_BUDGET = 256
MAX_TOP_M = 64
MAX_NEW_TOKENS = 1024
MAX_LOOKUP_TOKENS = 32


@dataclass(frozen=True)
class DecodeConfig:
    """Everything that decides how a prompt is decoded.

    strategy: autoregressive | fixed | dynamic. budget: non-root nodes of the dynamic tree (the
    upper bound when auto_budget picks the size each step from the verify-cost profile).
    top_m: candidates kept per head. depth: heads used (tree depth). fixed_tree: a shipped
    tree name or an explicit list of rank paths. compare_fixed: also verify the fixed tree at
    every dynamic step (for the side-by-side view; costs a second forward, never committed).
    lookup_tokens: dynamic only; when > 0, a prompt-lookup chain of up to this many tokens joins
    the tree each step (`core.lookup`), and steps that skip the heads still verify it.
    """

    strategy: str = "dynamic"
    budget: int = 63
    top_m: int = 32
    depth: int = 4
    fixed_tree: str | tuple = "mc_sim_7b_63"
    accept: AcceptConfig = AcceptConfig()
    max_new_tokens: int = 128
    seed: int = 0
    compare_fixed: bool = False
    record_texts: bool = True
    auto_budget: bool = False  # dynamic:auto: per step, the node count (<= budget) maximising tokens/s
    lookup_tokens: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        _check_int("budget", self.budget, 0, MAX_BUDGET)
        _check_int("top_m", self.top_m, 1, MAX_TOP_M)
        _check_int("depth", self.depth, 1, 16)
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        _check_int("lookup_tokens", self.lookup_tokens, 0, MAX_LOOKUP_TOKENS)
        if self.lookup_tokens and self.strategy != "dynamic":
            raise ValueError("a prompt-lookup branch needs the dynamic strategy")

    def resolve_fixed_tree(self) -> CandidateTree:
        if isinstance(self.fixed_tree, str):
            return named_tree(self.fixed_tree)
        return fixed_tree([list(p) for p in self.fixed_tree])


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class DecodeSession:
    """One prompt being decoded: KV cache, emitted tokens and step records. Not thread-safe."""

    def __init__(self, base: BaseModel, heads: MedusaHeads | None, prompt_ids: Sequence[int],
                 config: DecodeConfig, profile: CostProfile | None = None) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if config.strategy != "autoregressive":
            if heads is None:
                raise ValueError(f"strategy {config.strategy!r} needs Medusa heads")
            if config.depth > heads.config.num_heads:
                raise ValueError(f"depth {config.depth} exceeds the {heads.config.num_heads} heads loaded")
        self.base = base
        self.heads = heads
        self.config = config
        self.fixed = config.resolve_fixed_tree() if config.strategy == "fixed" or config.compare_fixed else None
        if self.fixed is not None and (self.fixed.max_rank >= MAX_TOP_M or self.fixed.num_nodes > MAX_BUDGET):
            raise ValueError(f"a fixed tree may use ranks below {MAX_TOP_M} and at most {MAX_BUDGET} nodes")
        if self.fixed is not None and self.fixed.max_depth > (heads.config.num_heads if heads else 0):
            raise ValueError(f"the fixed tree is {self.fixed.max_depth} deep but only "
                             f"{heads.config.num_heads if heads else 0} heads are loaded")
        self.prompt_ids = list(prompt_ids)
        self._max_tree_nodes = max(config.budget, self.fixed.num_nodes if self.fixed else 0) + config.lookup_tokens
        if len(self.prompt_ids) + self._max_tree_nodes + 2 > base.max_positions:
            raise ValueError(f"the prompt is {len(self.prompt_ids)} tokens; with a {self._max_tree_nodes}-node tree "
                             f"it does not fit the model's context of {base.max_positions}")
        self.generator = torch.Generator().manual_seed(config.seed)
        self.draft = heads.draft_projection(base.lm_head) if heads is not None and not heads.config.own_lm_head else None
        self.profile = profile if profile is not None or not config.auto_budget else verify_profile(base)
        self.calibration = DepthCalibration()
        self.lookup_stats = LookupStats()
        self._plain_until = 0  # dynamic:auto: plain steps until this record index (backing off)
        self._backoff = 0  # length of the current back-off
        self.cache = DynamicCache()
        self.records: list[StepRecord] = []
        self.output_ids: list[int] = []
        self.stop_reason: str | None = None
        self.prefill_seconds = 0.0
        self._prefill()

    # -- public -------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def release(self) -> None:
        """Free the KV cache (done automatically when decoding finishes); records stay."""
        self.cache = DynamicCache()

    @property
    def tokens_per_step(self) -> float:
        steps = len(self.records)
        return sum(len(r.new_tokens) for r in self.records) / steps if steps else 0.0

    @torch.inference_mode()
    def step(self) -> StepRecord:
        """Run one decoding step; raises RuntimeError when the session has finished."""
        if self.finished:
            raise RuntimeError(f"decoding has finished ({self.stop_reason})")
        backing_off = len(self.records) < self._plain_until  # dynamic:auto: the heads cannot pay now
        start = time.perf_counter()
        draft = self._lookup_draft()
        draft_seconds = time.perf_counter() - start
        if self.config.strategy == "autoregressive" or (backing_off and draft is None):
            record = self._step_autoregressive()
        else:
            record = self._step_tree(draft, use_heads=not backing_off)
        if self.config.lookup_tokens:  # looking for the chain is part of building the tree
            record = replace(record, times=replace(record.times, tree=record.times.tree + draft_seconds))
        record = replace(record, new_tokens=self._emit(record.new_tokens))
        self.records.append(record)
        if self.finished:
            self.release()
        return record

    def fork(self, seed: int) -> "DecodeSession":
        """An independent copy at the current point (own cache and random generator), e.g. to
        draw many samples from one prefill."""
        twin = copy.copy(self)
        twin.cache = copy.deepcopy(self.cache)
        twin.records, twin.output_ids = list(self.records), list(self.output_ids)
        twin.calibration = copy.deepcopy(self.calibration)
        twin.lookup_stats = copy.deepcopy(self.lookup_stats)
        twin.generator = torch.Generator().manual_seed(seed)
        return twin

    def run(self) -> Iterator[StepRecord]:
        """Step until EOS, the token limit or the context limit."""
        while not self.finished:
            yield self.step()

    # -- internals ----------------------------------------------------------------------------
    def _prefill(self) -> None:
        start = time.perf_counter()
        with torch.inference_mode():
            ids = torch.tensor(self.prompt_ids)
            out = forward_tokens(self.base, self.cache, ids, torch.arange(len(ids)), None)
        self.last_hidden = out.hidden[-1]  # [H]
        self.root_token = next_token(out.row(len(self.prompt_ids) - 1), self.config.accept.sampling, self.generator)
        self.prefill_seconds = time.perf_counter() - start
        self._emit([self.root_token])
        if self.finished:  # the first token already ended it
            self.release()

    def _emit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to EOS / the token limit; returns those actually emitted."""
        room = self.config.max_new_tokens - len(self.output_ids)
        emitted = []
        for token in tokens[:room]:
            emitted.append(token)
            self.output_ids.append(token)
            if token in self.base.eos_token_ids:
                self.stop_reason = "eos"
                return emitted
        if len(self.output_ids) >= self.config.max_new_tokens:
            self.stop_reason = "max_new_tokens"
        elif len(self.prompt_ids) + len(self.output_ids) + self._max_tree_nodes + 2 > self.base.max_positions:
            self.stop_reason = "context"
        return emitted

    def _texts(self, ids: list[int]) -> list[str]:
        return self.base.token_texts(ids) if self.config.record_texts else []

    def _step_autoregressive(self) -> StepRecord:
        device = self.base.device
        context = cache_length(self.cache)
        t0 = _clock(device)
        out = forward_tokens(self.base, self.cache, torch.tensor([self.root_token]), torch.tensor([context]), None)
        out.row(0)  # the logits belong to the forward, as in a tree step
        t1 = _clock(device)
        bonus = next_token(out.row(0), self.config.accept.sampling, self.generator)
        t2 = _clock(device)
        self.last_hidden, self.root_token = out.hidden[0], bonus
        outcome = TreeOutcome(tree=CandidateTree(paths=[], kind="autoregressive"), node_tokens=[int(self.output_ids[-1])],
                              node_scores=[1.0], accepted_nodes=[0], bonus_token=bonus,
                              node_texts=self._texts([int(self.output_ids[-1])]), bonus_text="".join(self._texts([bonus])))
        return StepRecord(index=len(self.records), strategy="autoregressive", context_length=context,
                          head_token_ids=[], head_probs=[], outcome=outcome, new_tokens=[bonus],
                          times=PhaseTimes(verify=t1 - t0, accept=t2 - t1))

    def _propose(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-m probabilities and token ids of each head: ([D, m], [D, m])."""
        width = max(self.config.top_m, self.fixed.max_rank + 1 if self.fixed else 1)
        # `depth` bounds the dynamic tree; a fixed tree brings its own depth
        depth = max(self.config.depth, self.fixed.max_depth if self.fixed else 0)
        return self.heads.propose(self.last_hidden, width, self.draft, depth=depth)  # [D, width] each

    def _lookup_draft(self) -> LookupDraft | None:
        """The prompt-lookup chain after the current root, when the config asks for one."""
        if not self.config.lookup_tokens:
            return None
        return lookup_draft(self.prompt_ids + self.output_ids, self.config.lookup_tokens)

    def _build_tree(self, head_probs: torch.Tensor, head_ids: torch.Tensor, draft: LookupDraft | None,
                    use_heads: bool) -> tuple[CandidateTree, list[RankPath]]:
        """The step's tree and the lookup chain's node paths in it (empty without a draft)."""
        if self.config.strategy == "fixed":
            return self.fixed, []
        tree = dynamic_tree(head_probs[: self.config.depth, : self.config.top_m], self.config.budget)
        chain: list[RankPath] = []
        if draft is not None and draft.tokens:
            tree, chain = graft_chain(tree, head_ids.tolist(), draft, self.lookup_stats.chances(draft),
                                      lookup_rank=head_ids.shape[1])
        if not self.config.auto_budget:
            return tree, chain
        # any prefix of the best-first order is itself a tree: keep the one with the best rate; the
        # heads' scores are corrected per depth by the acceptance seen so far, the chain's are its own
        on_chain = set(chain)
        expected = [score if path in on_chain else score * self.calibration.factor(len(path))
                    for path, score in zip(tree.paths, tree.scores)]
        size, rate = best_prefix(expected, tree.depths[1:], self.profile, self._overhead_ms(tree_steps=use_heads))
        if use_heads:
            self._update_backoff(size, rate)
        kept = set(tree.paths[:size])
        return CandidateTree(paths=tree.paths[:size], scores=tree.scores[:size], kind="dynamic"), \
            [path for path in chain if path in kept]

    def _update_backoff(self, size: int, rate: float) -> None:
        plain = self._measured_rate(tree_steps=False) or plain_rate(self.profile, self._overhead_ms(tree_steps=False))
        measured = self._measured_rate(tree_steps=True)
        # acceptance comes in streaks, so only a long record of tree steps clearly losing to plain
        # steps, or an expected rate far below plain, backs off for 16 steps; when no node is worth
        # verifying, the next 1, 2, 4 ... 16 steps are plain (reset once a tree pays again)
        if (measured is not None and measured < 0.9 * plain) or rate < 0.8 * plain:
            self._backoff = 16
        elif size == 0:
            self._backoff = min(max(1, 2 * self._backoff), 16)
        else:
            self._backoff = 0
        self._plain_until = len(self.records) + 1 + self._backoff  # steps after this one

    @staticmethod
    def _used_heads(record: StepRecord) -> bool:
        return record.strategy not in ("autoregressive", "lookup")

    def _measured_rate(self, tree_steps: bool) -> float | None:
        """Tokens per ms that the last 24 steps with (or without) the heads actually delivered;
        None before 12 of them. Steps without the heads are plain or lookup-only ones."""
        recent = [r for r in self.records[-96:] if self._used_heads(r) == tree_steps][-24:]
        if len(recent) < 12:
            return None
        return sum(len(r.new_tokens) for r in recent) / (1000 * sum(r.times.total for r in recent))

    def _overhead_ms(self, tree_steps: bool) -> float:
        """Mean non-verify time (heads, tree, accept, commit) of recent steps with or without heads.

        Verify times include the logits' projection (the profile measures it too). Before any plain
        step, a plain step's overhead is estimated by the tree steps' accept time.
        """
        recent = [r for r in self.records[-16:] if self._used_heads(r) == tree_steps]
        if recent:
            return 1000 * sum(r.times.total - r.times.verify for r in recent) / len(recent)
        tree_recent = [r for r in self.records[-16:] if self._used_heads(r)]
        if not tree_steps and tree_recent:
            return 1000 * sum(r.times.accept for r in tree_recent) / len(tree_recent)
        return 2.0

    def _verify_and_accept(self, tree: CandidateTree, head_probs: torch.Tensor, token_ids: torch.Tensor,
                           lookup_rank: int | None = None) -> tuple[TreeOutcome, VerifyOutput, float, float]:
        """Verify `tree` on top of the cache and apply the acceptance rule (the cache keeps the tree).
        token_ids: [rows, ranks] token of each (depth, rank), the heads' top-m plus any lookup column."""
        device = self.base.device
        buffers = tree.buffers()
        tokens = tree.node_tokens(self.root_token, token_ids)  # [n+1]
        t0 = _clock(device)
        out = verify_tree(self.base, self.cache, tokens, buffers.attn_mask, buffers.position_ids)
        out.logits(rows_to_project(tree, self.config.accept))  # the base model's logits: part of verifying
        t1 = _clock(device)
        result = accept(tree, tokens, out, self.config.accept, self.generator)
        t2 = _clock(device)
        token_list = tokens.tolist()
        # dynamic trees carry their (top-m renormalised) scores; fixed ones use the raw marginals
        scores = tree.scores if tree.scores is not None else tree.path_scores(head_probs)
        outcome = TreeOutcome(tree=tree, node_tokens=token_list, node_scores=[1.0] + list(scores),
                              accepted_nodes=result.accepted_nodes, bonus_token=result.bonus_token,
                              node_texts=self._texts(token_list), bonus_text="".join(self._texts([result.bonus_token])),
                              lookup_rank=lookup_rank)
        return outcome, out, t1 - t0, t2 - t1

    def _step_tree(self, draft: LookupDraft | None = None, use_heads: bool = True) -> StepRecord:
        """One tree step; without the heads (dynamic:auto backing off) the tree is the lookup chain."""
        device = self.base.device
        context = cache_length(self.cache)
        t0 = _clock(device)
        if use_heads:
            head_probs, head_ids = self._propose()  # [D, m] each
        else:
            head_probs, head_ids = torch.zeros(0, self.config.top_m), torch.zeros(0, self.config.top_m, dtype=torch.long)
        t1 = _clock(device)
        tree, chain = self._build_tree(head_probs, head_ids, draft, use_heads)
        token_ids = token_table(head_ids, draft) if chain else head_ids
        t2 = _clock(device)
        comparison, compare_seconds = None, 0.0
        if self.config.compare_fixed and self.config.strategy == "dynamic" and use_heads:
            c0 = _clock(device)
            comparison, _, _, _ = self._verify_and_accept(self.fixed, head_probs, head_ids)
            truncate(self.cache, context)  # the comparison is never committed
            compare_seconds = _clock(device) - c0
        lookup_rank = head_ids.shape[1] if chain else None
        outcome, out, verify_seconds, accept_seconds = self._verify_and_accept(tree, head_probs, token_ids, lookup_rank)
        c0 = _clock(device)
        accepted = torch.tensor(outcome.accepted_nodes, device=device)
        keep_accepted(self.cache, context, accepted)
        self.last_hidden = out.hidden[outcome.accepted_nodes[-1]]  # [H]
        self.root_token = outcome.bonus_token
        commit_seconds = _clock(device) - c0
        new_tokens = outcome.accepted_tokens
        self._learn(outcome, draft, chain, use_heads=use_heads)
        shown = min(self.config.top_m, 10)
        return StepRecord(
            index=len(self.records), context_length=context,
            strategy=self.config.strategy if use_heads else ("lookup" if chain else "autoregressive"),
            head_token_ids=head_ids[:, :shown].tolist(), head_probs=head_probs[:, :shown].tolist(),
            outcome=outcome, new_tokens=new_tokens + [outcome.bonus_token],
            times=PhaseTimes(heads=t1 - t0, tree=t2 - t1, verify=verify_seconds, accept=accept_seconds,
                             commit=commit_seconds, compare=compare_seconds),
            comparison=comparison,
            head_texts=[self._texts(row) for row in head_ids[:, :shown].tolist()] if self.config.record_texts else [],
        )

    def _learn(self, outcome: TreeOutcome, draft: LookupDraft | None, chain: list[RankPath], *,
               use_heads: bool) -> None:
        """Update the acceptance estimates: the lookup chain's, and (auto) the heads' per depth."""
        tree = outcome.tree
        if chain:
            self.lookup_stats.update(draft, len(chain), outcome.accepted_tokens)
        if not (self.config.auto_budget and use_heads):
            return
        copied = outcome.lookup_nodes
        head_nodes = [node for node in range(1, tree.num_nodes + 1) if node not in copied]
        accepted_by_heads = sum(1 for node in outcome.accepted_nodes[1:] if node not in copied)
        scores = tree.scores or [0.0] * tree.num_nodes
        self.calibration.update([tree.depths[node] for node in head_nodes], [scores[node - 1] for node in head_nodes],
                                accepted_by_heads)

def start_session(base: BaseModel, heads: MedusaHeads | None, prompt: str | Sequence[int],
                  config: DecodeConfig, profile: CostProfile | None = None) -> DecodeSession:
    """Prefill `prompt` (text gets the chat template; a list of ids is used as is) and return a session."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"the prompt is not valid text (character {error.start}: a lone surrogate?)") from None
        prompt_ids = base.chat_ids(prompt)
    else:
        prompt_ids = [int(i) for i in prompt]
    return DecodeSession(base, heads, prompt_ids, config, profile)


def decode(base: BaseModel, heads: MedusaHeads | None, prompt: str | Sequence[int], config: DecodeConfig,
           profile: CostProfile | None = None) -> DecodeSession:
    """Run a prompt to the end; the finished session holds the output and every step record."""
    session = start_session(base, heads, prompt, config, profile)
    for _ in session.run():
        pass
    return session
