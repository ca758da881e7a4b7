"""A user's run from Start to the end: prefill, steps, Run to end, Stop, Reset, Check, and the run's facts.

Everything here changes or reads one user's `LabState`; nothing here draws (viz does, from the
`RunFacts` that `facts_of` returns) and nothing here knows Gradio (app.py maps the messages).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from core.decoder import start_session
from core.records import StepRecord
from core.tensor_thread import run_on_tensor_thread
from labstate.errors import LabInputError, LabNotice, SessionExpired
from labstate.limits import STEP_LOCK_TIMEOUT_S
from labstate.plain import ar_baseline, compute_check, greedy_check, speed_vs_plain
from labstate.modes import RUNNING, STOPPED
from labstate.runs import Prepared, Run, page_views, prepare
from labstate.shared import cost_profile, measure_forward_seconds
from labstate.sessions import LabState, SessionRegistry
from labstate.settings import Settings
from viz.facts import RunFacts, RunStats, summary
from labstate.trace import trace_json


T = TypeVar("T")


def acquire(lab: LabState) -> None:
    """Take the user's step lock (a session is not thread-safe); LabNotice when a step holds it too long."""
    if not lab.lock.acquire(timeout=STEP_LOCK_TIMEOUT_S):
        raise LabNotice("Still busy with the previous step; try again in a moment.")


def start_prepared(lab: LabState, prepared: Prepared) -> Run:
    """Prefill a prepared prompt and make it the current run (the previous run is dropped).

    Tree strategies also take the verify-cost profile (measured once per precision, then cached on
    disk; a provisional one while it is measured in the background): auto budget sizes trees with it.
    """
    rt, config = prepared.runtime, prepared.config
    profile = cost_profile(rt, wait=False) if config.spec.drafts else None  # provisional until measured
    lab.interrupt()  # a Run loop on the previous run stops
    acquire(lab)
    try:
        session = run_on_tensor_thread(start_session, rt.base, rt.heads_for(config.strategy), prepared.prompt_ids,
                                       config, profile if config.auto_budget else None,
                                       page=page_views(prepared.settings, rt))
        precision = prepared.settings.precision
        if precision not in lab.forward_seconds:
            lab.forward_seconds[precision] = measure_forward_seconds(rt.base, session.prompt_ids)
    except ValueError as error:  # core's own checks (prompt too long for the context, tree too deep)
        raise LabInputError(str(error)) from error
    finally:
        lab.lock.release()
    lab.run = Run(prompt=prepared.prompt, settings=prepared.settings, runtime=rt, session=session,
                  note=prepared.note)
    return lab.run


def start_run(lab: LabState, prompt: object, settings: Settings) -> Run:
    """Check, tokenize and prefill `prompt` and make it the current run."""
    return start_prepared(lab, prepare(prompt, settings))


def _finished_notice(run: Run) -> LabNotice:
    return LabNotice(f"Decoding has finished ({run.session.stop_reason}). Press Start for a new run.")


DROPPED_STEP = "Stopped: a Step clicked before Stop was dropped."
STOPPED_MESSAGE = "Stopped. **Step** or **Run to end** go on from here."


def step_run(lab: LabState, run: Run, epoch: int | None = None, clicked_at: float | None = None) -> StepRecord | None:
    """One decoding step of `run` (serialised per user).

    With `epoch` (the state's epoch when the step was asked for), a step that waited for the lock
    while Stop, Start or Reset happened is dropped: None, nothing stepped. With `clicked_at` (the
    page's clock at the click), so is one clicked before the last Stop. Both are checked under the
    lock: a Step that passed its early check just before Stop and read the epoch just after it
    would otherwise step once Stop had drawn the run as stopped.
    """
    return _locked_steps(lab, run, epoch, clicked_at, run.session.step)


