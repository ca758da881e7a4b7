"""Medusa Tree Lab: step through Medusa-style speculative decoding with a dynamic candidate tree.

Wiring only: `labstate` runs the decoder (core/), `viz` draws. Importing this module builds the
Blocks but launches nothing; `python app.py [--port N]` serves on 127.0.0.1 (port from --port,
else GRADIO_SERVER_PORT, else 7860).

API (gradio_client), every event returns the VIEW outputs listed in `VIEW_OUTPUT_NAMES`:
  start(prompt, **settings), step(prompt, **settings), run(prompt, **settings)  [run streams],
  view(step_index) (from 1), check(), reset(), stop(); trace() returns the JSON trace file.
The settings are `labstate.SETTING_NAMES`, each a named parameter with the page's default:
strategy (autoregressive | fixed | dynamic | dynamic:auto | dynamic:auto+lookup), budget, top_m,
depth, fixed_preset (a shipped tree or "custom"), rule, temperature, precision, max_new_tokens,
compare_fixed, custom_tree (JSON list of rank paths, read when fixed_preset is "custom").

Bad input (empty or oversized prompt, out-of-range or mistyped settings, a malformed custom tree)
gets a readable message and changes nothing: API callers (gradio_client, which sends
`x-gradio-user: api`, and plain-HTTP /call/ requests) get `gr.Error(message)`, i.e. gradio_client
raises `AppError(message)`; the page keeps its view and shows the message in the status line and a
warning toast. Inputs reach the handlers unprocessed (`preprocess=False`) so that every value,
whatever its JSON type, is checked by `labstate` and never trips a component's own conversion.
Notes that are not errors (run finished, session expired, prompt cleaned) go to the status line
and a warning toast for everyone. Unexpected exceptions are logged and reported as a short error.
All of that happens in one place, `_answer`.

Sessions: each browser tab / API client (Gradio session hash) owns a LabState in a server-side
`labstate.SessionRegistry`: at most MEDUSA_LAB_MAX_SESSIONS (32) live, each dropped after
MEDUSA_LAB_SESSION_IDLE_S (1200 s) idle or when its tab closes; when full, the least recently used
idle one is evicted and its owner told to press Start. Decoding events share one queue slot pool
of MEDUSA_LAB_CONCURRENCY (2); the queue holds at most MEDUSA_LAB_QUEUE_SIZE (64) waiting events.
Step clicks made while a step runs are queued, not dropped; Stop cancels the queued ones.
Nothing in the page chooses a model, a file or code: the model comes from the server's environment.
"""
from __future__ import annotations

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no network calls

import argparse
import inspect
import json
import logging
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr

import labstate
from core.accept import RULES
from core.strategy import MAX_BUDGET, MAX_NEW_TOKENS, MAX_TOP_M
from core.model import precision_choice
from core.records import StepRecord
from core.strategy import AUTOREGRESSIVE, DYNAMIC, FIXED, HYDRA, LOOKUP
from core.tree import load_named_trees
from labstate import LabInputError, LabNotice, LabState, Run, Settings
from viz.bench_plot import (bench_figure, category_table, markdown_table, result_order, step_trace_figure,
                             stepped_strategies)
from viz.mask_plot import mask_figure
from viz.text_html import RunStats, emitted_tokens, heads_html, stats_html, text_html
from viz.timing_plot import accepted_figure, cumulative_figure, phase_figure
from viz.trace import trace_json
from viz.tree_plot import empty_figure, tree_figure
from viz.verify_view import verification_html

ASSETS = Path(__file__).resolve().parent / "assets"
MT_BENCH = ASSETS / "data" / "mt_bench.jsonl"
CSS_PATH = ASSETS / "app.css"
RESULTS = ASSETS / "results"
DEFAULTS = Settings()
DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
CONCURRENCY = int(os.environ.get("MEDUSA_LAB_CONCURRENCY", "2"))
MAX_SESSIONS = int(os.environ.get("MEDUSA_LAB_MAX_SESSIONS", "32"))
SESSION_IDLE_S = float(os.environ.get("MEDUSA_LAB_SESSION_IDLE_S", "1200"))
QUEUE_SIZE = int(os.environ.get("MEDUSA_LAB_QUEUE_SIZE", "64"))
SESSIONS = labstate.SessionRegistry(max_sessions=MAX_SESSIONS, idle_seconds=SESSION_IDLE_S)
TRACE_DIR = Path(tempfile.gettempdir()) / "medusa-lab-traces"
TRACE_TTL_S = 3600
# light theme always; Enter in the Revisit number box commits it (Gradio's slider only commits on blur)
PAGE_JS = """() => {
  document.body.classList.remove('dark');
  document.addEventListener('keydown', (event) => {
    const box = event.target;
    if (event.key === 'Enter' && box instanceof HTMLInputElement && box.type === 'number'
        && box.closest('#step-slider')) { box.blur(); }
  });
}"""
STRATEGY_CHOICES = [(label, name) for name, label in labstate.STRATEGY_LABELS.items()]
CUSTOM_TREE_EXAMPLE = "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"
log = logging.getLogger("medusa_lab")

