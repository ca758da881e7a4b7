"""Medusa Tree Lab: step through Medusa-style speculative decoding with a dynamic candidate tree.

Wiring only: `labstate` runs the decoder (core/), `viz` draws. Importing this module builds the
Blocks but launches nothing; `python app.py [--port N]` serves on 127.0.0.1 (port from --port,
else GRADIO_SERVER_PORT, else 7860).

API (gradio_client), every event returns the VIEW outputs listed in `VIEW_OUTPUT_NAMES`:
  start(prompt, *settings), step(prompt, *settings), run(prompt, *settings)  [run streams],
  view(step_index), check(), reset(), stop(); trace() returns the JSON trace file.
Settings, in order: strategy (autoregressive | fixed | dynamic | dynamic:auto | dynamic:auto+lookup), budget, top_m,
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

Sessions: each browser tab / API client (Gradio session hash) owns a LabState in a server-side
`labstate.SessionRegistry`: at most MEDUSA_LAB_MAX_SESSIONS (32) live, each dropped after
MEDUSA_LAB_SESSION_IDLE_S (1200 s) idle or when its tab closes; when full, the least recently used
idle one is evicted and its owner told to press Start. Decoding events share one queue slot pool
of MEDUSA_LAB_CONCURRENCY (2); the queue holds at most MEDUSA_LAB_QUEUE_SIZE (64) waiting events.
Nothing in the page chooses a model, a file or code: the model comes from the server's environment.
"""
from __future__ import annotations

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no network calls

import argparse
import json
import logging
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import gradio as gr

import labstate
from core.accept import RULES
from core.decoder import MAX_BUDGET, MAX_NEW_TOKENS, MAX_TOP_M
from core.tree import load_named_trees
from labstate import LabInputError, LabNotice, LabState, Run, Settings
from viz.bench_plot import bench_figure, markdown_table
from viz.mask_plot import mask_figure
from viz.text_html import RunStats, emitted_tokens, heads_html, stats_html, text_html
from viz.timing_plot import accepted_figure, cumulative_figure, phase_figure
from viz.trace import trace_json
from viz.tree_plot import empty_figure, tree_figure

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
FORCE_LIGHT_JS = "() => { document.body.classList.remove('dark'); }"
STRATEGY_CHOICES = [("autoregressive", "autoregressive"), ("fixed", "fixed"), ("dynamic", "dynamic"),
                    ("dynamic (auto budget)", labstate.AUTO_STRATEGY),
                    ("dynamic (auto) + prompt lookup", labstate.LOOKUP_STRATEGY)]
CUSTOM_TREE_EXAMPLE = "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"
log = logging.getLogger("medusa_lab")

VIEW_OUTPUT_NAMES = ("status", "stats", "text", "plain_text", "summary", "step_slider", "tree", "tree_compare",
                     "heads", "mask", "phases", "accepted", "cumulative")


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


# -- view ---------------------------------------------------------------------------------------
def _status(run: Run, message: str, index: int | None = None) -> str:
    session = run.session
    state = f"finished ({session.stop_reason})" if session.finished else "running"
    parts = [f"**{len(session.records)} step(s)** · {run.settings.strategy_label} · {run.settings.precision} · "
             f"{state}."]
    if run.settings.auto_budget and session.records:
        record = session.records[-1 if index is None else index]
        parts.append(f"Auto budget chose **{record.outcome.tree.num_nodes} node(s)** at step {record.index}.")
    if run.note:
        parts.append(f"Note: {run.note}.")
    if message:
        parts.append(message)
    return " ".join(parts)


def _stats(lab: LabState, run: Run, compute_check: bool) -> tuple[RunStats, labstate.GreedyCheck]:
    session = run.session
    decode_seconds = sum(r.times.total for r in session.records)
    emitted = max(len(session.output_ids) - 1, 0)  # the first token comes from the prefill
    check = labstate.greedy_check(lab, run, compute=compute_check)
    stats = RunStats(tokens=len(session.output_ids), steps=len(session.records),
                     mean_accepted=session.tokens_per_step,
                     tokens_per_s=emitted / decode_seconds if decode_seconds > 0 else 0.0,
                     status=f"finished: {session.stop_reason}" if session.finished else "running",
                     check=check.text, check_state=check.state)
    return stats, check