def step_burst(lab: LabState, run: Run, epoch: int, clicked_at: float | None, seconds: float) -> int | None:
    """Steps of `run` back to back on the tensor thread for up to `seconds` (at least one), ending after
    the step in flight when the run finishes or Stop, Start, Reset or eviction bump the epoch; the number
    of steps, or None when dropped (as `step_run`). Why: handing each step to the tensor thread woke the
    request's thread and the tensor thread once a step, and on a machine whose cores the decoding's
    OpenMP team fills, each wake-up preempts it (2-core EPYC, one process, `dynamic:auto+lookup`: the
    tensor thread preempted ~370 times in a 122-step run against ~7 with the steps back to back, 5.98 /
    5.53 ms a step against 5.71 / 5.28)."""
    def burst() -> int:
        deadline, count = time.monotonic() + seconds, 0
        while True:
            run.session.step()
            count += 1
            if (run.session.finished or lab.epoch != epoch or lab.run is not run
                    or time.monotonic() >= deadline):
                return count
    return _locked_steps(lab, run, epoch, clicked_at, burst)


def _locked_steps(lab: LabState, run: Run, epoch: int | None, clicked_at: float | None,
                  work: Callable[[], T]) -> T | None:
    """`work` (one step or a burst) on the tensor thread under the user's lock, unless dropped: None."""
    if run.session.finished:
        raise _finished_notice(run)
    acquire(lab)
    try:
        if epoch is not None and (lab.epoch != epoch or lab.run is not run):
            return None
        if lab.clicked_before_stop(clicked_at):
            return None
        if run.session.finished:  # another request finished it while this one waited
            raise _finished_notice(run)
        run.stepping = True
        try:
            return run_on_tensor_thread(work)  # a finished session frees its own KV cache
        finally:
            run.stepping = False
    finally:
        lab.lock.release()


def wait_idle(lab: LabState) -> None:
    """Return once no step of this user is in flight (Stop waits for it, so the page shows what really ran)."""
    acquire(lab)
    lab.lock.release()


def start_fresh(lab: LabState, prompt: str, settings: Settings) -> str:
    """Start (or restart) `prompt`: every check before the session is touched, then the prefill."""
    start_prepared(lab, prepare(prompt, settings))
    return ""


def ensure_run(lab: LabState, prompt: str, settings: Settings) -> tuple[Run, str]:
    """The current run, or a new one when there is none (so Step and Run also start), and a note when
    the prompt or settings changed under a run that goes on."""
    run = lab.run
    changed = run is not None and (prompt != run.prompt or settings != run.settings)
    if run is not None and not run.session.finished:
        if changed:  # bad new settings are reported while the run goes on; the prompt box is not read
            prepare(run.prompt, settings)
        return run, "Prompt or settings changed: press **Start** to apply them." if changed else ""
    if changed:
        prepare(prompt, settings)
    if run is not None and not changed:
        raise _finished_notice(run)
    return start_run(lab, prompt, settings), ""


def step_once(lab: LabState, prompt: str, settings: Settings, clicked_at: float | None = None) -> str:
    """One decoding step (starting a run first when there is none); the message for the status line.

    `clicked_at` is the page's clock at the click: a Step clicked before the last Stop is dropped.
    """
    if lab.clicked_before_stop(clicked_at):
        return DROPPED_STEP
    run, changed = ensure_run(lab, prompt, settings)
    epoch = lab.epoch
    if step_run(lab, run, epoch, clicked_at) is None:
        return DROPPED_STEP
    lab.pause_after_step(run, epoch)
    if run.session.finished:
        compute_check(lab, run)
    return changed