VIEW_OUTPUT_NAMES = ("status", "stats", "text", "plain_text", "summary", "step_slider", "tree", "tree_compare",
                     "heads", "mask", "phases", "accepted", "cumulative", "verify")


def mt_bench_examples() -> dict[str, str]:
    """Dropdown label -> first turn, from the shipped copy of MT-Bench."""
    examples = {}
    for line in MT_BENCH.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            first = row["turns"][0]
            short = first if len(first) <= 70 else first[:69] + "…"
            examples[f"{row['question_id']} · {row['category']} · {short}"] = first
    return examples


EXAMPLES = mt_bench_examples()


# -- view (pure: draws what the state holds, never decodes) ------------------------------------------
def _status(run: Run, message: str, index: int | None = None) -> str:
    session = run.session
    parts = [f"**{len(session.records)} step(s)** · {run.settings.strategy_label} · {run.settings.precision} · "
             f"{run.state}."]
    if run.settings.auto_budget and session.records:
        shown = len(session.records) - 1 if index is None else index
        record = session.records[shown]
        parts.append(f"Auto budget chose **{record.outcome.tree.num_nodes} node(s)** at step {shown + 1}.")
    if run.note:
        parts.append(f"Note: {run.note}.")
    if message:
        parts.append(message)
    return " ".join(parts)


def _stats(lab: LabState, run: Run) -> tuple[RunStats, labstate.GreedyCheck]:
    session = run.session
    decode_seconds = sum(r.times.total for r in session.records)
    emitted = max(len(session.output_ids) - 1, 0)  # the first token comes from the prefill
    check = labstate.greedy_check(lab, run)
    speed = labstate.speed_vs_plain(lab, run)
    stats = RunStats(tokens=len(session.output_ids), steps=len(session.records),
                     mean_accepted=session.tokens_per_step,
                     tokens_per_s=emitted / decode_seconds if decode_seconds > 0 else 0.0,
                     status=run.state, check=check.text, check_state=check.state, vs_plain=speed.ratio,
                     vs_plain_basis=speed.basis, vs_plain_why=speed.why)
    return stats, check


def _summary(run: Run, stats: RunStats, check: labstate.GreedyCheck, index: int | None) -> dict[str, Any]:
    session = run.session
    return {
        "prompt": run.prompt, "settings": asdict(run.settings), "tokens": stats.tokens, "steps": stats.steps,
        "mean_accepted": round(stats.mean_accepted, 4), "tokens_per_s": round(stats.tokens_per_s, 3),
        "vs_plain": None if stats.vs_plain is None else round(stats.vs_plain, 3),
        "vs_plain_basis": stats.vs_plain_basis,
        "finished": session.finished, "stop_reason": session.stop_reason, "state": run.state,
        "viewing_step": None if index is None else index + 1,
        "output_ids": list(session.output_ids), "greedy_check": asdict(check),
        "nodes_per_step": [r.outcome.tree.num_nodes for r in session.records],
        "model": run.runtime.base.source, "heads": run.runtime.heads_description,
    }


def _tree_title(run: Run, record: StepRecord) -> str:
    settings, nodes = run.settings, record.outcome.tree.num_nodes
    chain = " + lookup ◆" if record.outcome.lookup_rank is not None else ""
    if record.strategy == LOOKUP:
        main = f"Heads skipped (auto is backing off): the prompt-lookup chain alone, {nodes} nodes"
    elif settings.strategy == DYNAMIC and settings.auto_budget:
        main = (f"Dynamic tree, auto budget: {nodes} of ≤ {settings.budget} nodes "
                f"(top-{settings.top_m}, depth {settings.depth}){chain}")
    elif settings.strategy == DYNAMIC:
        main = f"Dynamic tree (budget {settings.budget}, top-{settings.top_m}, depth {settings.depth})"
    elif settings.strategy == HYDRA:
        sizing = f"auto budget: {nodes} of ≤ {settings.budget} nodes" if settings.auto_budget else f"{nodes} nodes"
        main = f"Hydra tree grown node by node, {sizing} (depth {settings.depth}){chain}"
    elif settings.strategy == FIXED:
        main = f"Fixed tree {settings.fixed_preset} ({nodes} nodes)"
    else:
        main = "Autoregressive: the root only"
    return f"Step {record.index + 1}: {main}"


def _depth_note(run: Run, record: StepRecord) -> str:
    """Why a dynamic tree is shallower than the depth setting allows."""
    tree = record.outcome.tree
    if record.strategy != DYNAMIC or tree.num_nodes == 0 or tree.max_depth >= run.settings.depth:
        return ""
    return (f"deepest node at depth {tree.max_depth} of {run.settings.depth} allowed: no deeper path scored "
            f"high enough to make the budget")


def _bonus_note(run: Run) -> str:
    if run.settings.greedy:
        return ""
    return ("bonus sampled by the base model (from the residual after a rejected guess), so the two trees' "
            "bonus tokens can differ")


