"""The decoder: one stepping API for autoregressive, fixed-tree and dynamic-tree decoding.

    session = start_session(base, heads, prompt, DecodeConfig(spec="dynamic:auto+lookup"))
    while not session.finished:
        record = session.step()      # a StepRecord: everything a viewer needs

A step: drafters propose (`core.drafters`: the Medusa heads, prompt lookup, ...) -> the tree policy
builds one CandidateTree from their candidates (`core.tree_policy`; `dynamic:auto` keeps the
best prefix, `core.budget.controller`) -> one verify forward over the whole tree with tree attention ->
acceptance rule -> KV commit of the accepted path. The root of each tree is the base model's
own next token (the previous step's bonus token); a step emits the accepted tokens plus the
bonus token, so the autoregressive step (a tree with only the root) emits exactly one. While
dynamic:auto skips the heads, a step verifies the chains alone.
"""
from __future__ import annotations

import contextlib
import copy
import json
import time
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence, TypeVar

import torch
from torch import nn

from core.accept import AcceptConfig, AcceptResult, accept, rows_to_project
from core.budget.controller import AutoBudget, FixedBudget, NodeBudget, StepPlan
from core.drafters.datastore import StoreDrafter, TokenStore, default_store
from core.drafters.interface import Chain, DraftContext, Drafter, Proposal
from core.drafters.lookup import LookupDrafter
from core.families import family
from core.kvcache import cache_length, keep_accepted
from core.model import DEFAULT_MODEL, BaseModel
from core.budget.cost_profile import CostProfile, verify_profile
from core.records import PhaseTimes, StepKind, StepRecord, TreeOutcome
from core.strategy import (AUTOREGRESSIVE, DEFAULT_BEAM, DEFAULT_DEPTH, DEFAULT_FIXED_TREE, DEFAULT_NEW_TOKENS, DEFAULT_TOP_M,
                           DYNAMIC, LOOKUP_TOKENS, MAX_BUDGET, MAX_CHAIN_TOKENS, MAX_CHAINS, MAX_DEPTH,
                           MAX_NEW_TOKENS, MAX_TOP_M, PEERS, STORE_TOKENS, StrategyError, StrategySpec,
                           check_int, parse_strategy, strategy_families)
from core.sampling import next_token, top_two
from core.page_views import PageObserver, PageViews  # noqa: F401  (callers import PageViews here too)
from core.tree import CandidateTree, fixed_tree, named_tree
from core.tree_policy import DraftTree, build_draft_tree
from core.verify import VerifyOutput, WalkedRows, forward_tokens, verify_tree



@dataclass(frozen=True)
class DecodeConfig:
    """Everything that decides how a prompt is decoded.

    spec: the strategy (`core.strategy`'s grammar, as text or a `StrategySpec`): the family, its node
    budget (the cap when `auto` sizes the tree each step from the verify-cost profile), `+lookup`
    (a prompt-lookup chain of up to `lookup_tokens` tokens joins each tree, `core.drafters.lookup`;
    `lookup_chains` > 1 adds what followed the same n-gram elsewhere as further branches) and
    `+store` (the datastore of the model's own answers proposes up to `store_branches`
    continuations of up to `store_tokens` tokens, `core.drafters.datastore`); a fixed spec's tree
    name becomes `fixed_tree`. top_m: candidates kept per head (grown trees: children per expanded
    node). beam: nodes expanded per depth when a tree is grown (Hydra's, EAGLE's). depth: heads used (tree
    depth). fixed_tree: a shipped tree name or an explicit list of rank paths (decoded by the fixed
    family, drawn beside a dynamic run by `PageViews.fixed`).
    """

    spec: StrategySpec | str = DYNAMIC
    top_m: int = DEFAULT_TOP_M
    depth: int = DEFAULT_DEPTH
    fixed_tree: str | tuple = DEFAULT_FIXED_TREE
    accept: AcceptConfig = AcceptConfig()
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    seed: int = 0
    lookup_tokens: int = LOOKUP_TOKENS
    lookup_chains: int = 1
    store_tokens: int = STORE_TOKENS
    store_branches: int = 3
    beam: int = DEFAULT_BEAM

    def __post_init__(self) -> None:
        spec = parse_strategy(self.spec) if isinstance(self.spec, str) else self.spec
        if not isinstance(spec, StrategySpec) or spec.family not in strategy_families():
            raise ValueError(f"strategy must be one of {strategy_families()} (core.strategy's grammar), got {self.spec!r}")
        object.__setattr__(self, "spec", spec)
        if spec.tree:  # a fixed spec's tree, checked now rather than mid-run
            object.__setattr__(self, "fixed_tree", _fixed_tree_of(spec.tree))
        check_int("top_m", self.top_m, 1, MAX_TOP_M)
        check_int("depth", self.depth, 1, MAX_DEPTH)
        check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        check_int("lookup_tokens", self.lookup_tokens, 1, MAX_CHAIN_TOKENS)
        check_int("lookup_chains", self.lookup_chains, 1, MAX_CHAINS)
        check_int("store_tokens", self.store_tokens, 1, MAX_CHAIN_TOKENS)
        check_int("store_branches", self.store_branches, 1, MAX_CHAINS)
        check_int("beam", self.beam, 1, MAX_TOP_M)

    @property
    def strategy(self) -> str:
        """The family decoded (`core.families`): every `StepRecord.family` of the run."""
        return self.spec.family

    @property
    def budget(self) -> int:
        """Non-root nodes of a sized family's tree (the cap under `auto`)."""
        return self.spec.node_budget

    @property
    def auto_budget(self) -> bool:
        """The tree's size is chosen each step (`core.budget.controller`)."""
        return self.spec.auto

    def resolve_fixed_tree(self) -> CandidateTree:
        if isinstance(self.fixed_tree, str):
            return named_tree(self.fixed_tree)
        return fixed_tree([list(p) for p in self.fixed_tree])


