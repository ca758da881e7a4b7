"""The adaptive budget (`dynamic:auto`): how much of the best-first tree to verify each step.

One object per session: `choose` keeps the prefix of the tree's best-first order that
maximises expected tokens per ms (`core.budget.cost_profile.best_prefix`), `observe` learns from each
step record: the heads' acceptance per depth (calibration, from the heads' own scores only:
a chain grafted onto a head node must not inflate it), and the tokens per ms that steps with
and without the heads actually delivered (the back-off rule in `core.budget.cost_profile`'s docstring).

The profile is a prior, not the truth: it may have been measured on a busy machine or before
a code change. Every step's verify time is compared with what the profile predicted for its
size, and the costs the controller uses are the profile's scaled by the median measured/predicted
ratio of recent steps, separately for one-token forwards and trees. So that the one-token cost
is always measured, not assumed, the run makes a plain step (no heads, no chains) early on and
again whenever none ran for PROBE_EVERY steps: a wrong profile is corrected within a few steps.
Probes that agree with what was measured come rarer (up to MAX_PROBE_EVERY steps apart).

No lock-in: a back-off acts on the tree steps measured so far, which then no longer count (the
next decision needs fresh ones); the heads' calibration fades (`DepthCalibration`); a head step
that verified the root alone counts in no measured rate; and once no tree ran for `explore_after`
steps (a whole back-off, or a spent loss allowance), one step verifies the best node anyway
("exploring"), so the heads' evidence can change. Explores that fail come rarer (doubling up to
MAX_EXPLORE_AFTER steps apart); a tree the heads got right brings them back to MIN_EXPLORE_AFTER.
`state` names what the controller does each step (a `ControllerState`); the decoder keeps it in the
step record.

The decoder reaches it through one entry point per phase: `plan` before drafting (which drafters run,
and the step's node budget: the most nodes drafted, built and verified), `chains_may_pay` before a tree
of chains alone is built (no: the step is plain), `choose` once the tree is built (the prefix worth
verifying; a heads' tree also pays `tree_overhead_ms`, what accepting and committing a tree costs beyond
a root-only step), `observe` after the step. A strategy without `auto` gets a
`FixedBudget` with the same three methods, so the decoder never asks whether a controller exists.

A loss allowance bounds what the heads may cost a run (`LossLedger`; "budget" means nodes): every
step that ran the heads is charged its measured time minus what its tokens would have cost at the
rate of the run's steps without the heads (a paying tree books a gain; gains fade by GAIN_DECAY per
step, losses never).
The allowance is LEDGER_START_STEPS plain steps plus LOSS_SHARE of the run's time so far, and a tree
is only verified if it stays within the allowance when it accepts nothing: the tree is cut to the
largest prefix whose cost beyond a plain step fits the room left, and the heads are skipped when
not even one node fits, except for explores (one node, charged like any other step). So trees
grow as they earn, and a run the heads cannot guess loses about half a plain step plus LOSS_SHARE
of its time, plus its failed explores; room comes back through evidence (a right explore books a
gain), not through forgetting.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Protocol

from core.budget.cost_profile import CostProfile, DepthCalibration, best_prefix, plain_rate
from core.drafters.interface import Chain
from core.records import StepKind, StepRecord
from core.tree_policy import DraftTree

RATE_STEPS = 24  # steps a measured rate averages
MIN_RATE_STEPS = 12  # fewer steps than this: no measured rate yet
OVERHEAD_STEPS = 16
MAX_BACKOFF = 16
PROBE_EVERY = 32  # a plain step at least this often (steps 1, 3, 5 first): the run measures plain speed
MAX_PROBE_EVERY = 128  # ... and at most this rarely, while probes keep agreeing
PROBE_AGREEMENT = 0.15  # a probe within 15 % of the median plain cost agrees
FIRST_EXPLORE_AFTER = 8  # steps without a tree before the first explore ...
MIN_EXPLORE_AFTER = 2  # ... after a tree the heads got right (they may be in a good streak) ...
MAX_EXPLORE_AFTER = 128  # ... and at most this rarely, doubling while explores fail
DRAFT_LIMIT_STEPS = 8  # heads steps whose tree sizes bound the next draft (`AutoBudget.draft_limit`) ...
DRAFT_LIMIT_AGE = 96  # ... among the last this many steps
FIRST_DRAFT_LIMIT = 4  # ... and what the first heads step drafts
EXPLORE_NODES = 1  # nodes an exploring step verifies at least (the cheapest tree that measures the heads)
EXPLORE_MAX_LOSS = 0.5  # no explores where such a tree, accepting nothing, loses more plain steps than this
CORRECTION_STEPS = 16  # measured/predicted ratios a cost correction takes the median of


MIN_CORRECTION_SAMPLES = 3  # fewer measurements of a class: trust the profile (one slow step proves little)
STALE_TREE_STEPS = 2 * PROBE_EVERY  # tree measurements older than this are forgotten
LEDGER_START_STEPS = 0.5  # the heads may lose this many plain steps' time before any evidence ...
LOSS_SHARE = 0.02  # ... plus this share of the run's time so far
GAIN_DECAY = 0.98  # per step: banked gains fade (losses never do)
# Why these: a stricter ledger (half a plain step, 1.5 %, no fading, no explores in debt) put bf16
# MT-Bench's hydra:auto in back-off for 538 of 864 steps (acceptance comes in streaks): 1.08x plain
# against 1.37x without it. Losses that fade 2 % a step let streaks recover but gave unguessable text
# its trees back every ~10 steps (random letters 0.76x, bf16). So losses never fade and recovery
# comes from evidence (cheap 1-node explores, sooner after a right tree). tests/test_auto.py's
# synthetic runs, worst of 10 seeds, fading ledger -> this one: 40 steps the heads never guess 0.939
# -> 0.970x plain, 128 such steps 0.933 -> 0.976x, heads right 10 % 0.934 -> 0.971x, 8-step streaks
# 1.205 -> 1.190x, 32-step streaks 1.240 -> 1.159x, heads right 50 % 1.252 -> 1.269x, 80 % 1.951x.


class ControllerState(StrEnum):
    """What the adaptive budget does at a step (the step record keeps its text)."""

    OFF = ""  # a strategy sized by its budget alone: no controller
    NORMAL = "normal"
    PROBING = "probing"  # a plain step, to measure plain speed
    BACKING_OFF = "backing off"  # plain steps: trees did not pay, or the loss allowance is spent
    EXPLORING = "exploring"  # one node, to measure the heads again


@dataclass(frozen=True)
class StepPlan:
    """The controller's decision before a step drafts."""

    state: ControllerState
    heads: bool  # the heads (or the draft layer) propose this step
    chains: bool  # the chain drafters propose (False on a plain probe)
    max_nodes: int  # the step's node budget: the most nodes drafted, built and verified