class RedrawPacer:
    """Says when a run's progress is due for a redraw: the first time it is asked, always (by
    construction, not by the clock's value: a monotonic clock counts from boot, so a machine up for less
    than `interval_s` must still draw the first step), then once `interval_s` has passed since the last."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._drawn_at: float | None = None

    def due(self) -> bool:
        """True when a redraw should go out now (and counts it as drawn)."""
        now = self.clock()
        if self._drawn_at is not None and now - self._drawn_at < self.interval_s:
            return False
        self._drawn_at = now
        return True


def most_accepted_step(run: Run | None) -> int | None:
    """The first step of a finished run that emitted the most tokens (0-based), or None: where a page
    opens once Run to end is done (its last step is often a lone root at the end of the answer)."""
    if run is None or not run.session.finished or not run.session.records:
        return None
    records = run.session.records
    return max(range(len(records)), key=lambda i: (len(records[i].new_tokens), -i))


def run_to_end(lab: LabState, prompt: str, settings: Settings, alive: Callable[[], bool],
               clicked_at: float | None = None, burst_s: float = 0.0) -> Iterator[str]:
    """Step to the end, yielding the status message after every step (the caller redraws), or, with
    `burst_s`, after the first step and then after every burst of steps that long (`step_burst`: the
    page redraws no more often anyway).

    Stops between steps when `alive()` turns false (the session was evicted: SessionExpired) or when
    Stop, Start or Reset bumped the state's epoch (quietly). The caller may also close the generator.
    A Run clicked (page clock `clicked_at`) before the last Stop does nothing.
    """
    if lab.clicked_before_stop(clicked_at):
        yield "Stopped: a Run clicked before Stop was dropped."
        return
    run, note = ensure_run(lab, prompt, settings)
    epoch = lab.epoch
    run.mode = RUNNING
    stepped_once = False  # the first step alone: the page shows a step at once, then bursts
    try:
        while not run.session.finished:
            if not alive():
                raise SessionExpired("Your session expired while running (the lab needed room). Press **Start** "
                                     "to begin again.")
            if lab.run is not run:
                return
            stepped = (step_burst(lab, run, epoch, clicked_at, burst_s) if stepped_once and burst_s > 0
                       else step_run(lab, run, epoch, clicked_at))
            if stepped is None:
                return
            stepped_once = True
            yield note if not run.session.finished else "Comparing with plain greedy decoding…"
    finally:
        lab.pause_after_loop(run)
    compute_check(lab, run)
    if lab.run is run:
        yield note


def check_now(lab: LabState | None) -> str:
    """Run plain greedy decoding now and compare the output so far; the verdict in words."""
    run = require_run(lab)
    compute_check(lab, run)
    check = greedy_check(lab, run)
    return f"Compared with a plain greedy run of this prompt: {check.text}."


def reset(lab: LabState | None) -> None:
    """Forget the current run (cached plain runs stay)."""
    if lab is not None:
        lab.interrupt()
        lab.run = None


def stop(lab: LabState | None, clicked_at: float | None = None) -> str:
    """Stop a running Run (and any Step waiting for its turn, or clicked before `clicked_at`, the page's
    clock at the Stop click); returns once the step in flight ended."""
    if lab is None or lab.run is None:
        return "Nothing to stop."
    lab.stop(clicked_at)
    wait_idle(lab)
    return STOPPED_MESSAGE


def run_end_message(lab: LabState, latest: str) -> str:
    """The message of a Run loop's last redraw: Stop's own words when a Stop ended it (that redraw and
    Stop's answer race to the page, so both say the same), else the loop's latest message."""
    run = lab.run
    if run is not None and run.mode == STOPPED and not run.session.finished:
        return STOPPED_MESSAGE
    return latest


def require_run(lab: LabState | None) -> Run:
    """The current run, or a notice that there is none yet."""
    if lab is None or lab.run is None:
        raise LabNotice("Nothing to check yet: press Start or Step first.")
    return lab.run


def decoding_state(sessions: SessionRegistry, key: str, client: str = "") -> LabState:
    """The session's state for Step and Run: created when new (for `client`), SessionExpired when it was
    dropped."""
    lab = sessions.get(key)
    return lab if lab is not None else sessions.open(key, client)


def facts_of(lab: LabState, run: Run) -> RunFacts:
    """What the views draw of the user's current run (reads stored results; never decodes)."""
    session, rt = run.session, run.runtime
    decode_seconds = sum(r.times.total for r in session.records)
    emitted = max(len(session.output_ids) - 1, 0)  # the first token comes from the prefill
    check = greedy_check(lab, run)
    speed = speed_vs_plain(lab, run)
    stats = RunStats(tokens=len(session.output_ids), steps=len(session.records), mean_accepted=session.tokens_per_step,
                     tokens_per_s=emitted / decode_seconds if decode_seconds > 0 else 0.0, status=run.state,
                     check=check.text, check_state=check.state, vs_plain=speed.ratio, vs_plain_basis=speed.basis,
                     vs_plain_why=speed.why, page_ms=_per_step_ms(run.page_seconds, len(session.records)))
    first = session.output_ids[0]
    first_text = session.records[0].outcome.node_texts[0] if session.records else rt.base.token_texts([first])[0]
    return RunFacts(prompt=run.prompt, spec=run.settings.spec, settings=run.settings.raw(), records=session.records,
                    output_ids=list(session.output_ids), first_text=first_text, text=rt.base.decode(session.output_ids),
                    token_bytes=rt.token_bytes, stats=stats, check=asdict(check), ar=ar_baseline(lab, run),
                    state=run.state, note=run.note, finished=session.finished, stop_reason=session.stop_reason,
                    model=rt.base.source, heads=rt.heads_description)


def note_page_time(lab: LabState | None, seconds: float) -> None:
    """Record time the page spent on the current run outside its decoding steps (drawing a view, its
    figures and tables; a pause left to a browser on this machine to draw): shown beside the speed,
    never counted in it."""
    if lab is not None and lab.run is not None:
        lab.run.page_seconds.append(seconds)


def note_page_draw(lab: LabState | None, seconds: float, drawn: bool) -> None:
    """Record a wait for a browser on this machine to draw a redraw (page time), and whether it said it
    had drawn within the wait (the trace counts both)."""
    note_page_time(lab, seconds)
    if lab is not None and lab.run is not None:
        lab.run.draws_awaited.append(drawn)


def _per_step_ms(seconds: list[float], steps: int) -> float | None:
    """The page's time over the run's steps (a Run to end draws once for many steps, Step once a step)."""
    return sum(seconds) * 1e3 / steps if seconds and steps else None


def run_trace(lab: LabState | None, extra: dict | None = None) -> str:
    """The user's run as JSON trace text (labstate.trace's format), with `extra` in its meta."""
    if lab is None or lab.run is None:
        raise LabNotice("Nothing to export yet: run a few steps first.")
    run = lab.run
    facts = facts_of(lab, run)
    meta = {**summary(facts, None), "text": facts.text, "prompt_ids": run.session.prompt_ids,
            "prefill_seconds": run.session.prefill_seconds, "decode_config": run.session.config,
            "page_seconds": sum(run.page_seconds), "draws_awaited": len(run.draws_awaited),
            "draws_drawn_in_time": sum(run.draws_awaited), **(extra or {})}
    return trace_json(facts, meta)


def record_lab(prompt: str, settings: Settings) -> LabState:
    """Decode `prompt` to its end in a private lab (no session, no page), checked against plain greedy."""
    lab = LabState()
    start_run(lab, prompt, settings)
    while not lab.run.session.finished:
        step_once(lab, prompt, settings)
    compute_check(lab, lab.run)
    return lab


def record_run(prompt: str, settings: Settings, extra: dict | None = None) -> str:
    """A whole run as trace text: what a ZeroGPU Space's Start decodes inside one GPU call before the page
    replays it (labstate.zerogpu), and what the gallery's recorder writes."""
    return run_trace(record_lab(prompt, settings), extra)


def export_trace(lab: LabState | None, folder: Path, keep_seconds: float) -> Path:
    """Write the user's run as a JSON trace under `folder` (older traces there are dropped first)."""
    text = run_trace(lab)
    folder.mkdir(parents=True, exist_ok=True)
    _drop_old_traces(folder, keep_seconds)
    path = folder / f"medusa_trace_{len(lab.run.session.records)}_steps_{uuid.uuid4().hex[:8]}.json"
    path.write_text(text, encoding="utf-8")
    return path


def _drop_old_traces(folder: Path, keep_seconds: float) -> None:
    """Delete traces older than `keep_seconds` (Gradio serves its own copy of each)."""
    cutoff = time.time() - keep_seconds
    for old in folder.glob("medusa_trace_*.json"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another worker removed it first
            pass
