"""Plain decoding as the yardstick: the greedy reference run, the exactness check and the speed comparison.

`compute_check` runs models (an event calls it); `greedy_check`, `ar_baseline` and `speed_vs_plain`
only read what is stored, so drawing a view never decodes anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.decoder import DecodeConfig, PageViews, decode
from core.exactness import bf16_rounding_step, divergence_from_margins, plain_margins
from core.records import StepKind
from core.strategy import AUTOREGRESSIVE
from core.tensor_thread import run_on_tensor_thread
from labstate.limits import MAX_REFERENCES
from viz.facts import ArBaseline, ratio_verdict

if TYPE_CHECKING:
    from core.records import StepRecord
    from labstate.runs import Run
    from labstate.sessions import LabState


@dataclass
class Reference:
    """A plain autoregressive run of the same prompt, precision and length (the greedy yardstick)."""

    output_ids: list[int]
    step_seconds: list[float]
    margins: list[tuple[float, float]] = field(default_factory=list)  # top-1/top-2 logits behind each plain token
    gaps: dict[int, float] = field(default_factory=dict)  # divergence position -> plain top-2 logit gap


@dataclass(frozen=True)
class GreedyCheck:
    """How this run's output compares with plain greedy decoding."""

    state: str  # ok | diff | pending | na
    text: str
    position: int | None = None
    logit_gap: float | None = None


@dataclass(frozen=True)
class PlainComparison:
    """This run's tokens/s against plain decoding's, and why it wins or loses."""

    ratio: float | None  # run tokens/s over plain tokens/s; None before the first step
    measured: bool  # True: a plain run of this prompt was timed; False: estimated
    basis: str  # where the plain figure comes from, in words
    why: str  # the ratio's own arithmetic, in words (`_why`)


def _divergence(ours: list[int], plain: list[int]) -> int | None:
    common = min(len(ours), len(plain))
    return next((i for i in range(common) if ours[i] != plain[i]), None)


def reference(lab: LabState, run: Run) -> Reference:
    """The plain greedy run for this prompt/precision/length, computed once per user and cached."""
    key = run.reference_key
    if key not in lab.references:
        config = DecodeConfig(spec=AUTOREGRESSIVE, max_new_tokens=run.settings.max_new_tokens)
        plain = run_on_tensor_thread(decode, run.runtime.base, None, run.session.prompt_ids, config,
                                     page=PageViews(texts=False))
        lab.references[key] = Reference(output_ids=list(plain.output_ids),
                                        step_seconds=[r.times.total for r in plain.records],
                                        margins=plain_margins(plain))
        while len(lab.references) > MAX_REFERENCES:
            lab.references.popitem(last=False)
    return lab.references[key]


def compute_check(lab: LabState, run: Run) -> None:
    """Run what the check needs (the plain run, the logit gap at a divergence) and store it for drawing."""
    if not run.settings.greedy or not run.settings.spec.drafts:
        return
    ref = reference(lab, run)
    ours = list(run.session.output_ids)
    position = _divergence(ours, ref.output_ids)
    if position is not None and position not in ref.gaps:
        # the margin the plain run itself chose by (no fresh forward, which could round differently)
        divergence = divergence_from_margins(ref.output_ids, ref.margins, ours)
        ref.gaps[position] = divergence.logit_gap if divergence else float("nan")


def greedy_check(lab: LabState, run: Run) -> GreedyCheck:
    """Compare the output so far with the stored plain greedy run (pending until `compute_check` ran)."""
    if not run.settings.greedy:
        return GreedyCheck("na", "sampling: no single right answer")
    if not run.settings.spec.drafts:
        return GreedyCheck("ok", "this is plain decoding")
    ref = lab.references.get(run.reference_key)
    ours = list(run.session.output_ids)
    position = _divergence(ours, ref.output_ids) if ref is not None else None
    if ref is None or (position is not None and position not in ref.gaps):
        return GreedyCheck("pending", "at the end (or Check)")
    if position is None:
        common = min(len(ours), len(ref.output_ids))
        if len(ours) == len(ref.output_ids):
            return GreedyCheck("ok", f"identical ({len(ours)} tokens)")
        return GreedyCheck("ok", f"identical so far ({common} of {len(ref.output_ids)} tokens)")
    gap = ref.gaps[position]
    steps = ""
    if run.settings.precision == "bf16" and position < len(ref.margins):
        steps = f" = {gap / bf16_rounding_step(ref.margins[position][0]):.0f} bf16 rounding steps"
    return GreedyCheck("diff", f"differs at token {position + 1} (plain top-2 logit gap {gap:.3g}{steps}: "
                               "a near-tie that tree and single-token forwards round differently)", position, gap)