class NodeBudget(Protocol):
    """How a session sizes its trees: `AutoBudget` (`auto`) or `FixedBudget`."""

    def plan(self, budget: int) -> StepPlan: ...

    def chains_may_pay(self, chains: list[Chain], context: int) -> bool: ...

    def choose(self, draft: DraftTree, heads_used: bool, context: int) -> int: ...

    def observe(self, record: StepRecord) -> None: ...


class FixedBudget:
    """A strategy sized by its budget alone: every step drafts and verifies up to `budget` nodes."""

    def plan(self, budget: int) -> StepPlan:
        """Every drafter, the whole budget."""
        return StepPlan(ControllerState.OFF, heads=True, chains=True, max_nodes=budget)

    def chains_may_pay(self, chains: list[Chain], context: int) -> bool:
        """Always: the chains are verified whatever they cost."""
        return True

    def choose(self, draft: DraftTree, heads_used: bool, context: int) -> int:
        """The whole tree."""
        return draft.tree.num_nodes

    def observe(self, record: StepRecord) -> None:
        """Nothing to learn."""


@dataclass
class LossLedger:
    """What the heads cost this run beyond plain decoding, against an allowance that grows with the run.

    `charge` books one heads step: its time minus its tokens at the no-heads rate (negative when
    the tree paid). `elapsed_ms` counts every step. Pure bookkeeping: `AutoBudget` decides."""

    loss_ms: float = 0.0
    elapsed_ms: float = 0.0

    def fade(self) -> None:
        """One step passed: banked gains count a little less (so a good stretch long ago does not
        fund a long bad one). Losses never fade: the heads win room back only by paying."""
        if self.loss_ms < 0:
            self.loss_ms *= GAIN_DECAY

    def charge(self, step_ms: float, tokens: int, ms_per_token: float) -> None:
        """Book one heads step: its time minus what its tokens cost without the heads."""
        self.loss_ms += step_ms - tokens * ms_per_token

    def allowance_ms(self, plain_step_ms: float) -> float:
        """What the heads may have lost by now: LEDGER_START_STEPS plain steps + LOSS_SHARE of the run."""
        return LEDGER_START_STEPS * plain_step_ms + LOSS_SHARE * self.elapsed_ms

    def room_ms(self, plain_step_ms: float) -> float:
        """What the heads may still lose before they exceed the allowance."""
        return self.allowance_ms(plain_step_ms) - self.loss_ms


