"""The facts a view draws of one run, shared by labstate (live runs), replay and viz.

Plain dataclasses: no model, no torch, no plotting, so a recorded run (a trace) fills them as a
live run does, and every view is drawn by the same code from the same facts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from core.strategy import StrategySpec

if TYPE_CHECKING:
    from core.records import StepRecord


@dataclass(frozen=True)
class ArBaseline:
    """Autoregressive decoding for the cumulative plot: a measured plain run, or an estimate.

    step_seconds: wall seconds of each token of a real plain run (empty when estimated).
    seconds_per_token: a measured single-token forward, used when no plain run exists.
    """

    step_seconds: list[float] = field(default_factory=list)
    seconds_per_token: float | None = None

    @property
    def measured(self) -> bool:
        return bool(self.step_seconds)


def ratio_verdict(ratio: float) -> str:
    """wins / loses / ties for a speed ratio to plain decoding (within 5 %: a run's noise, no verdict)."""
    return "wins" if ratio >= 1.05 else "loses" if ratio < 0.95 else "ties"


@dataclass(frozen=True)
class RunStats:
    """Running totals shown above the plots."""

    tokens: int = 0
    steps: int = 0
    mean_accepted: float = 0.0
    tokens_per_s: float = 0.0
    status: str = "not started"
    check: str = ""  # the plain-greedy comparison, in words
    check_state: str = "na"  # ok | diff | pending | na
    vs_plain: float | None = None  # tokens/s over plain decoding's
    vs_plain_basis: str = ""  # measured plain run, or how it was estimated
    vs_plain_why: str = ""  # wins/loses and why (verify cost of the tree against one token)
    page_ms: float | None = None  # the page's own time over the run's steps (drawing its views); not decoding time


@dataclass(frozen=True)
class RunFacts:
    """One run as the views see it: its settings, its steps, its text and its yardsticks."""

    prompt: str
    spec: StrategySpec
    settings: dict[str, Any]  # every setting by name (the summary shows them)
    records: Sequence[StepRecord]
    output_ids: list[int]  # the prefill's token first
    first_text: str  # that token's text
    text: str  # the decoded output
    token_bytes: dict[int, bytes]  # raw bytes of the tokens drawn (labels join byte-level pieces)
    stats: RunStats
    check: dict[str, Any] = field(default_factory=dict)  # the plain-greedy comparison (labstate.GreedyCheck)
    ar: ArBaseline | None = None
    state: str = "paused"
    note: str = ""  # an adjustment made to the settings (e.g. a fixed tree cut to the depth)
    finished: bool = False
    stop_reason: str = ""
    model: str = ""
    heads: str = ""
    recording: str = ""  # a replayed run: its title (the page says live decoding is not involved)
    step_notes: dict[int, str] = field(default_factory=dict)  # replay: "what to notice" at a step (0-based)
    notice: str = ""  # replay: what the whole recorded run is there to show

    @property
    def budget(self) -> int:
        return int(self.settings.get("budget", 0))

    @property
    def greedy(self) -> bool:
        return float(self.settings.get("temperature", 0.0)) <= 0.0

    @property
    def strategy_label(self) -> str:
        return self.spec.with_budget(self.budget or None).label


def token_sources(records: Sequence[StepRecord]) -> dict[str, int]:
    """Emitted tokens by who proposed them: the heads, prompt lookup, the datastore, or the base model
    itself (every step's bonus token, and every token of a plain step)."""
    counts = {"heads": 0, "lookup": 0, "store": 0, "base model": 0}
    for record in records:
        outcome = record.outcome
        for node in outcome.accepted_nodes[1:]:
            source = outcome.node_source(node)
            counts[source if source in counts else "heads"] += 1
        counts["base model"] += 1
    return counts


def loops(output_ids: Sequence[int], width: int = 8, repeats: int = 3) -> bool:
    """True when the text's last 96 tokens repeat one `width`-token span `repeats` times or more (a loop:
    any drafter that copies earlier text accepts it all, so a speed-up there says little)."""
    tail = list(output_ids[-96:])
    seen: dict[tuple[int, ...], int] = {}
    for start in range(len(tail) - width + 1):
        span = tuple(tail[start:start + width])
        seen[span] = seen.get(span, 0) + 1
    return any(count >= repeats for count in seen.values())


def summary(facts: RunFacts, index: int | None) -> dict[str, Any]:
    """The run summary (the Text & summary tab and every trace's meta)."""
    stats = facts.stats
    custom = facts.settings.get("custom_tree") or "[]"
    settings = {**facts.settings, "family": facts.spec.family, "auto_budget": facts.spec.auto,
                "lookup": facts.spec.lookup, "store": facts.spec.store,
                "custom_tree": json.loads(custom) if isinstance(custom, str) else custom}
    return {
        "prompt": facts.prompt, "settings": settings, "tokens": stats.tokens, "steps": stats.steps,
        "mean_accepted": round(stats.mean_accepted, 4), "tokens_per_s": round(stats.tokens_per_s, 3),
        "vs_plain": None if stats.vs_plain is None else round(stats.vs_plain, 3), "vs_plain_basis": stats.vs_plain_basis,
        "finished": facts.finished, "stop_reason": facts.stop_reason, "state": facts.state,
        "viewing_step": None if index is None else index + 1, "output_ids": list(facts.output_ids),
        "greedy_check": facts.check, "nodes_per_step": [r.outcome.tree.num_nodes for r in facts.records],
        "model": facts.model, "heads": facts.heads,
    }