def _summary(run: Run, stats: RunStats, check: labstate.GreedyCheck, index: int | None) -> dict[str, Any]:
    session = run.session
    return {
        "prompt": run.prompt, "settings": asdict(run.settings), "tokens": stats.tokens, "steps": stats.steps,
        "mean_accepted": round(stats.mean_accepted, 4), "tokens_per_s": round(stats.tokens_per_s, 3),
        "finished": session.finished, "stop_reason": session.stop_reason, "viewing_step": index,
        "output_ids": list(session.output_ids), "greedy_check": asdict(check),
        "nodes_per_step": [r.outcome.tree.num_nodes for r in session.records],
        "model": run.runtime.base.source, "heads": run.runtime.heads_description,
    }


def _tree_titles(run: Run, record) -> tuple[str, str]:
    settings = run.settings
    chain = " + lookup ◆" if record.outcome.lookup_rank is not None else ""
    if record.strategy == "lookup":
        main = f"Heads skipped (auto is backing off): the prompt-lookup chain alone, {record.outcome.tree.num_nodes} nodes"
    elif settings.strategy == "dynamic" and settings.auto_budget:
        main = (f"Dynamic tree, auto budget: {record.outcome.tree.num_nodes} of ≤ {settings.budget} nodes "
                f"(top-{settings.top_m}, depth {settings.depth}){chain}")
    elif settings.strategy == "dynamic":
        main = f"Dynamic tree (budget {settings.budget}, top-{settings.top_m}, depth {settings.depth})"
    elif settings.strategy == "fixed":
        main = f"Fixed tree {settings.fixed_preset} ({record.outcome.tree.num_nodes} nodes)"
    else:
        main = "Autoregressive: the root only"
    return main, f"Fixed tree {settings.fixed_preset}, same heads & context"


def _empty_view(message: str) -> tuple:
    blank = empty_figure("Type a prompt and press Start or Step.")
    slider = gr.Slider(minimum=0, maximum=1, value=0, interactive=False)
    return (message, stats_html(RunStats()), text_html([]), "", {}, slider, blank, blank, heads_html(None),
            blank, blank, blank, blank)


def render(lab: LabState | None, index: int | None = None, message: str = "", compute_check: bool = False) -> tuple:
    """Every VIEW output for step `index` (default: the latest) of the user's current run."""
    run = lab.run if lab is not None else None
    if run is None or not run.session.records:
        if run is not None:
            return _prefill_view(lab, run, message)
        return _empty_view(message or "Type a prompt and press **Start** or **Step**.")
    records = run.session.records
    index = len(records) - 1 if index is None else max(0, min(int(index), len(records) - 1))
    record = records[index]
    stats, check = _stats(lab, run, compute_check)
    tokens = emitted_tokens(records, run.session.output_ids[0], records[0].outcome.node_texts[0],
                            len(run.session.output_ids))
    main_title, compare_title = _tree_titles(run, record)
    compare = (tree_figure(record.comparison, compare_title) if record.comparison is not None else
               empty_figure("The fixed-tree comparison is shown for the dynamic strategy with “compare” on."))
    slider = gr.Slider(minimum=0, maximum=max(len(records) - 1, 1), value=index, interactive=len(records) > 1,
                       label=f"Revisit a step (0 … {len(records) - 1})")
    return (
        _status(run, message, index), stats_html(stats), text_html(tokens, index),
        run.runtime.base.decode(run.session.output_ids), _summary(run, stats, check, index), slider,
        tree_figure(record.outcome, f"Step {index}: {main_title}"), compare, heads_html(record),
        mask_figure(record.outcome, record.context_length), phase_figure(records, index),
        accepted_figure(records, index), cumulative_figure(records, labstate.ar_baseline(lab, run)),
    )


def _prefill_view(lab: LabState, run: Run, message: str) -> tuple:
    first = run.session.output_ids[0]
    text = run.runtime.base.token_texts([first])[0]
    stats, check = _stats(lab, run, compute_check=False)
    view = list(_empty_view(""))
    default = ("The first token (from the prefill) already ended the run." if run.session.finished
               else "Prefilled. Press **Step** to run the first tree.")
    view[0] = _status(run, message if message.startswith("⚠️") else " ".join(m for m in (message, default) if m))
    view[1] = stats_html(stats)
    view[2] = text_html(emitted_tokens([], first, text, 1))
    view[3] = run.runtime.base.decode([first])
    view[4] = _summary(run, stats, check, None)
    blank = empty_figure("Prefill done: the base model chose the first token." +
                         ("" if run.session.finished else " Press Step for the first tree."))
    view[6] = view[7] = blank
    return tuple(view)