@dataclass
class CostCorrection:
    """Measured over profiled verify time of recent steps, for one-token forwards and for trees.

    Tree measurements that grew stale (no tree verified for STALE_TREE_STEPS steps, e.g. after
    a burst of load made trees look dear and the controller stopped building them) are dropped,
    so the profile gets another chance instead of locking the run into plain steps."""

    plain: list[float] = field(default_factory=list)
    tree: list[float] = field(default_factory=list)
    last_tree_step: int = 0
    # each class's factor, kept current by `add` and `forget_stale`: the controller reads it for
    # every tree size it weighs, several times a step
    plain_factor: float = 1.0
    tree_factor: float = 1.0

    def add(self, tokens: int, measured_ms: float, profiled_ms: float, step: int = 0) -> None:
        if tokens > 1:
            self.last_tree_step = step
        ratios = self.plain if tokens == 1 else self.tree
        ratios.append(measured_ms / max(profiled_ms, 1e-6))
        del ratios[:-CORRECTION_STEPS]
        if tokens == 1:
            self.plain_factor = _median_or_one(ratios)
        else:
            self.tree_factor = _median_or_one(ratios)

    def forget_stale(self, step: int) -> None:
        if self.tree and step - self.last_tree_step > STALE_TREE_STEPS:
            self.tree.clear()
            self.tree_factor = 1.0

    def factor(self, tokens: int) -> float:
        """The median ratio of the class `tokens` falls in (1.0 before MIN_CORRECTION_SAMPLES)."""
        return self.plain_factor if tokens == 1 else self.tree_factor


def _median_or_one(ratios: list[float]) -> float:
    return statistics.median(ratios) if len(ratios) >= MIN_CORRECTION_SAMPLES else 1.0


@dataclass
class RollingRate:
    """Tokens and seconds of the last `size` steps of one kind, as running sums (the controller
    reads its rates several times a step: summing a window of records each time cost ~0.1 ms a step)."""

    size: int = RATE_STEPS
    steps: deque = field(default_factory=deque)  # (tokens, seconds), oldest first
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds
        if len(self.steps) > self.size:
            old_tokens, old_seconds = self.steps.popleft()
            self.tokens -= old_tokens
            self.seconds -= old_seconds

    def clear(self) -> None:
        self.steps.clear()
        self.tokens, self.seconds = 0, 0.0

    def __len__(self) -> int:
        return len(self.steps)

    def tokens_per_ms(self) -> float:
        return self.tokens / (1000 * self.seconds)


@dataclass(frozen=True)
class CorrectedProfile:
    """A cost profile scaled by what this run measured (same `cost` interface as CostProfile)."""

    profile: CostProfile
    correction: CostCorrection

    def cost(self, tokens: int, context: int | None = None) -> float:
        return self.profile.cost(tokens, context) * self.correction.factor(tokens)

    def costs(self, count: int, context: int | None = None) -> list[float]:
        """`[cost(1, context), ..., cost(count, context)]` (`CostProfile.costs`)."""
        return [ms * self.correction.factor(tokens)
                for tokens, ms in enumerate(self.profile.costs(count, context), start=1)]