MIN_OWN_PLAIN = 3  # this run's plain steps that measure plain decoding's speed
# from this many of its own plain steps on, a run compares with them rather than with the plain run of
# its prompt: they were timed beside its tree steps, under the same load (the page streaming to a browser
# on the same cores slowed a live run's steps by 8 % on a 2-core EPYC, where the plain run, timed once the
# run ended, ran unhindered: the card said 0.86x where the benchmark measured 0.98x)
OWN_PLAIN_FIRST = 8
MEASURING = ("measuring: the ratio to plain decoding comes once plain decoding of this prompt is timed "
             "(the auto budget's plain steps, the end of the run, or Check)")


def _plain_step(record: "StepRecord") -> bool:
    """A step that decoded one token with no tree built (the auto budget's probes and back-offs; at
    most a prompt lookup that found nothing): plain decoding's time, not a step that drafted nodes
    and then verified the root alone."""
    return record.kind == StepKind.PLAIN and record.times.total > 0 and record.times.tree == 0


def ar_baseline(lab: LabState, run: Run) -> ArBaseline:
    """The plain run's measured times when it exists, else the one-token forward estimate."""
    ref = lab.references.get(run.reference_key)
    if ref is not None:
        return ArBaseline(step_seconds=ref.step_seconds)
    return ArBaseline(seconds_per_token=lab.forward_seconds.get(run.settings.precision))


def _why(run: Run, ratio: float, plain_seconds: float) -> str:
    """The ratio's own arithmetic, every term measured in this run: tokens a step times plain decoding's
    time for one token, over the step's whole time (drafting, verify, accept and commit, averaged over
    every step, its plain ones included). The page's own time is not decoding time: shown apart."""
    records = run.session.records
    steps = len(records)
    if not steps:
        return ""
    emitted = max(len(run.session.output_ids) - 1, 0)
    tokens, plain_ms = emitted / steps, 1000 * plain_seconds

    def mean_ms(*phases: str) -> float:
        return 1000 * sum(getattr(r.times, phase) for r in records for phase in phases) / steps

    step_ms = mean_ms("heads", "tree", "verify", "accept", "commit")
    plain_steps = sum(1 for r in records if _plain_step(r))
    state = ratio_verdict(ratio)

    def ms(value: float) -> str:  # three figures: the products below come out as shown
        return f"{value:.3g}"

    sentence = (f"{state}: a step yields {tokens:.2f} tokens in {ms(step_ms)} ms (drafting "
                f"{ms(mean_ms('heads', 'tree'))} + verify {ms(mean_ms('verify'))} + accept and commit "
                f"{ms(mean_ms('accept', 'commit'))}, over its {steps} steps, {plain_steps} of them plain) where plain "
                f"decoding takes {ms(plain_ms)} ms a token: {tokens:.2f} × {ms(plain_ms)} / {ms(step_ms)} = "
                f"{ratio:.2f}×")
    if state != "loses":
        return sentence
    if not run.settings.auto_budget:
        return f"{sentence}; try “dynamic (auto) + prompt lookup” or a smaller budget"
    if not run.session.finished:
        return f"{sentence}; the auto budget keeps trees small until they measure faster"
    return sentence


def speed_vs_plain(lab: LabState, run: Run) -> PlainComparison:
    """This run's decoding tokens/s over plain decoding's, both timed by the steps' own clock
    (`PhaseTimes.total`, what the benchmark compares): plain decoding measured by the plain run of
    this prompt, else by this run's own plain steps (the auto budget's probes) once MIN_OWN_PLAIN
    ran; until then no ratio ("measuring"), never an estimate."""
    if not run.settings.spec.drafts:
        return PlainComparison(None, True, "this run is plain decoding: the yardstick", "")
    records = run.session.records
    seconds = sum(r.times.total for r in records)
    emitted = max(len(run.session.output_ids) - 1, 0)  # the first token comes from the prefill
    ref = lab.references.get(run.reference_key)
    own_plain = [r.times.total for r in records if _plain_step(r)]
    own_basis = f"measured: {len(own_plain)} plain steps of this run"
    if len(own_plain) >= OWN_PLAIN_FIRST:  # timed beside the tree steps, under the same load (the page's too)
        plain_rate, basis = len(own_plain) / sum(own_plain), own_basis
    elif ref is not None and ref.step_seconds:
        plain_rate, basis = len(ref.step_seconds) / sum(ref.step_seconds), "measured plain run"
    elif len(own_plain) >= MIN_OWN_PLAIN:
        plain_rate, basis = len(own_plain) / sum(own_plain), own_basis
    else:
        return PlainComparison(None, False, MEASURING, "")
    if not records or seconds <= 0:
        return PlainComparison(None, True, basis, "")
    ratio = (emitted / seconds) / plain_rate
    return PlainComparison(ratio, True, basis, _why(run, ratio, 1.0 / plain_rate))