# -- event handlers -------------------------------------------------------------------------------
def _session_key(request: gr.Request | None) -> str:
    """The Gradio session hash (one per browser tab / API client); a throwaway key when there is none."""
    key = getattr(request, "session_hash", None) if request is not None else None
    return key if isinstance(key, str) and key else f"anonymous-{uuid.uuid4().hex}"


def _from_api(request: gr.Request | None) -> bool:
    """True for gradio_client (it sends `x-gradio-user: api`) and plain-HTTP `/call/` requests, False for the page."""
    if request is None:
        return True
    headers = getattr(request, "headers", None) or {}
    if headers.get("x-gradio-user") in ("api", "mcp"):
        return True
    return "/call/" in str(getattr(request, "url", "") or "")


def _refuse(error: LabInputError, request: gr.Request | None) -> tuple:
    """Bad input: the API gets an error (gradio_client raises AppError with this message); the page keeps its
    view and shows the message in the status line and a warning toast (no error overlays on every output)."""
    if _from_api(request):
        raise gr.Error(str(error), title="Cannot do that", print_exception=False)
    gr.Warning(str(error))
    try:
        lab = SESSIONS.get(_session_key(request))  # redraw the user's current run, untouched
    except LabNotice:
        lab = None
    return render(lab, message=f"⚠️ {error}")


def _internal(error: Exception) -> gr.Error:
    log.exception("unexpected error in a lab event")
    text = f"{type(error).__name__}: {error}"
    return gr.Error(f"Something went wrong ({text[:200]}); it was logged. Your other runs are unaffected; press "
                    f"Start to try again.", title="Internal error", print_exception=False)


def _notice(lab: LabState | None, notice: Exception, index: int | None = None) -> tuple:
    gr.Warning(str(notice).replace("**", ""))
    return render(lab, index=index, message=f"⚠️ {notice}")


def _parse(prompt: object, settings_values: tuple) -> tuple[str, Settings, str]:
    """Sanitized prompt, validated settings and a note (prompt cleaned); LabInputError for bad input."""
    clean, note = labstate.sanitize_prompt(prompt)
    settings = labstate.parse_settings(*settings_values)
    if note:
        gr.Warning(note)
    return clean, settings, note


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


def on_start(prompt: str, strategy: str, budget: float, top_m: float, depth: float, fixed_preset: str, rule: str,
             temperature: float, precision: str, max_new_tokens: float, compare_fixed: bool, custom_tree: str = "",
             request: gr.Request = None) -> tuple:
    """Start (or restart) decoding `prompt`: prefill only."""
    settings_values = (strategy, budget, top_m, depth, fixed_preset, rule, temperature, precision, max_new_tokens,
                       compare_fixed, custom_tree)
    key, lab = _session_key(request), None
    try:
        prompt, settings, note = _parse(prompt, settings_values)
        prepared = labstate.prepare(prompt, settings)  # all checks before the session is touched
        lab = SESSIONS.open(key)
        lab.enter()
        try:
            labstate.start_prepared(lab, prepared)
            return render(lab, message=note)
        finally:
            lab.leave()
    except LabNotice as notice:
        return _notice(lab, notice)
    except LabInputError as error:
        return _refuse(error, request)
    except Exception as error:  # noqa: BLE001  (never a traceback in the page)
        raise _internal(error) from None


def _lab_for_decoding(key: str) -> LabState:
    """The session's state for Step/Run: created when new, SessionExpired when it was dropped."""
    lab = SESSIONS.get(key)
    return lab if lab is not None else SESSIONS.open(key)