@dataclass
class AutoBudget:
    """Per-session state of the adaptive budget."""

    profile: CostProfile
    calibration: DepthCalibration = field(default_factory=DepthCalibration)
    plain_steps: RollingRate = field(default_factory=RollingRate)  # the last steps without the heads
    tree_steps: RollingRate = field(default_factory=RollingRate)  # ... with a head tree, since the last back-off
    recent: deque = field(default_factory=lambda: deque(maxlen=OVERHEAD_STEPS))  # (heads used, non-verify ms, accept ms)
    tree_finishes: deque = field(default_factory=lambda: deque(maxlen=OVERHEAD_STEPS))  # accept + commit ms, a tree verified
    root_finishes: deque = field(default_factory=lambda: deque(maxlen=OVERHEAD_STEPS))  # ... the root alone
    head_sizes: deque = field(default_factory=lambda: deque(maxlen=DRAFT_LIMIT_STEPS))  # (step, nodes) of heads steps
    last_context: int | None = None  # the cache length of the last step (None before any)
    plain_until: int = 0  # steps before this index skip the heads (backing off)
    backoff: int = 0  # length of the current back-off
    steps: int = 0
    correction: CostCorrection = field(default_factory=CostCorrection)
    last_plain: int | None = None  # index of the last plain (one-token) step
    evidence_from: int = 0  # tree steps before this step no longer count (a back-off acted on them)
    probe_every: int = PROBE_EVERY  # grows while probes keep agreeing with what was measured
    exploring: bool = False  # this step verifies a small tree even if none looks worth it (stale evidence)
    last_tree_step: int = 0  # index of the last step that verified a head tree
    explore_after: int = FIRST_EXPLORE_AFTER  # steps without a tree before exploring
    ledger: LossLedger = field(default_factory=LossLedger)  # what the heads cost beyond plain decoding

    @property
    def state(self) -> ControllerState:
        """What the controller does this step: probing (a plain step to measure plain speed),
        backing off (plain steps: trees did not pay, or the loss allowance is spent), exploring (one
        node to measure the heads again after a back-off or under a spent loss allowance) or normal."""
        if self.probe_plain():
            return ControllerState.PROBING
        if self.steps < self.plain_until:
            return ControllerState.BACKING_OFF
        if not self.within_loss_allowance():
            return ControllerState.EXPLORING if self.explore_due() else ControllerState.BACKING_OFF
        if self.backoff and self.explore_due():
            # no tree for a whole back-off: the heads' evidence is stale. Due until a tree is
            # verified (a step the loss allowance kept plain leaves it due)
            return ControllerState.EXPLORING
        return ControllerState.NORMAL

    def plan(self, budget: int) -> StepPlan:
        """This step's drafters and node budget: none on a probe; the heads only while they may pay
        (`use_heads`); at most `budget` nodes and at most `draft_limit` (every node drafted costs: a
        grower's depths, a dynamic tree's best-first search and the choice over it)."""
        state = self.state
        if state == ControllerState.PROBING:
            return StepPlan(state, heads=False, chains=False, max_nodes=0)
        return StepPlan(state, heads=self.use_heads(state), chains=True, max_nodes=min(budget, self.draft_limit()))

    @property
    def costs(self) -> CorrectedProfile:
        """The verify costs the controller decides by: the profile, corrected by this run's steps."""
        return CorrectedProfile(self.profile, self.correction)

    def use_heads(self, state: ControllerState | None = None) -> bool:
        """False while backing off (the heads cannot pay at the moment, or they spent the run's
        loss allowance) or while probing; True for an exploring step (`state`: this step's, when the
        caller has it)."""
        return (state if state is not None else self.state) in (ControllerState.NORMAL, ControllerState.EXPLORING)

    def explore_due(self) -> bool:
        """True once no tree ran for `explore_after` steps (the heads' evidence is getting stale)
        and a one-node tree that accepts nothing would lose at most EXPLORE_MAX_LOSS plain steps."""
        if self.steps - self.last_tree_step < self.explore_after:
            return False
        context = self.last_context
        plain_ms = self._plain_ms_per_token(context)
        worst_loss = self.costs.cost(EXPLORE_NODES + 1, context) + self.overhead_ms(heads_used=True) - plain_ms
        return worst_loss <= EXPLORE_MAX_LOSS * plain_ms

    def within_loss_allowance(self, nodes: int = 1, context: int | None = None) -> bool:
        """True when a heads step verifying `nodes` nodes stays within the run's loss allowance even
        if it accepts nothing."""
        return self.loss_fits(context)(nodes)

    def loss_fits(self, context: int | None = None) -> Callable[[int], bool]:
        """Whether a tree of n nodes on top of a `context`-token cache (default: the last step's)
        stays within the loss allowance if it accepts nothing; the rates it needs are read once."""
        context = context if context is not None else self.last_context
        plain_ms = self._plain_ms_per_token(context)
        room, overhead = self.ledger.room_ms(plain_ms), self.overhead_ms(heads_used=True)
        return lambda nodes: self.costs.cost(nodes + 1, context) + overhead - plain_ms <= room

    def draft_limit(self) -> int:
        """The most nodes worth drafting this step: twice the largest tree of the last
        DRAFT_LIMIT_STEPS heads steps, at least 2; FIRST_DRAFT_LIMIT before any. Why: Hydra grows its
        tree depth by depth and each depth reads its head's weights whatever the rows, so the full
        64-node growth took 3.8 ms (14 % of a plain step, bf16, Xeon with AMX) on steps that keep
        0-1 nodes, and the first steps' drafting is what the controller judges the heads' cost by (a
        63-node first draft, 2 ms on a 2-core Zen 5, put hydra:auto in back-off for 115 of 124 steps
        where hydra:3 ran 1.09x plain). A dynamic tree of 63 nodes costs 0.5 ms to build and choose
        from there (0.05-0.1 ms for 3). A tree that pays doubles the limit at the next step."""
        sizes = [nodes for step, nodes in self.head_sizes if self.steps - step <= DRAFT_LIMIT_AGE]
        return max(2, 2 * max(sizes)) if sizes else FIRST_DRAFT_LIMIT

    def affordable_nodes(self, most: int, context: int) -> int:
        """The largest tree size up to `most` that the loss allowance allows (0: the root alone)."""
        fits = self.loss_fits(context)
        low, high = 0, most  # cost grows with size: bisect
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        return low

    def _plain_ms_per_token(self, context: int | None = None) -> float:
        """What a token costs without the heads: measured over this run's recent steps without
        them once MIN_CORRECTION_SAMPLES ran, else the corrected profile's plain step."""
        if len(self.plain_steps) >= MIN_CORRECTION_SAMPLES:
            return 1.0 / self.plain_steps.tokens_per_ms()
        return 1.0 / plain_rate(self.costs, self.overhead_ms(heads_used=False), context)

    def probe_plain(self) -> bool:
        """True when this step must be plain (no heads, no chains) to measure plain speed: every
        other step from step 1 until MIN_CORRECTION_SAMPLES plain steps are measured, then whenever
        no plain step ran for PROBE_EVERY steps."""
        if self.steps == 0:
            return False
        if len(self.correction.plain) < MIN_CORRECTION_SAMPLES:
            return self.steps % 2 == 1
        return self.steps - self.last_plain >= self.probe_every

    def expected(self, draft: DraftTree) -> list[float]:
        """Expected acceptance of each node in best-first order: the heads' score corrected per
        depth by what was observed, or a chain's own estimate, whichever is larger."""
        return [max(self._head_expected(path, draft.head_scores.get(path)), draft.chain_scores.get(path, 0.0))
                for path in draft.tree.paths]

    def _head_expected(self, path: tuple[int, ...], score: float | None) -> float:
        return 0.0 if score is None else self.calibration.factor(len(path)) * score

    def chains_may_pay(self, chains: list[Chain], context: int) -> bool:
        """Whether `choose` could keep any node of a tree of these chains alone (a step without the
        heads) on top of a `context`-token cache. False saves building the tree, choosing from it
        and a tree step's accept for a step that is plain anyway (~0.6 ms a step on a 2-core Zen 3,
        a tenth of a plain step). Judged on every chain node's estimate, best first: nodes that
        chains share only merge (the larger estimate), so no tree of them expects more tokens at
        any size, and this is `choose`'s own price for chains."""
        nodes = sorted(((chance, depth) for chain in chains for depth, chance in enumerate(chain.chances, start=1)),
                       key=lambda node: (-node[0], node[1]))
        size, _ = best_prefix([chance for chance, _ in nodes], [depth for _, depth in nodes], self.costs,
                              self.overhead_ms(heads_used=False), context=context)
        return size > 0

    def tree_overhead_ms(self) -> float:
        """What accepting and committing a tree costs beyond a root-only step's token, measured over
        recent steps (0 before both kinds ran): the record, the accepted path's cache copy, the
        drafters' bookkeeping. Without it a heads' tree of one node looked worth verifying where its
        0.2-0.3 ms more (a 2-core Zen 3) made it lose. Chains alone are not charged it: their
        estimates learn only from chains verified, so a stricter price would also stop them learning
        (a first version that charged chains it and their build's ~0.5 ms verified 1.8 tokens a step
        on the second set's extraction-log-errors, where this one verifies 3.2)."""
        if not self.tree_finishes or not self.root_finishes:
            return 0.0
        return max(0.0, statistics.fmean(self.tree_finishes) - statistics.fmean(self.root_finishes))

    def choose(self, draft: DraftTree, heads_used: bool, context: int) -> int:
        """Nodes to keep (a prefix of the best-first order) on top of a `context`-token cache;
        updates the back-off when the heads ran."""
        tree = draft.tree
        expected, overhead = self.expected(draft), self.overhead_ms(heads_used)
        extra = self.tree_overhead_ms() if heads_used else 0.0
        uncut, rate = best_prefix(expected, tree.depths[1:], self.costs, overhead, context=context,
                                  tree_overhead_ms=extra)
        most = self.affordable_nodes(tree.num_nodes, context) if heads_used else tree.num_nodes
        size = uncut  # the loss allowance may cut the tree; whether trees pay is judged uncut
        if uncut > most:
            size, _ = best_prefix(expected[:most], tree.depths[1:most + 1], self.costs, overhead, context=context,
                                  tree_overhead_ms=extra)
        exploring = self.exploring = heads_used and size == 0 and self.state == ControllerState.EXPLORING
        if heads_used:  # a root-only step (nothing worth it, or nothing the loss allowance allows) backs off briefly
            self._update_backoff(size, rate, context)
        if exploring:  # without a verified tree the heads' evidence could never change
            size = min(EXPLORE_NODES, tree.num_nodes)  # even beyond the loss allowance: a cheap, charged try
        return size

    def observe(self, record: StepRecord) -> None:
        """Learn from one finished step (of any kind)."""
        heads_right = False  # a tree step accepted at least one node the heads proposed
        if _used_heads(record):
            heads_right = self._calibrate(record) > 0
            self.ledger.charge(1000 * record.times.charged, len(record.new_tokens),
                               self._plain_ms_per_token(record.context_length))
        self.ledger.elapsed_ms += 1000 * record.times.charged
        self.ledger.fade()
        if _tree_step(record):
            self.last_tree_step = self.steps
            if heads_right:  # explore again soon if the budget blocks the next trees
                self.explore_after = MIN_EXPLORE_AFTER
            if self.exploring and heads_right:
                self.backoff, self.plain_until = 0, self.steps + 1  # the heads are right again: fresh evidence
            elif self.exploring:
                self.explore_after = min(2 * self.explore_after, MAX_EXPLORE_AFTER)
        self.exploring = False
        self._remember(record)
        tokens = record.outcome.tree.num_nodes + 1
        self.correction.add(tokens, 1000 * record.times.verify, self.profile.cost(tokens, record.context_length),
                            self.steps)
        self.correction.forget_stale(self.steps)
        if tokens == 1:
            self._probe_measured(record)
            self.last_plain = self.steps
        self.steps += 1

    def _remember(self, record: StepRecord) -> None:
        """What later decisions read of a step: its rate, its time outside the verify, its tree size."""
        heads, charged = _used_heads(record), record.times.charged
        if not heads:
            self.plain_steps.add(len(record.new_tokens), charged)
        elif _tree_step(record) and record.index >= self.evidence_from:
            self.tree_steps.add(len(record.new_tokens), charged)
        if heads:
            self.head_sizes.append((self.steps, record.outcome.tree.num_nodes))
        self.recent.append((heads, 1000 * (charged - record.times.verify), 1000 * record.times.accept))
        finishes = self.tree_finishes if record.outcome.tree.num_nodes else self.root_finishes
        finishes.append(1000 * (record.times.accept + record.times.commit))
        self.last_context = record.context_length

    def _calibrate(self, record: StepRecord) -> int:
        """Feed the step's head nodes to the calibration; returns how many of them were accepted."""
        outcome = record.outcome
        head_scores = outcome.head_scores
        nodes = [n for n in range(1, outcome.tree.num_nodes + 1) if head_scores[n] is not None]
        head_nodes = set(nodes)
        accepted = 0  # accepted tokens that the heads proposed (the chain may accept beyond them)
        for node in outcome.accepted_nodes[1:]:
            if node not in head_nodes:
                break
            accepted += 1
        self.calibration.update([outcome.tree.depths[n] for n in nodes], [head_scores[n] for n in nodes], accepted)
        return accepted

    def _update_backoff(self, size: int, rate: float, context: int) -> None:
        plain = self.measured_rate(heads_used=False) or plain_rate(self.costs, self.overhead_ms(heads_used=False),
                                                                   context)
        measured = self.measured_rate(heads_used=True)
        # acceptance comes in streaks, so only a long record of tree steps clearly losing to plain
        # steps, or an expected rate far below plain, backs off for 16 steps; when no node is worth
        # verifying, the next 1, 2, 4 ... 16 steps are plain (reset once a tree pays again)
        if (measured is not None and measured < 0.9 * plain) or rate < 0.8 * plain:
            self.backoff = MAX_BACKOFF
            self.evidence_from = self.steps + 1  # acted on: later decisions need fresh tree steps
            self.tree_steps.clear()
        elif size == 0:
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
        else:
            self.backoff = 0
        self.plain_until = self.steps + 1 + self.backoff  # steps after this one

    def measured_rate(self, heads_used: bool) -> float | None:
        """Tokens per ms that the last 24 steps with (or without) a head tree actually delivered;
        None before 12 of them. Steps without the heads are plain or lookup-only ones; head steps
        that verified the root alone are neither (they paid the drafting for a plain step's
        token) and count in no rate; tree steps from before the last back-off no longer count."""
        steps = self.tree_steps if heads_used else self.plain_steps
        return steps.tokens_per_ms() if len(steps) >= MIN_RATE_STEPS else None

    def _probe_measured(self, record: StepRecord) -> None:
        """A one-token step: if the plain cost agrees with what was measured before (within
        PROBE_AGREEMENT), probes become rarer (up to MAX_PROBE_EVERY steps apart); if not, the
        evidence is thin again and they come back every PROBE_EVERY steps."""
        ratios = self.correction.plain
        if len(ratios) <= MIN_CORRECTION_SAMPLES:
            return
        previous = statistics.median(ratios[:-1])
        agrees = abs(ratios[-1] - previous) <= PROBE_AGREEMENT * previous
        self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY) if agrees else PROBE_EVERY

    def overhead_ms(self, heads_used: bool) -> float:
        """Mean non-verify time (draft, tree, accept, commit, node texts) of recent steps with or without heads.

        Verify times include the logits' projection (the profile measures it too). Before any plain
        step, a plain step's overhead is estimated by the tree steps' accept time.
        """
        same = [outside for heads, outside, _ in self.recent if heads == heads_used]
        if same:
            return sum(same) / len(same)
        accepts = [accept for heads, _, accept in self.recent if heads]
        if not heads_used and accepts:
            return sum(accepts) / len(accepts)
        return 2.0


def _used_heads(record: StepRecord) -> bool:
    return record.kind == StepKind.TREE


def _tree_step(record: StepRecord) -> bool:
    """A step that verified a tree the heads proposed (not the root alone)."""
    return _used_heads(record) and record.outcome.tree.num_nodes > 0
