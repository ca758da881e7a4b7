"""A run: one prompt decoded with fixed settings, started (checked, tokenized, prefilled) and stepped."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.decoder import DecodeConfig, DecodeSession, start_session
from core.records import StepRecord
from core.strategy import AUTOREGRESSIVE
from labstate.errors import LabInputError, LabNotice
from core.strategy import MAX_BUDGET, MAX_NEW_TOKENS
from labstate.limits import MAX_PROMPT_TOKENS, STEP_LOCK_TIMEOUT_S
from labstate.runtime import Runtime, cost_profile, measure_forward_seconds, runtime
from labstate.settings import Settings, decode_config

if TYPE_CHECKING:
    from labstate.sessions import LabState

# What the run is doing, for the status card (finished comes from the session itself).
READY, PAUSED, RUNNING, STOPPED = "ready", "paused", "running", "stopped"


@dataclass
class Run:
    """One prompt being decoded with fixed settings."""

    prompt: str
    settings: Settings
    runtime: Runtime
    session: DecodeSession
    note: str = ""
    mode: str = READY  # READY after Start, PAUSED after a Step, RUNNING inside Run to end, STOPPED after Stop

    @property
    def reference_key(self) -> tuple[str, str, int]:
        return self.prompt, self.settings.precision, self.settings.max_new_tokens

    @property
    def state(self) -> str:
        """The run's state in words: finished (why), running, stopped, paused after step N, or ready."""
        session = self.session
        if session.finished:
            return f"finished: {session.stop_reason}"
        steps = len(session.records)
        if self.mode == RUNNING:
            return "running"
        if self.mode == STOPPED:
            return f"stopped after step {steps}" if steps else "stopped"
        if steps:
            return f"paused after step {steps}: press Step"
        return "ready: press Step"


@dataclass(frozen=True)
class Prepared:
    """A checked prompt and settings, tokenized, ready to prefill (nothing touched a session yet)."""

    prompt: str
    settings: Settings
    runtime: Runtime
    prompt_ids: list[int]
    config: DecodeConfig
    note: str


def prepare(prompt: object, settings: Settings) -> Prepared:
    """Check the prompt (sanitized first: see `sanitize_prompt`) against the token limit and build the config."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise LabInputError("Type a prompt (or pick an MT-Bench example) first.")
    rt = runtime(settings.precision)
    config, note = decode_config(settings, rt.num_heads)
    try:
        prompt_ids = rt.base.chat_ids(prompt)
    except (TypeError, ValueError, UnicodeError) as error:  # sanitize_prompt should have made this impossible
        raise LabInputError(f"the prompt could not be tokenized ({error})") from error
    limit = min(MAX_PROMPT_TOKENS, rt.base.max_positions - MAX_NEW_TOKENS - MAX_BUDGET - 2)
    if len(prompt_ids) > limit:
        raise LabInputError(f"The prompt is {len(prompt_ids):,} tokens ({len(prompt):,} characters); the lab "
                            f"accepts prompts of up to {limit:,} tokens (the model's context is "
                            f"{rt.base.max_positions:,} tokens). Shorten it.")
    return Prepared(prompt=prompt, settings=settings, runtime=rt, prompt_ids=prompt_ids, config=config, note=note)


def acquire(lab: LabState) -> None:
    """Take the user's step lock (a session is not thread-safe); LabNotice when a step holds it too long."""
    if not lab.lock.acquire(timeout=STEP_LOCK_TIMEOUT_S):
        raise LabNotice("Still busy with the previous step; try again in a moment.")


def start_prepared(lab: LabState, prepared: Prepared) -> Run:
    """Prefill a prepared prompt and make it the current run (the previous run is dropped).

    Tree strategies also load the verify-cost profile (measured once per precision, then cached on
    disk): auto budget sizes trees with it, and the page explains speed against plain decoding with it.
    """
    rt, config = prepared.runtime, prepared.config
    profile = cost_profile(rt) if config.strategy != AUTOREGRESSIVE else None
    lab.interrupt()  # a Run loop on the previous run stops
    acquire(lab)
    try:
        session = start_session(rt.base, rt.heads_for(config.strategy), prepared.prompt_ids, config,
                                profile if config.auto_budget else None)
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


def step_run(lab: LabState, run: Run, epoch: int | None = None) -> StepRecord | None:
    """One decoding step of `run` (serialised per user).

    With `epoch` (the state's epoch when the step was asked for), a step that waited for the lock
    while Stop, Start or Reset happened is dropped: None, nothing stepped.
    """
    if run.session.finished:
        raise _finished_notice(run)
    acquire(lab)
    try:
        if epoch is not None and (lab.epoch != epoch or lab.run is not run):
            return None
        if run.session.finished:  # another request finished it while this one waited
            raise _finished_notice(run)
        return run.session.step()  # a finished session frees its own KV cache
    finally:
        lab.lock.release()


def wait_idle(lab: LabState) -> None:
    """Return once no step of this user is in flight (Stop waits for it, so the page shows what really ran)."""
    acquire(lab)
    lab.lock.release()