def on_step(prompt: str, strategy: str, budget: float, top_m: float, depth: float, fixed_preset: str, rule: str,
            temperature: float, precision: str, max_new_tokens: float, compare_fixed: bool, custom_tree: str = "",
            request: gr.Request = None) -> tuple:
    """One decoding step (starting a run first when there is none)."""
    settings_values = (strategy, budget, top_m, depth, fixed_preset, rule, temperature, precision, max_new_tokens,
                       compare_fixed, custom_tree)
    key, lab = _session_key(request), None
    try:
        prompt, settings, clean_note = _parse(prompt, settings_values)
        lab = _lab_for_decoding(key)
        lab.enter()
        try:
            run, note = _ensure_run(lab, prompt, settings)
            labstate.step_run(lab, run)
            return render(lab, message=" ".join(m for m in (clean_note, note) if m),
                          compute_check=run.session.finished)
        finally:
            lab.leave()
    except LabNotice as notice:
        return _notice(lab, notice)
    except LabInputError as error:
        return _refuse(error, request)
    except Exception as error:  # noqa: BLE001
        raise _internal(error) from None


def on_run(prompt: str, strategy: str, budget: float, top_m: float, depth: float, fixed_preset: str, rule: str,
           temperature: float, precision: str, max_new_tokens: float, compare_fixed: bool, custom_tree: str = "",
           request: gr.Request = None) -> Iterator[tuple]:
    """Step to the end, streaming every step.

    Stops between steps when cancelled: Stop/Start/Reset bump the state's epoch, the session may be
    evicted, and Gradio closes this generator when the event is cancelled or the client goes away.
    """
    settings_values = (strategy, budget, top_m, depth, fixed_preset, rule, temperature, precision, max_new_tokens,
                       compare_fixed, custom_tree)
    key, lab = _session_key(request), None
    try:
        prompt, settings, clean_note = _parse(prompt, settings_values)
        lab = _lab_for_decoding(key)
        lab.enter()
    except LabNotice as notice:
        yield _notice(lab, notice)
        return
    except LabInputError as error:
        yield _refuse(error, request)
        return
    except Exception as error:  # noqa: BLE001
        raise _internal(error) from None
    try:
        run, note = _ensure_run(lab, prompt, settings)
        note = " ".join(m for m in (clean_note, note) if m)
        epoch = lab.epoch
        while not run.session.finished:
            if not SESSIONS.is_live(key, lab):
                raise labstate.SessionExpired("Your session expired while running (the lab needed room). Press "
                                              "**Start** to begin again.")
            if lab.run is not run or lab.epoch != epoch:  # Stop, Start or Reset since: end quietly
                return
            labstate.step_run(lab, run)
            SESSIONS.touch(key, lab)
            yield render(lab, message=note if not run.session.finished else "Comparing with plain greedy decoding…")
        if lab.run is run:
            yield render(lab, message=note, compute_check=True)
    except LabNotice as notice:
        yield _notice(lab, notice)
    except LabInputError as error:
        yield _refuse(error, request)
    except Exception as error:  # noqa: BLE001
        raise _internal(error) from None
    finally:
        lab.leave()


def _existing(key: str) -> LabState | None:
    """The session's state for the read-only events (None when it never had one)."""
    return SESSIONS.get(key)


def on_view(step_index: float, request: gr.Request = None) -> tuple:
    """Show a past step (slider)."""
    lab = None
    try:
        lab = _existing(_session_key(request))
        if isinstance(step_index, bool) or not isinstance(step_index, (int, float)) or step_index != step_index:
            raise LabInputError(f"step index must be a whole number, got {step_index!r}")
        index = int(max(min(step_index, 10**6), -1))
        return render(lab, index=index)
    except LabNotice as notice:
        return _notice(lab, notice)
    except LabInputError as error:
        return _refuse(error, request)
    except Exception as error:  # noqa: BLE001
        raise _internal(error) from None


def on_check(request: gr.Request = None) -> tuple:
    """Run plain greedy decoding now and compare the output so far."""
    lab = None
    try:
        lab = _existing(_session_key(request))
        if lab is None or lab.run is None:
            raise LabNotice("Nothing to check yet: press Start or Step first.")
        lab.enter()
        try:
            return render(lab, message="Compared with a plain greedy run.", compute_check=True)
        finally:
            lab.leave()
    except LabNotice as notice:
        return _notice(lab, notice)
    except Exception as error:  # noqa: BLE001
        raise _internal(error) from None