def _comparison(run: Run, record: StepRecord, token_bytes: dict[int, bytes]) -> Any:
    """The fixed tree on the same step, or a message saying why there is none."""
    settings = run.settings
    if record.comparison is not None:
        note = "; ".join(n for n in (_bonus_note(run),) if n)
        return tree_figure(record.comparison, f"Fixed tree {settings.fixed_preset}, same heads & context", note,
                           token_bytes)
    if record.strategy == LOOKUP:
        why = (f"No fixed-tree comparison at step {record.index + 1}: the auto budget skipped the heads this step "
               f"(they had not paid lately) and verified only the prompt-lookup chain, so there were no head "
               f"guesses for a fixed tree to use.")
    elif settings.strategy == FIXED:
        why = "The tree above is the fixed tree itself."
    elif settings.strategy == HYDRA:
        why = ("A fixed tree is a set of rank paths over the Medusa heads' guesses; the Hydra tree is grown from "
               "its own path-conditioned guesses, so there is no fixed tree to draw beside it.")
    elif settings.strategy == AUTOREGRESSIVE:
        why = "Autoregressive decoding builds no tree, so there is nothing to compare."
    elif not settings.compare_fixed:
        why = "The comparison is off: tick “Compare with the fixed tree” and press Start."
    else:
        why = f"No fixed-tree comparison at step {record.index + 1}."
    return empty_figure(why)


def _empty_view(message: str) -> tuple:
    blank = empty_figure("Type a prompt and press Start or Step.")
    slider = gr.Slider(minimum=1, maximum=2, value=1, interactive=False, label="Revisit a step")
    return (message, stats_html(RunStats()), text_html([]), "", {}, slider, blank, blank, heads_html(None),
            blank, blank, blank, blank, verification_html(None, True))


def _text_view(run: Run, index: int | None, token_bytes: dict[int, bytes]) -> str:
    session = run.session
    first = session.output_ids[0]
    first_text = session.records[0].outcome.node_texts[0] if session.records else \
        run.runtime.base.token_texts([first])[0]
    tokens = emitted_tokens(session.records, first, first_text, len(session.output_ids), token_bytes)
    return text_html(tokens, index)


def render(lab: LabState | None, index: int | None = None, message: str = "") -> tuple:
    """Every VIEW output for step `index` (0-based; default: the latest) of the user's current run."""
    run = lab.run if lab is not None else None
    if run is None:
        return _empty_view(message or "Type a prompt and press **Start** or **Step**.")
    if not run.session.records:
        return _prefill_view(lab, run, message)
    records = run.session.records
    index = len(records) - 1 if index is None else max(0, min(int(index), len(records) - 1))
    record = records[index]
    stats, check = _stats(lab, run)
    token_bytes = run.runtime.token_bytes
    slider = gr.Slider(minimum=1, maximum=max(len(records), 2), value=index + 1, interactive=len(records) > 1,
                       label=f"Revisit a step (1 … {len(records)}): drag, or type a number and press Enter")
    note = "; ".join(n for n in (_depth_note(run, record), _bonus_note(run)) if n)
    return (
        _status(run, message, index), stats_html(stats), _text_view(run, index, token_bytes),
        run.runtime.base.decode(run.session.output_ids), _summary(run, stats, check, index), slider,
        tree_figure(record.outcome, _tree_title(run, record), note, token_bytes),
        _comparison(run, record, token_bytes), heads_html(record, token_bytes),
        mask_figure(record.outcome, record.context_length, token_bytes), phase_figure(records, index),
        accepted_figure(records, index), cumulative_figure(records, labstate.ar_baseline(lab, run)),
        verification_html(record, run.settings.greedy, token_bytes),
    )


def _prefill_view(lab: LabState, run: Run, message: str) -> tuple:
    first = run.session.output_ids[0]
    stats, check = _stats(lab, run)
    view = list(_empty_view(""))
    default = ("The first token (from the prefill) already ended the run." if run.session.finished
               else "Prefilled. Press **Step** to run the first tree.")
    view[0] = _status(run, message if message.startswith("⚠️") else " ".join(m for m in (message, default) if m))
    view[1] = stats_html(stats)
    view[2] = _text_view(run, None, run.runtime.token_bytes)
    view[3] = run.runtime.base.decode([first])
    view[4] = _summary(run, stats, check, None)
    blank = empty_figure("Prefill done: the base model chose the first token." +
                         ("" if run.session.finished else " Press Step for the first tree."))
    view[6] = view[7] = blank
    return tuple(view)


# -- event handlers: one template for the settings events, one place that maps errors to messages ------
@dataclass
class Call:
    """One event: who asked (Gradio session key and request) and, once known, the state it works on."""

    key: str
    request: gr.Request | None
    lab: LabState | None = None


def _session_key(request: gr.Request | None) -> str:
    """The Gradio session hash (one per browser tab / API client); a throwaway key when there is none."""
    key = getattr(request, "session_hash", None) if request is not None else None
    return key if isinstance(key, str) and key else f"anonymous-{uuid.uuid4().hex}"