def strategy_config(spec: StrategySpec, base_config: DecodeConfig | None = None) -> DecodeConfig:
    """`base_config` decoding the way `spec` says. The spec's forward (`@lean` / `@hf`) is the
    caller's to apply; peers (`hf:*`, `llamacpp:greedy`) are not ours to decode."""
    if spec.family in PEERS:
        raise StrategyError(f"{spec.text} runs another program's decoding, not a DecodeConfig")
    return replace(base_config if base_config is not None else DecodeConfig(), spec=spec)


def _fixed_tree_of(name: str) -> str | tuple[tuple[int, ...], ...]:
    """A shipped tree's name as it is, or the rank paths of a JSON file (checked now, not mid-run)."""
    if not name.endswith(".json"):
        named_tree(name)  # an unknown name fails here
        return name
    choices = json.loads(Path(name).read_text())
    fixed_tree(choices)
    return tuple(tuple(p) for p in choices)


T = TypeVar("T")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class PhaseClock:
    """Wall seconds per phase of one step (the fields of `PhaseTimes`), CUDA synchronised at each reading."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def time(self, phase: str, work: Callable[..., T], *args: object) -> T:
        """`work(*args)`, its wall time added to `phase`."""
        start = _clock(self.device)
        result = work(*args)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + _clock(self.device) - start
        return result

    def times(self, texts: float) -> PhaseTimes:
        return PhaseTimes(**self.seconds, texts=texts)


class DecodeSession:
    """One prompt being decoded: KV cache, emitted tokens and step records. Not thread-safe."""

    def __init__(self, base: BaseModel, heads: nn.Module | None, prompt_ids: Sequence[int],
                 config: DecodeConfig, profile: CostProfile | None = None, *, store: TokenStore | None = None,
                 page: PageViews = PageViews()) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.family = family(config.strategy)
        if self.family.drafts and heads is None:
            raise ValueError(f"strategy {config.strategy!r} needs {self.family.weights_name}")
        self.base = base
        self.config = config
        self.page = page
        # the fixed tree: decoded (fixed), or verified aside over a dynamic tree's heads (the comparison)
        self.fixed_aside = page.fixed and self.family.fixed_beside
        self.fixed = config.resolve_fixed_tree() if self.family.decodes_fixed_tree or self.fixed_aside else None
        if self.fixed is not None and (self.fixed.max_rank >= MAX_TOP_M or self.fixed.num_nodes > MAX_BUDGET):
            raise ValueError(f"a fixed tree may use ranks below {MAX_TOP_M} and at most {MAX_BUDGET} nodes")
        if self.fixed is not None and self.fixed.max_depth > (heads.max_depth if heads else 0):
            raise ValueError(f"the fixed tree is {self.fixed.max_depth} deep but only "
                             f"{heads.max_depth if heads else 0} heads are loaded")
        self.prompt_ids = list(prompt_ids)
        self.eos_token_ids = base.eos_token_ids  # read once (a property that reads the generation config)
        # plain decoding reserves nothing: the prompt needs room for one new token; near the
        # limit a tree step shrinks to the depth that still fits (see `_room`)
        if len(self.prompt_ids) >= base.max_positions:
            raise ValueError(f"the prompt is {len(self.prompt_ids)} tokens; the model's context of "
                             f"{base.max_positions} leaves no room for an answer")
        self.heads_drafter = self._heads_drafter(heads)
        # the other family's heads, drafting from the same context for the side-by-side view
        self.rival_drafter = self._heads_drafter(page.rival, rival=True) if page.rival is not None else None
        self.chain_drafters = self._chain_drafters(store)
        self.observer = PageObserver(self)  # what the page draws beside each step (core.page_views)
        # the answer's hidden states, for drafters that attend over them (Hydra's prefix layer, the
        # EAGLE layer), and the states the verify forward taps for them (EAGLE's low and mid layers)
        drafters = (self.heads_drafter, self.rival_drafter)
        self.keeps_history = any(getattr(d, "reads_history", False) for d in drafters)
        self.taps: tuple[int, ...] = next((d.taps for d in drafters if getattr(d, "taps", ())), ())
        self.hidden_history: list[torch.Tensor] = []
        self.feature_history: list[torch.Tensor] = []
        self._text_seconds = 0.0  # this step's node-text decoding (PhaseTimes.texts)
        self.controller: NodeBudget = (AutoBudget(profile or verify_profile(base)) if config.auto_budget
                                       else FixedBudget())
        self.generator = torch.Generator().manual_seed(config.seed)
        # room for the prompt, the answer and one tree on top: a static cache never has to grow
        self.cache = base.new_cache(len(self.prompt_ids) + config.max_new_tokens + MAX_BUDGET + 2)
        self.records: list[StepRecord] = []
        self.output_ids: list[int] = []
        self.stop_reason: str | None = None
        self.prefill_seconds = 0.0
        self._prefill()

    def _heads_drafter(self, heads: object | None, rival: bool = False) -> Drafter | None:
        """The family's drafter over `heads` (its weights); `rival`: the weights' own family, drafting
        beside this session's for the side-by-side view."""
        if not self.family.drafts or heads is None:
            return None
        if not rival:
            return self.family.build_drafter(heads, self.base, self.config, self.fixed)
        config = replace(self.config, spec=replace(self.config.spec, family=heads.family))
        return family(heads.family).build_drafter(heads, self.base, config)

    def _chain_drafters(self, store: TokenStore | None) -> list[Drafter]:
        drafters: list[Drafter] = []
        if self.config.spec.lookup:
            drafters.append(LookupDrafter(self.config.lookup_tokens, self.config.lookup_chains))
        if self.config.spec.store:
            if store is None and self.base.config.name != DEFAULT_MODEL:
                raise ValueError("the shipped datastore holds SmolLM2's token ids; pass a store built for this model")
            drafters.append(StoreDrafter(store or default_store(), self.config.store_tokens, self.config.store_branches))
        return drafters

    # -- public -------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def release(self) -> None:
        """Free the KV cache (done automatically when decoding finishes); records stay."""
        self.cache = self.base.new_cache(capacity=1)

    @property
    def tokens_per_step(self) -> float:
        steps = len(self.records)
        return sum(len(r.new_tokens) for r in self.records) / steps if steps else 0.0

    @torch.inference_mode()
    def step(self) -> StepRecord:
        """Run one decoding step: draft, build, verify, accept, commit, record. RuntimeError once finished."""
        if self.finished:
            raise RuntimeError(f"decoding has finished ({self.stop_reason})")
        clock = PhaseClock(self.base.device)
        plan = self.controller.plan(self.config.budget)  # the drafters and node budget
        max_depth = self._room() - 1  # deeper nodes would not fit the context
        self._text_seconds = 0.0
        heads, drafted = clock.time("heads", self._draft, plan, max_depth)
        chains = [chain for _, proposed in drafted for chain in proposed]
        draft = clock.time("tree", self._build, heads, chains, plan, max_depth) if heads is not None or chains else None
        asides = clock.time("compare", self.observer.asides, heads, chains, draft, plan, max_depth)  # the page's
        if draft is None:
            record = self._step_autoregressive(clock)
        else:
            context = cache_length(self.cache)
            out = clock.time("verify", self._verify, draft)
            outcome = self._dressed(clock.time("accept", self._accept, draft, out), out)
            clock.time("commit", self._commit, context, outcome, out)
            self._observe_chains(drafted, draft, outcome.accepted_tokens)
            record = self._tree_record(heads, draft, outcome, context)
        comparison = asides.comparison
        if asides.fixed_to_judge is not None:
            comparison = clock.time("compare", self.observer.greedy_comparison, asides.fixed_to_judge, record)
        record = replace(record, times=clock.times(texts=self._text_seconds), controller=plan.state,  # timed here
                         new_tokens=self._emit(record.new_tokens), comparison=comparison, rival=asides.rival,
                         proposal=asides.proposal.outcome(record.outcome) if asides.proposal else None)
        self.records.append(record)
        self.controller.observe(record)
        if self.finished:
            self.release()
        return record

    def fork(self, seed: int) -> "DecodeSession":
        """An independent copy at the current point (own cache, drafters' statistics and random
        generator), e.g. to draw many samples from one prefill."""
        twin = copy.copy(self)
        twin.cache = copy.deepcopy(self.cache)
        twin.records, twin.output_ids = list(self.records), list(self.output_ids)
        twin.chain_drafters = copy.deepcopy(self.chain_drafters)
        twin.heads_drafter, twin.rival_drafter = copy.copy(self.heads_drafter), copy.copy(self.rival_drafter)
        twin.hidden_history, twin.feature_history = list(self.hidden_history), list(self.feature_history)
        twin.controller = copy.deepcopy(self.controller)
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
            out = forward_tokens(self.base, self.cache, ids, torch.arange(len(ids)), taps=self.taps)
        self.last_hidden = out.hidden[-1]  # [H]
        self._remember_hidden(out, slice(-1, None))
        logits = out.row(len(self.prompt_ids) - 1)  # [V]
        self.root_token = next_token(logits, self.config.accept.sampling, self.generator)
        self.prefill_top_logits = top_two(logits)
        self.prefill_seconds = time.perf_counter() - start
        self._emit([self.root_token])
        if self.finished:  # the first token already ended it
            self.release()

    def _room(self) -> int:
        """Tokens that may still be emitted: the token limit, and the model's context (the text,
        prompt included, never grows past `max_positions`)."""
        return min(self.config.max_new_tokens - len(self.output_ids),
                   self.base.max_positions - len(self.prompt_ids) - len(self.output_ids))

    def _emit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to EOS / the token limit / the context; returns those actually emitted."""
        emitted = []
        for token in tokens[: max(self._room(), 0)]:
            emitted.append(token)
            self.output_ids.append(token)
            if token in self.eos_token_ids:
                self.stop_reason = "eos"
                return emitted
        if len(self.output_ids) >= self.config.max_new_tokens:
            self.stop_reason = "max_new_tokens"
        elif self._room() <= 0:
            self.stop_reason = "context"
        return emitted

    def _draft_context(self, plan: StepPlan) -> DraftContext:
        return DraftContext(tokens=self.prompt_ids + self.output_ids, hidden=self.last_hidden,
                            history=self.hidden_history, max_nodes=plan.max_nodes, features=self.feature_history)

    def _remember_hidden(self, out: VerifyOutput, rows: slice | torch.Tensor) -> None:
        """Keep the accepted positions' rows of this forward's hidden states [n, H] (and tapped
        states) when a drafter reads them (copies: a prefill's other rows are not kept alive)."""
        if not self.keeps_history:
            return
        self.hidden_history.append(out.hidden[rows].clone())  # [k, H]
        if self.taps:
            tapped = out.tapped[:, rows]  # [T, k, H]
            self.feature_history.append(torch.cat(list(tapped) + [out.hidden[rows]], dim=-1))  # [k, (T+1)H]

    @contextlib.contextmanager
    def _page_texts(self) -> Iterator[None]:
        """Texts named inside are the page's (a proposal, a comparison beside the step), not the
        step's own `texts` time."""
        saved = self._text_seconds
        try:
            yield
        finally:
            self._text_seconds = saved

    def _texts(self, ids: list[int]) -> list[str]:
        """Each token's text for the record (none in benchmarks); the time it takes is the step's
        `texts` phase."""
        if not self.page.texts:
            return []
        start = time.perf_counter()
        texts = self.base.token_texts(ids)
        self._text_seconds += time.perf_counter() - start
        return texts

    def _draft(self, plan: StepPlan, max_depth: int
               ) -> tuple[Proposal | None, list[tuple[Drafter, list[Chain]]]]:
        """The candidates of the drafters the plan runs (none when no tree node would fit: the
        step is then plain, as on the controller's probes)."""
        if max_depth < 1 or not self.family.drafts:
            return None, []
        context = self._draft_context(plan)
        heads = self.heads_drafter.propose(context) if plan.heads else None  # dynamic:auto backing off skips them
        chains = []
        for drafter in self.chain_drafters if plan.chains else ():
            proposed = drafter.propose(context)
            if proposed:  # nodes deeper than max_depth are pruned with the tree's in `_build`
                chains.append((drafter, proposed))
        return heads, chains

    def _step_autoregressive(self, clock: "PhaseClock") -> StepRecord:
        """A plain step: the root alone, its logits, the next token."""
        context = cache_length(self.cache)
        out = clock.time("verify", self._forward_root, context)
        logits = out.row(0)  # [V] the logits belong to the forward, as in a tree step
        bonus = clock.time("accept", next_token, logits, self.config.accept.sampling, self.generator)
        self.last_hidden, self.root_token = out.hidden[0], bonus
        self._remember_hidden(out, slice(0, 1))
        root = int(self.output_ids[-1])
        outcome = TreeOutcome(tree=CandidateTree(paths=[], kind=AUTOREGRESSIVE), node_tokens=[root],
                              node_scores=[1.0], accepted_nodes=[0], bonus_token=bonus,
                              node_texts=self._texts([root]), bonus_text="".join(self._texts([bonus])),
                              head_scores=[1.0])
        return StepRecord(index=len(self.records), family=self.config.strategy, kind=StepKind.PLAIN,
                          context_length=context,
                          head_token_ids=[], head_probs=[], outcome=outcome, new_tokens=[bonus], times=PhaseTimes(),
                          top_logits=top_two(logits))  # the margin of this choice, for near-tie checks

    def _forward_root(self, context: int) -> VerifyOutput:
        out = forward_tokens(self.base, self.cache, torch.tensor([self.root_token]), torch.tensor([context]),
                             taps=self.taps)
        out.project([0])  # the logits: part of the forward's time
        return out

    def _build(self, heads: Proposal | None, chains: list[Chain], plan: StepPlan,
               max_depth: int) -> DraftTree | None:
        """The step's tree: the policy's tree of the plan's node budget, cut to the context, then
        to the prefix the controller chooses (all of it unless `auto`); None when the chains alone
        cannot pay (the step is then a plain one)."""
        context = cache_length(self.cache)
        if heads is None and not self.controller.chains_may_pay(chains, context):
            return None
        fixed = self.fixed if self.family.decodes_fixed_tree else None
        draft = build_draft_tree(heads, chains, plan.max_nodes, self.config.top_m, self.config.depth, fixed)
        draft = draft.stop_after(self.root_token, self.eos_token_ids)
        if draft.tree.max_depth > max_depth:
            draft = draft.keep(max_depth=max_depth)
        size = self.controller.choose(draft, heads_used=heads is not None, context=context)
        return draft.keep(size=size) if size < draft.tree.num_nodes else draft

    def _verify(self, draft: DraftTree) -> VerifyOutput:
        """One forward over the whole tree on top of the cache (which keeps it until the commit),
        with the logits of the rows the acceptance rule reads."""
        tree = draft.tree
        if tree.num_nodes == 0:  # the root alone (the budget kept no node): a plain step's forward
            return self._forward_root(cache_length(self.cache))
        buffers = tree.buffers()
        tokens = tree.node_tokens(self.root_token, draft.token_table)  # [n+1]
        out = verify_tree(self.base, self.cache, tokens, buffers.attn_mask, buffers.position_ids, self.taps)
        out.project(rows_to_project(tree, self.config.accept))  # the base model's logits: part of verifying
        return out

    def _accept(self, draft: DraftTree, out: VerifyOutput | WalkedRows, generator: torch.Generator | None = None
                ) -> TreeOutcome:
        """The acceptance rule on a verified tree (`generator`: the random source of sampling rules,
        default the session's own) and what the record shows of it."""
        tree = draft.tree
        tokens = tree.node_tokens(self.root_token, draft.token_table)  # [n+1]
        if tree.num_nodes == 0:  # the root alone: its row decides the next token, as in a plain step
            result = AcceptResult(accepted_nodes=[0], bonus_token=next_token(out.row(0), self.config.accept.sampling,
                                                                             generator or self.generator))
        else:
            result = accept(tree, tokens, out, self.config.accept, generator or self.generator)
        return TreeOutcome(tree=tree, node_tokens=tokens.tolist(), node_scores=draft.node_scores(),
                           accepted_nodes=result.accepted_nodes, bonus_token=result.bonus_token,
                           lookup_rank=draft.first_chain_rank if draft.chains else None,
                           chain_sources=tuple(c.source for c in draft.chains), head_scores=draft.node_head_scores())

    def _dressed(self, outcome: TreeOutcome, out: VerifyOutput | WalkedRows) -> TreeOutcome:
        """A verified tree with what only the page reads (node texts, the base model's top token at each
        projected row), timed as the step's texts, outside its decoding phases."""
        if not self.page.texts:
            return outcome
        start = time.perf_counter()
        top_tokens = out.projected_argmax(outcome.tree.num_nodes + 1)
        self._text_seconds += time.perf_counter() - start
        return replace(outcome, node_texts=self._texts(outcome.node_tokens), base_top_tokens=top_tokens,
                       bonus_text="".join(self._texts([outcome.bonus_token])))

    def _commit(self, context: int, outcome: TreeOutcome, out: VerifyOutput) -> None:
        """Keep the accepted path in the cache (copied into place, the rest dropped) and what the
        next step drafts from: its last hidden state (and features) and the bonus token as root."""
        accepted = torch.tensor(outcome.accepted_nodes, device=self.base.device)  # [k] root first
        if outcome.tree.num_nodes:  # after the root alone the cache already holds exactly prefix + root
            keep_accepted(self.cache, context, accepted)
        self.last_hidden = out.hidden[outcome.accepted_nodes[-1]]  # [H]
        self._remember_hidden(out, accepted)
        self.root_token = outcome.bonus_token

    def _tree_record(self, heads: Proposal | None, draft: DraftTree, outcome: TreeOutcome, context: int
                     ) -> StepRecord:
        """What a tree step leaves for the views; without the heads (dynamic:auto backing off) a
        step verified the chains alone."""
        shown = min(self.config.top_m, 10)
        head_ids = heads.token_ids[:, :shown].tolist() if heads is not None else []
        kind = StepKind.TREE if heads is not None else StepKind.CHAINS if draft.tree.num_nodes else StepKind.PLAIN
        return StepRecord(
            index=len(self.records), context_length=context, family=self.config.strategy, kind=kind,
            head_token_ids=head_ids, head_probs=heads.probs[:, :shown].tolist() if heads is not None else [],
            outcome=outcome, new_tokens=outcome.accepted_tokens + [outcome.bonus_token], times=PhaseTimes(),
            head_texts=[self._texts(row) for row in head_ids] if self.page.texts else [],
        )

    @staticmethod
    def _observe_chains(drafted: list[tuple[Drafter, list[Chain]]], draft: DraftTree,
                        accepted_tokens: list[int]) -> None:
        """Each chain drafter learns how deep its chains were verified and what was accepted."""
        depths = iter(draft.verified_chain_depths)
        for drafter, proposed in drafted:
            drafter.observe(proposed, [next(depths) for _ in proposed], accepted_tokens)


def start_session(base: BaseModel, heads: nn.Module | None, prompt: str | Sequence[int],
                  config: DecodeConfig, profile: CostProfile | None = None, *,
                  store: TokenStore | None = None, page: PageViews = PageViews()) -> DecodeSession:
    """Prefill `prompt` (text gets the chat template; a list of ids is used as is) and return a session
    (`page`: what it records beside its steps for the page)."""
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
    return DecodeSession(base, heads, prompt_ids, config, profile, store=store, page=page)


def decode(base: BaseModel, heads: nn.Module | None, prompt: str | Sequence[int], config: DecodeConfig,
           profile: CostProfile | None = None, *, store: TokenStore | None = None,
           page: PageViews = PageViews()) -> DecodeSession:
    """Run a prompt to the end; the finished session holds the output and every step record."""
    session = start_session(base, heads, prompt, config, profile, store=store, page=page)
    for _ in session.run():
        pass
    return session