def on_reset(request: gr.Request = None) -> tuple:
    """Forget the current run (cached plain runs stay)."""
    key = _session_key(request)
    SESSIONS.forget_expiry(key)
    lab = SESSIONS.get(key)
    if lab is not None:
        lab.interrupt()
        lab.run = None
    return render(lab, message="Reset. Type a prompt and press **Start** or **Step**.")


def on_stop(request: gr.Request = None) -> None:
    """Stop a running Run between two steps (the Stop button also cancels the event itself)."""
    try:
        lab = SESSIONS.get(_session_key(request))
    except LabNotice:
        lab = None
    if lab is not None:
        lab.interrupt()


def on_unload(request: gr.Request = None) -> None:
    """The tab closed: drop its state now (Gradio calls this when the page's heartbeat ends)."""
    if request is not None and getattr(request, "session_hash", None):
        SESSIONS.drop(request.session_hash)


def on_trace(request: gr.Request = None) -> str | None:
    """Write the run as a JSON trace and return the file for download."""
    try:
        lab = _existing(_session_key(request))
    except LabNotice as notice:
        gr.Warning(str(notice).replace("**", ""))
        return None
    if lab is None or lab.run is None:
        gr.Warning("Nothing to export yet: run a few steps first.")
        return None
    run = lab.run
    stats, check = _stats(lab, run, compute_check=False)
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
    """The model/heads line in the header (loads the fp32 model once, if main() did not)."""
    rt = labstate.runtime("fp32")
    return (f"**Base model:** {rt.base.source} · **Heads:** {rt.heads_description} · "
            f"bf16 loads the same weights in bfloat16 (fast, exact only up to rounding near-ties).")


# -- layout ---------------------------------------------------------------------------------------
HOW_IT_WORKS = """
**Heads.** The base model reads the text and, at its last position, predicts the next token: the
*root* of this step's tree (left column). Medusa adds K small *heads* on the same hidden state; head k
guesses the token k+1 positions ahead. The **Heads** table under the trees lists each head's top guesses
with their probabilities. The shipped heads were trained on about 406k tokens of the model's own answers:
on MT-Bench head 1's top guess is right about 26 % of the time and within its top 5 about 50 %, so
expect about 1.7-1.9 tokens per step from a 63-node tree (Medusa's heads on Vicuna-7B: 56 % and 78 %).

**Trees.** Combining the heads' guesses gives candidate continuations: a path root → head 1 rank r1 →
head 2 rank r2 … is one guess of the next tokens. Medusa's *fixed* tree uses the same rank paths at every
step (right plot). The *dynamic* tree (left plot) picks, at every step, the *budget* paths with the highest
joint probability p1[r1]·p2[r2]·…, so it grows where the heads are confident. Node colour and size show that
joint probability. With **+ prompt lookup**, one more branch (◆ nodes) copies the tokens that followed the
last place where the text's final words appeared before (in the prompt or the answer so far): heads guess
what the model would write, lookup guesses what it will copy (names, numbers, lists, code). Copied tokens
that are accepted get a dashed purple underline in the text.

**Tree attention.** All candidates are checked in **one** forward pass of the base model. The
**Attention mask** tab shows how: each node may look at the whole context and at its own ancestors only,
so every branch is scored as if it were the only continuation. Position ids are context length + depth.

**Acceptance.** The base model's predictions at each node decide which path survives (green). *Greedy*
keeps the longest path that matches the base model's argmax, so the text is exactly plain greedy
decoding's (the check card above says so); *typical* (Medusa's rule) accepts any plausible token: faster,
but it does **not** preserve the sampling distribution;
*speculative* sampling accepts with rejection sampling and keeps the sampling distribution. After the
accepted path the base model's own next token comes for free: the orange **bonus** token, which is the
next step's root. A step therefore emits accepted guesses + 1 tokens.

**Time.** The **Timing** tab shows where each step's time goes. Verifying a bigger tree costs more: on a
CPU a 64-node tree costs several single-token forwards, so the heads must be good for it to pay off; on a
GPU bigger trees are nearly free. The cumulative plot compares this run with the fixed tree (what it would
have accepted on the same contexts) and with plain decoding (measured when a plain run exists, else
estimated from one measured single-token forward).
"""