def _new_call(request: gr.Request | None) -> Call:
    return Call(key=_session_key(request), request=request)


def _from_api(request: gr.Request | None) -> bool:
    """True for gradio_client (it sends `x-gradio-user: api`) and plain-HTTP `/call/` requests, False for the page."""
    if request is None:
        return True
    headers = getattr(request, "headers", None) or {}
    if headers.get("x-gradio-user") in ("api", "mcp"):
        return True
    return "/call/" in str(getattr(request, "url", "") or "")


def _answer(call: Call, error: Exception) -> tuple:
    """The one place that turns an exception into what the user sees.

    LabNotice (nothing wrong, the action does not apply): a warning toast and the view with a note.
    LabInputError: the API gets gr.Error (gradio_client raises AppError with the message); the page keeps
    its view and shows the message in the status line and a toast. Anything else is logged and reported
    as a short internal error, never a traceback. Call it from inside an `except` block.
    """
    if isinstance(error, gr.Error):
        raise error
    if isinstance(error, LabNotice):
        gr.Warning(str(error).replace("**", ""))
        return render(call.lab, message=f"⚠️ {error}")
    if isinstance(error, LabInputError):
        if _from_api(call.request):
            raise gr.Error(str(error), title="Cannot do that", print_exception=False)
        gr.Warning(str(error))
        try:
            lab = SESSIONS.get(call.key)  # redraw the user's current run, untouched
        except LabNotice:
            lab = None
        return render(lab, message=f"⚠️ {error}")
    log.exception("unexpected error in a lab event")
    text = f"{type(error).__name__}: {error}"
    raise gr.Error(f"Something went wrong ({text[:200]}); it was logged. Your other runs are unaffected; press "
                   f"Start to try again.", title="Internal error", print_exception=False) from None


def _guard(call: Call, action: Callable[[], tuple]) -> tuple:
    """`action()`, with every exception answered by `_answer`."""
    try:
        return action()
    except Exception as error:  # noqa: BLE001  (never a traceback in the page)
        return _answer(call, error)


@contextmanager
def _working(lab: LabState) -> Iterator[LabState]:
    """Mark the state busy (never evicted) while a handler works on it."""
    lab.enter()
    try:
        yield lab
    finally:
        lab.leave()


SettingsAction = Callable[[Call, str, Settings, str], Any]


def _settings_signature() -> inspect.Signature:
    """(prompt, <every setting by name, with the page's default>, request): what Gradio and gradio_client see."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    defaults = DEFAULTS.raw()
    parameters = [inspect.Parameter("prompt", kind, annotation=str)]
    parameters += [inspect.Parameter(name, kind, default=defaults[name], annotation=type(defaults[name]))
                   for name in labstate.SETTING_NAMES]
    parameters.append(inspect.Parameter("request", kind, default=None, annotation=gr.Request))
    return inspect.Signature(parameters)


SETTINGS_SIGNATURE = _settings_signature()


def _bind(args: tuple, kwargs: dict) -> tuple[Call, Callable[[], tuple[str, Settings, str]]]:
    """The call and a parser of its prompt and settings (run inside the guard, so bad input is answered)."""
    values = SETTINGS_SIGNATURE.bind(*args, **kwargs)
    values.apply_defaults()
    arguments = values.arguments
    call = _new_call(arguments["request"])

    def parse() -> tuple[str, Settings, str]:
        clean, note = labstate.sanitize_prompt(arguments["prompt"])
        settings = labstate.parse_settings({name: arguments[name] for name in labstate.SETTING_NAMES})
        if note:
            gr.Warning(note)
        return clean, settings, note

    return call, parse


def _named(handler: Callable, action: SettingsAction, name: str) -> Callable:
    """Give `handler` the settings signature (and annotations) so Gradio passes the request and names the API."""
    handler.__signature__ = SETTINGS_SIGNATURE
    handler.__annotations__ = {p.name: p.annotation for p in SETTINGS_SIGNATURE.parameters.values()}
    handler.__name__ = handler.__qualname__ = name
    handler.__doc__ = action.__doc__
    return handler


def settings_handler(action: SettingsAction, name: str) -> Callable[..., tuple]:
    """An event handler taking (prompt, **settings, request) around `action(call, prompt, settings, note)`."""
    def handler(*args: Any, **kwargs: Any) -> tuple:
        call, parse = _bind(args, kwargs)
        return _guard(call, lambda: action(call, *parse()))
    return _named(handler, action, name)


def settings_stream(action: SettingsAction, name: str) -> Callable[..., Iterator[tuple]]:
    """Like `settings_handler` for a generator `action` (streams one view per step)."""
    def handler(*args: Any, **kwargs: Any) -> Iterator[tuple]:
        call, parse = _bind(args, kwargs)
        try:
            yield from action(call, *parse())
        except Exception as error:  # noqa: BLE001
            yield _answer(call, error)
    return _named(handler, action, name)


def _join(*messages: str) -> str:
    return " ".join(m for m in messages if m)


def _lab_for_decoding(key: str) -> LabState:
    """The session's state for Step/Run: created when new, SessionExpired when it was dropped."""
    lab = SESSIONS.get(key)
    return lab if lab is not None else SESSIONS.open(key)