def _settings_panel(num_heads: int) -> list[gr.components.Component]:
    presets = [*load_named_trees(), labstate.CUSTOM_TREE]
    with gr.Accordion("Settings (applied at Start)", open=True):
        strategy = gr.Radio(STRATEGY_CHOICES, value=DEFAULTS.strategy, label="Strategy", elem_id="strategy",
                            info="dynamic (auto budget): each step keeps the node count (≤ budget) with the best "
                                 "expected tokens/s, from a verify-cost profile measured once (5-10 s); "
                                 "+ prompt lookup: the tokens that followed the text's last words where they "
                                 "appeared before join the tree as one more branch (◆)")
        budget = gr.Slider(1, MAX_BUDGET, value=DEFAULTS.budget, step=1, label="Node budget (dynamic tree)",
                           elem_id="budget")
        top_m = gr.Slider(1, MAX_TOP_M, value=DEFAULTS.top_m, step=1, label="Top-m per head (dynamic tree)",
                          elem_id="top-m")
        depth = gr.Slider(1, num_heads, value=min(DEFAULTS.depth, num_heads), step=1, label="Depth (heads used)",
                          elem_id="depth")
        preset = gr.Dropdown(presets, value=DEFAULTS.fixed_preset, label="Fixed tree preset", elem_id="preset")
        custom_tree = gr.Textbox("", label="Custom tree (JSON list of rank paths; used when the preset is "
                                           "“custom”)",
                                 placeholder=CUSTOM_TREE_EXAMPLE, lines=2, max_lines=6, elem_id="custom-tree",
                                 info=f"Path [r1, r2, …] = head 1's rank-r1 token, then head 2's rank-r2 token, …; "
                                      f"every path's parent must be in the list; up to "
                                      f"{labstate.MAX_CUSTOM_TREE_NODES} paths, {num_heads} deep, ranks "
                                      f"0-{MAX_TOP_M - 1}.")
        compare = gr.Checkbox(value=DEFAULTS.compare_fixed, label="Compare with the fixed tree (dynamic only; "
                                                                   "costs a second verify)", elem_id="compare")
        rule = gr.Radio(list(RULES), value=DEFAULTS.rule, label="Acceptance rule", elem_id="rule")
        temperature = gr.Slider(0.0, labstate.MAX_TEMPERATURE, value=DEFAULTS.temperature, step=0.05,
                                label="Temperature (0 = greedy)", elem_id="temperature")
        precision = gr.Radio([("fp32 (exact)", "fp32"), ("bf16 (fast)", "bf16")], value=DEFAULTS.precision,
                             label="Precision", elem_id="precision")
        max_new = gr.Slider(1, MAX_NEW_TOKENS, value=DEFAULTS.max_new_tokens, step=1, label="Max new tokens",
                            elem_id="max-new")
    return [strategy, budget, top_m, depth, preset, rule, temperature, precision, max_new, compare, custom_tree]


def _num_heads() -> int:
    """Heads available for the depth slider (reads the shipped config when present; no model load)."""
    config = ASSETS / "heads" / "config.json"
    if config.exists():
        return int(json.loads(config.read_text())["num_heads"])
    return DEFAULTS.depth