def _ensure_run(lab: LabState, prompt: str, settings: Settings) -> tuple[Run, str]:
    """The current run, or a new one when there is none (so Step and Run also start)."""
    run = lab.run
    changed = run is not None and (prompt != run.prompt or settings != run.settings)
    if changed:
        labstate.prepare(prompt, settings)  # bad new input is reported even while the old run continues
    if run is not None and not run.session.finished:
        return run, "Prompt or settings changed: press **Start** to apply them." if changed else ""
    if run is not None and not changed:
        raise LabNotice(f"Decoding has finished ({run.session.stop_reason}). Press Start for a new run.")
    return labstate.start_run(lab, prompt, settings), ""


def _start(call: Call, prompt: str, settings: Settings, note: str) -> tuple:
    """Start (or restart) decoding `prompt`: prefill only."""
    prepared = labstate.prepare(prompt, settings)  # all checks before the session is touched
    call.lab = SESSIONS.open(call.key)
    with _working(call.lab):
        labstate.start_prepared(call.lab, prepared)
        return render(call.lab, message=note)


def _step(call: Call, prompt: str, settings: Settings, note: str) -> tuple:
    """One decoding step (starting a run first when there is none). A step queued before Stop is dropped."""
    call.lab = lab = _lab_for_decoding(call.key)
    with _working(lab):
        run, changed = _ensure_run(lab, prompt, settings)
        if labstate.step_run(lab, run, lab.epoch) is None:
            return render(lab, message="Stopped: a Step queued before Stop was dropped.")
        run.mode = labstate.PAUSED
        if run.session.finished:
            labstate.compute_check(lab, run)
        return render(lab, message=_join(note, changed))


def _run(call: Call, prompt: str, settings: Settings, note: str) -> Iterator[tuple]:
    """Step to the end, streaming every step.

    Stops between steps when cancelled: Stop/Start/Reset bump the state's epoch, the session may be
    evicted, and Gradio closes this generator when the event is cancelled or the client goes away.
    """
    call.lab = lab = _lab_for_decoding(call.key)
    with _working(lab):
        run, changed = _ensure_run(lab, prompt, settings)
        note, epoch = _join(note, changed), lab.epoch
        run.mode = labstate.RUNNING
        try:
            while not run.session.finished:
                if not SESSIONS.is_live(call.key, lab):
                    raise labstate.SessionExpired("Your session expired while running (the lab needed room). "
                                                  "Press **Start** to begin again.")
                if lab.run is not run or labstate.step_run(lab, run, epoch) is None:
                    return  # Stop, Start or Reset since: end quietly
                SESSIONS.touch(call.key, lab)
                yield render(lab, message=note if not run.session.finished else
                             "Comparing with plain greedy decoding…")
        finally:
            if run.mode == labstate.RUNNING:
                run.mode = labstate.PAUSED
        labstate.compute_check(lab, run)
        if lab.run is run:
            yield render(lab, message=note)


on_start = settings_handler(_start, "on_start")
on_step = settings_handler(_step, "on_step")
on_run = settings_stream(_run, "on_run")