def _benchmark_tab() -> None:
    """The committed `python -m core.bench` results (assets/results/bench_*.json), read at build time."""
    files = sorted(RESULTS.glob("bench_*.json"))
    if not files:
        gr.Markdown("No benchmark results are shipped yet: run `python -m core.bench ... --out assets/results/bench_NAME.json`.")
        return
    for path in files:
        result = json.loads(path.read_text())
        config = result["config"]
        count = config.get("prompt_count") or config.get("limit") or "all"
        device = result["device"].get("cuda") or result["device"]["type"]
        cut = (f" (cut off by its time limit after {count} of {config.get('prompts_planned')} prompts)"
               if result.get("complete") is False else "")
        gr.Markdown(f"#### {path.stem}: {count} prompts from `{Path(config['prompts']).name}`{cut}, "
                    f"{config['max_new_tokens']} new tokens, {config['dtype']}, {device}\n\n"
                    + markdown_table(result))
        gr.Plot(bench_figure(result, path.stem), show_label=False)


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
                    trace_btn = gr.Button("Build JSON trace of this run", size="sm")
                    trace_file = gr.File(label="JSON trace", interactive=False)
            with gr.Column(scale=3, min_width=600):
                status = gr.Markdown("Type a prompt and press **Start** or **Step**.", elem_id="status",
                                     label="status")
                stats = gr.HTML(stats_html(RunStats()), elem_id="stats", label="stats")
                text = gr.HTML(text_html([]), elem_id="gen-text", label="text")
                step_slider = gr.Slider(0, 1, value=0, step=1, label="Revisit a step", interactive=False,
                                        elem_id="step-slider")
                with gr.Tabs():
                    with gr.Tab("Trees: dynamic vs fixed"):
                        with gr.Row(equal_height=False):
                            tree = gr.Plot(empty_figure("Type a prompt and press Start or Step."), show_label=False,
                                           elem_id="tree-plot", label="tree")
                            tree_compare = gr.Plot(empty_figure(""), show_label=False, elem_id="tree-compare-plot",
                                                   label="tree_compare")
                        heads = gr.HTML(heads_html(None), elem_id="heads", label="heads")
                    with gr.Tab("Attention mask"):
                        mask = gr.Plot(empty_figure(""), show_label=False, elem_id="mask-plot", label="mask")
                    with gr.Tab("Timing"):
                        phases = gr.Plot(empty_figure(""), show_label=False, elem_id="phase-plot", label="phases")
                        with gr.Row():
                            accepted = gr.Plot(empty_figure(""), show_label=False, elem_id="accepted-plot",
                                               label="accepted")
                            cumulative = gr.Plot(empty_figure(""), show_label=False, elem_id="cumulative-plot",
                                                 label="cumulative")
                    with gr.Tab("Benchmarks"):
                        _benchmark_tab()
                    with gr.Tab("Text & summary"):
                        plain_text = gr.Textbox(label="Decoded text", lines=8, interactive=False,
                                                buttons=["copy"], elem_id="plain-text")
                        summary = gr.JSON(label="Run summary", elem_id="summary")
                with gr.Accordion("How it works", open=False):
                    gr.Markdown(HOW_IT_WORKS)

        view = [status, stats, text, plain_text, summary, step_slider, tree, tree_compare, heads, mask,
                phases, accepted, cumulative]
        inputs = [prompt, *settings]
        # raw payloads: labstate checks every value itself (clear messages for any JSON type)
        decode = {"show_progress": "minimal", "concurrency_id": "decode", "preprocess": False}
        run_event = run_btn.click(on_run, inputs, view, api_name="run", **decode)
        start_btn.click(on_start, inputs, view, api_name="start", cancels=[run_event], **decode)
        step_btn.click(on_step, inputs, view, api_name="step", **decode)
        stop_btn.click(None, None, None, cancels=[run_event], api_visibility="private")
        stop_btn.click(on_stop, None, None, api_name="stop", queue=False)  # the loop also checks between steps
        reset_btn.click(on_reset, None, view, api_name="reset", cancels=[run_event])
        check_btn.click(on_check, None, view, api_name="check", **decode)
        step_slider.release(on_view, [step_slider], view, api_name="view", show_progress="hidden", preprocess=False)
        trace_btn.click(on_trace, None, [trace_file], api_name="trace")
        example.input(EXAMPLES.get, [example], [prompt], api_visibility="private", queue=False)
        demo.load(on_load, None, [model_info], api_visibility="private")
        demo.unload(on_unload)
    demo.queue(default_concurrency_limit=CONCURRENCY, max_size=QUEUE_SIZE)
    return demo


demo = build_demo()


def launch_kwargs() -> dict[str, Any]:
    """Styling and safety options that Gradio 6 takes at launch time (never a public share link)."""
    return {"css_paths": [CSS_PATH], "js": FORCE_LIGHT_JS, "theme": gr.themes.Default(), "share": False,
            # the page uploads nothing; Gradio's own session store is bounded like ours
            "max_file_size": "1mb", "state_session_capacity": max(64, 4 * MAX_SESSIONS)}


def main(argv: list[str] | None = None) -> None:
    """Load the model, then serve on 127.0.0.1 (port: --port, else GRADIO_SERVER_PORT, else 7860)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    args = parser.parse_args(argv)
    labstate.runtime("fp32")  # load once before the first visitor
    demo.launch(server_name=args.host, server_port=args.port, **launch_kwargs())


if __name__ == "__main__":
    main()