def _step_index(value: object) -> int:
    """A 0-based record index from the Revisit box (steps are numbered from 1 on the page)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise LabInputError(f"step index must be a whole number, got {value!r}")
    return int(max(min(value, 10**6), 0)) - 1


def on_view(step_index: float, request: gr.Request = None) -> tuple:
    """Show a past step (steps count from 1)."""
    call = _new_call(request)

    def view() -> tuple:
        call.lab = SESSIONS.get(call.key)
        return render(call.lab, index=max(_step_index(step_index), 0))

    return _guard(call, view)


def on_check(request: gr.Request = None) -> tuple:
    """Run plain greedy decoding now and compare the output so far."""
    call = _new_call(request)

    def check() -> tuple:
        call.lab = SESSIONS.get(call.key)
        run = labstate.require_run(call.lab)
        with _working(call.lab):
            labstate.compute_check(call.lab, run)
            return render(call.lab, message="Compared with a plain greedy run.")

    return _guard(call, check)


def on_reset(request: gr.Request = None) -> tuple:
    """Forget the current run (cached plain runs stay)."""
    call = _new_call(request)

    def reset() -> tuple:
        SESSIONS.forget_expiry(call.key)
        call.lab = SESSIONS.get(call.key)
        if call.lab is not None:
            call.lab.interrupt()
            call.lab.run = None
        return render(call.lab, message="Reset. Type a prompt and press **Start** or **Step**.")

    return _guard(call, reset)


def on_stop(request: gr.Request = None) -> tuple:
    """Stop a running Run (and any Step waiting for its turn), then draw the run as it really stands."""
    call = _new_call(request)

    def stop() -> tuple:
        call.lab = SESSIONS.get(call.key)
        if call.lab is None or call.lab.run is None:
            return render(call.lab, message="Nothing to stop.")
        call.lab.stop()
        labstate.wait_idle(call.lab)  # the step in flight finishes; nothing starts after it
        return render(call.lab, message="Stopped. **Step** or **Run to end** go on from here.")

    return _guard(call, stop)


def on_unload(request: gr.Request = None) -> None:
    """The tab closed: drop its state now (Gradio calls this when the page's heartbeat ends)."""
    if request is not None and getattr(request, "session_hash", None):
        SESSIONS.drop(request.session_hash)


def on_strategy(strategy: str) -> Any:
    """The strategy's own help text under the choice."""
    return gr.Radio(info=labstate.STRATEGY_HELP.get(strategy, ""))


def on_trace(request: gr.Request = None) -> str | None:
    """Write the run as a JSON trace and return the file for download."""
    try:
        lab = SESSIONS.get(_session_key(request))
    except LabNotice as notice:
        gr.Warning(str(notice).replace("**", ""))
        return None
    if lab is None or lab.run is None:
        gr.Warning("Nothing to export yet: run a few steps first.")
        return None
    run = lab.run
    stats, check = _stats(lab, run)
    meta = {**_summary(run, stats, check, None), "text": run.runtime.base.decode(run.session.output_ids),
            "prompt_ids": run.session.prompt_ids, "prefill_seconds": run.session.prefill_seconds,
            "decode_config": run.session.config}
    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    _drop_old_traces(TRACE_DIR)
    path = TRACE_DIR / f"medusa_trace_{len(run.session.records)}_steps_{uuid.uuid4().hex[:8]}.json"
    path.write_text(trace_json(run.session.records, meta), encoding="utf-8")
    return str(path)


def _drop_old_traces(folder: Path) -> None:
    """Delete traces older than TRACE_TTL_S (Gradio serves its own copy of each)."""
    cutoff = time.time() - TRACE_TTL_S
    for old in folder.glob("medusa_trace_*.json"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another worker removed it first
            pass


def on_load() -> str:
    """The model/heads line in the header (loads the default precision's model once, if main() did not)."""
    rt = labstate.runtime(DEFAULTS.precision)
    return (f"**Base model:** {rt.base.source} · **Heads:** {rt.heads_description} · "
            f"**Forward:** {rt.base.engine_name} · **Default precision:** {precision_choice().describe()}; "
            f"fp32 is exact, bf16 exact up to rounding near-ties.")


def _clear_trace() -> None:
    """A new or reset run has no trace yet (the Export box drops the previous run's file)."""
    return None


# -- layout ---------------------------------------------------------------------------------------
HOW_IT_WORKS = (Path(__file__).resolve().parent / "assets" / "how_it_works.md").read_text()  # prose lives in assets


def _settings_panel(num_heads: int) -> list[gr.components.Component]:
    """The settings, built by name; returned in `labstate.SETTING_NAMES` order (the handlers' order)."""
    presets = [*load_named_trees(), labstate.CUSTOM_TREE]
    defaults = DEFAULTS.raw()
    with gr.Accordion("Settings (applied at Start)", open=True):
        panel = {
            "strategy": gr.Radio(STRATEGY_CHOICES, value=defaults["strategy"], label="Strategy", elem_id="strategy",
                                 info=labstate.STRATEGY_HELP[defaults["strategy"]]),
            "budget": gr.Slider(1, MAX_BUDGET, value=defaults["budget"], step=1,
                                label="Node budget (dynamic tree; the auto budget's ceiling)", elem_id="budget"),
            "top_m": gr.Slider(1, MAX_TOP_M, value=defaults["top_m"], step=1, label="Top-m per head (dynamic tree)",
                               elem_id="top-m"),
            "depth": gr.Slider(1, num_heads, value=min(defaults["depth"], num_heads), step=1,
                               label="Depth (heads used)", elem_id="depth"),
            "fixed_preset": gr.Dropdown(presets, value=defaults["fixed_preset"], label="Fixed tree preset",
                                        elem_id="preset"),
            "custom_tree": gr.Textbox(defaults["custom_tree"], label="Custom tree (JSON list of rank paths; used when "
                                      "the preset is “custom”)", placeholder=CUSTOM_TREE_EXAMPLE, lines=2,
                                      max_lines=6, elem_id="custom-tree",
                                      info=f"Path [r1, r2, …] = head 1's rank-r1 token, then head 2's rank-r2 token, "
                                           f"…; every path's parent must be in the list; up to "
                                           f"{labstate.MAX_CUSTOM_TREE_NODES} paths, {num_heads} deep, ranks "
                                           f"0-{MAX_TOP_M - 1}."),
            "compare_fixed": gr.Checkbox(value=defaults["compare_fixed"], label="Compare with the fixed tree "
                                         "(dynamic only; costs a second verify, not counted in tokens/s)",
                                         elem_id="compare"),
            "rule": gr.Radio(list(RULES), value=defaults["rule"], label="Acceptance rule", elem_id="rule"),
            "temperature": gr.Slider(0.0, labstate.MAX_TEMPERATURE, value=defaults["temperature"], step=0.05,
                                     label="Temperature (0 = greedy)", elem_id="temperature"),
            "precision": gr.Radio([("bf16 (fast on GPUs and CPUs with bf16 instructions)", "bf16"), ("fp32 (exact)", "fp32")], value=defaults["precision"],
                                  label="Precision", elem_id="precision"),
            "max_new_tokens": gr.Slider(1, MAX_NEW_TOKENS, value=defaults["max_new_tokens"], step=1,
                                        label="Max new tokens", elem_id="max-new"),
        }
    panel["strategy"].change(on_strategy, [panel["strategy"]], [panel["strategy"]], api_visibility="private",
                             queue=False, show_progress="hidden")
    return [panel[name] for name in labstate.SETTING_NAMES]


def _num_heads() -> int:
    """Heads available for the depth slider (reads the shipped config when present; no model load)."""
    config = ASSETS / "heads" / "config.json"
    if config.exists():
        return int(json.loads(config.read_text())["num_heads"])
    return DEFAULTS.depth


CURRENT_ROUND = "round8"  # the benchmark files of this round (scripts/bench_round.sh) open the tab


def _benchmark_tab() -> None:
    """The committed `python -m offline.bench` results: this round's summary on one screen (a plot and
    one table per prompt set), every table and earlier round folded below."""
    files = sorted(RESULTS.glob("bench_*.json"), key=lambda path: result_order(path.stem))
    if not files:
        gr.Markdown("No benchmark results are shipped yet: run `python -m offline.bench ... --out assets/results/bench_NAME.json`.")
        return
    current = [path for path in files if CURRENT_ROUND in path.stem]
    earlier = [path for path in files if path not in current]
    for path in current:
        result = json.loads(path.read_text())
        gr.Markdown(_bench_heading(path, result) + "\n\n" + markdown_table(result), elem_classes=["bench-table"])
        gr.Plot(bench_figure(result, path.stem), show_label=False)
        for strategy in stepped_strategies(result):
            with gr.Accordion(f"{strategy} step by step: tree sizes and controller state per prompt", open=False):
                gr.Plot(step_trace_figure(result, strategy), show_label=False)
        per_category = category_table(result)
        if per_category:
            with gr.Accordion("Per category (worst prompt in brackets)", open=False):
                gr.Markdown(per_category, elem_classes=["bench-table"])
    with gr.Accordion(f"Earlier rounds ({len(earlier)} result files; other heads, other CPUs)", open=False):
        for path in earlier:
            result = json.loads(path.read_text())
            gr.Markdown(_bench_heading(path, result) + "\n\n" + markdown_table(result), elem_classes=["bench-table"])


def _bench_heading(path: Path, result: dict) -> str:
    config = result["config"]
    count = config.get("prompt_count") or config.get("limit") or "all"
    device = result["device"].get("cuda") or result["device"].get("cpu") or result["device"]["type"]
    cut = (f" (cut off by its time limit after {count} of {config.get('prompts_planned')} prompts)"
           if result.get("complete") is False else "")
    return (f"#### {path.stem}: {count} prompts from `{Path(config['prompts']).name}`{cut}, "
            f"{config['max_new_tokens']} new tokens, {config['dtype']}, {device}")


def _view_panel() -> dict[str, gr.components.Component]:
    """The outputs every decoding event redraws, by name (`VIEW_OUTPUT_NAMES`)."""
    view = {
        "status": gr.Markdown("Type a prompt and press **Start** or **Step**.", elem_id="status", label="run status"),
        "stats": gr.HTML(stats_html(RunStats()), elem_id="stats", label="stats"),
        "text": gr.HTML(text_html([]), elem_id="gen-text", label="text"),
        "step_slider": gr.Slider(1, 2, value=1, step=1, label="Revisit a step", interactive=False,
                                 elem_id="step-slider"),
    }
    with gr.Tabs():
        with gr.Tab("Trees: dynamic vs fixed"):
            view["tree"] = gr.Plot(empty_figure("Type a prompt and press Start or Step."), show_label=False,
                                   elem_id="tree-plot", label="tree")
            with gr.Accordion("Verification: why the path stopped there", open=True):
                view["verify"] = gr.HTML(verification_html(None, True), elem_id="verify", label="verify")
            view["tree_compare"] = gr.Plot(empty_figure(""), show_label=False, elem_id="tree-compare-plot",
                                           label="tree_compare")
            view["heads"] = gr.HTML(heads_html(None), elem_id="heads", label="heads")
        with gr.Tab("Attention mask"):
            view["mask"] = gr.Plot(empty_figure(""), show_label=False, elem_id="mask-plot", label="mask")
        with gr.Tab("Timing"):
            view["phases"] = gr.Plot(empty_figure(""), show_label=False, elem_id="phase-plot", label="phases")
            view["accepted"] = gr.Plot(empty_figure(""), show_label=False, elem_id="accepted-plot", label="accepted")
            view["cumulative"] = gr.Plot(empty_figure(""), show_label=False, elem_id="cumulative-plot",
                                         label="cumulative")
        with gr.Tab("Benchmarks"):
            _benchmark_tab()
        with gr.Tab("Text & summary"):
            view["plain_text"] = gr.Textbox(label="Decoded text", lines=8, interactive=False, buttons=["copy"],
                                            elem_id="plain-text")
            view["summary"] = gr.JSON(label="Run summary", elem_id="summary")
    with gr.Accordion("How it works", open=False):
        gr.Markdown(HOW_IT_WORKS)
    return view


def build_demo() -> gr.Blocks:
    """The whole UI. Nothing is loaded or launched here."""
    with gr.Blocks(title="Medusa Tree Lab", delete_cache=(3600, 3600)) as demo:
        gr.HTML('<div class="lab-header"><h1>Medusa Tree Lab</h1><p>Speculative decoding with Medusa heads and a '
                '<b>dynamic candidate tree</b>, one step at a time: heads propose, the tree is verified in one '
                'forward pass, the base model accepts a path.</p></div>')
        model_info = gr.Markdown("Loading the model…", elem_classes=["model-info"])
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=330, elem_classes=["controls"]):
                example = gr.Dropdown(list(EXAMPLES), value=None, label="MT-Bench examples", filterable=True)
                prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt", lines=4, max_lines=10, elem_id="prompt")
                with gr.Row():
                    start_btn = gr.Button("Start / Restart", variant="secondary", elem_id="start-btn")
                    step_btn = gr.Button("Step ▶", variant="primary", elem_id="step-btn")
                with gr.Row():
                    run_btn = gr.Button("Run to end ▶▶", elem_id="run-btn")
                    stop_btn = gr.Button("Stop ■", variant="stop", elem_id="stop-btn")
                with gr.Row():
                    reset_btn = gr.Button("Reset", size="sm", elem_id="reset-btn")
                    check_btn = gr.Button("Check vs plain greedy", size="sm", elem_id="check-btn")
                settings = _settings_panel(_num_heads())
                with gr.Accordion("Export", open=False):
                    trace_btn = gr.Button("Build JSON trace of this run", size="sm", elem_id="trace-btn")
                    trace_file = gr.File(label="JSON trace", interactive=False, elem_id="trace-file")
            with gr.Column(scale=3, min_width=600):
                panel = _view_panel()
        view = [panel[name] for name in VIEW_OUTPUT_NAMES]
        inputs = [prompt, *settings]
        # raw payloads: labstate checks every value itself (clear messages for any JSON type)
        decode = {"show_progress": "minimal", "concurrency_id": "decode", "preprocess": False}
        run_event = run_btn.click(on_run, inputs, view, api_name="run", **decode)
        start_event = start_btn.click(on_start, inputs, view, api_name="start", cancels=[run_event], **decode)
        step_event = step_btn.click(on_step, inputs, view, api_name="step", trigger_mode="multiple", **decode)
        stop_btn.click(None, None, None, cancels=[run_event, step_event], api_visibility="private")
        stop_btn.click(on_stop, None, view, api_name="stop", queue=False)  # waits for the step in flight
        reset_event = reset_btn.click(on_reset, None, view, api_name="reset", cancels=[run_event, step_event])
        for event in (start_event, reset_event):
            event.then(_clear_trace, None, [trace_file], api_visibility="private", queue=False)
        check_btn.click(on_check, None, view, api_name="check", **decode)
        panel["step_slider"].release(on_view, [panel["step_slider"]], view, api_name="view", show_progress="hidden",
                                     preprocess=False)
        trace_btn.click(on_trace, None, [trace_file], api_name="trace")
        example.input(EXAMPLES.get, [example], [prompt], api_visibility="private", queue=False)
        demo.load(on_load, None, [model_info], api_visibility="private")
        demo.unload(on_unload)
    demo.queue(default_concurrency_limit=CONCURRENCY, max_size=QUEUE_SIZE)
    return demo


demo = build_demo()


def launch_kwargs() -> dict[str, Any]:
    """Styling and safety options that Gradio 6 takes at launch time (never a public share link)."""
    return {"css_paths": [CSS_PATH], "js": PAGE_JS, "theme": gr.themes.Default(), "share": False,
            # the page uploads nothing; Gradio's own session store is bounded like ours
            "max_file_size": "1mb", "state_session_capacity": max(64, 4 * MAX_SESSIONS)}


def main(argv: list[str] | None = None) -> None:
    """Load the model, then serve on 127.0.0.1 (port: --port, else GRADIO_SERVER_PORT, else 7860)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    args = parser.parse_args(argv)
    labstate.runtime(DEFAULTS.precision)  # load once before the first visitor
    demo.launch(server_name=args.host, server_port=args.port, **launch_kwargs())


if __name__ == "__main__":
    main()
