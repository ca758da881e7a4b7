"""Medusa Tree Lab: step through Medusa-style speculative decoding with a dynamic candidate tree.

Wiring only: `labstate` runs the decoder (core/), `viz` draws. Importing this module builds the
Blocks but launches nothing; `python app.py [--port N]` serves on 127.0.0.1 (port from --port,
else GRADIO_SERVER_PORT, else 7860).

API (gradio_client), every event returns the VIEW outputs listed in `VIEW_OUTPUT_NAMES`:
  start(prompt, *settings), step(prompt, *settings), run(prompt, *settings)  [run streams],
  view(step_index), check(), reset(); trace() returns the JSON trace file.
Settings, in order: strategy, budget, top_m, depth, fixed_preset, rule, temperature,
precision, max_new_tokens, compare_fixed.
"""
from __future__ import annotations

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no network calls

import argparse
import json
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import gradio as gr

import labstate
from core.accept import RULES
from core.decoder import MAX_BUDGET, MAX_NEW_TOKENS, MAX_TOP_M, STRATEGIES
from core.tree import load_named_trees
from labstate import LabInputError, LabState, Run, Settings
from viz.mask_plot import mask_figure
from viz.text_html import RunStats, emitted_tokens, heads_html, stats_html, text_html
from viz.timing_plot import accepted_figure, cumulative_figure, phase_figure
from viz.trace import trace_json
from viz.tree_plot import empty_figure, tree_figure

ASSETS = Path(__file__).resolve().parent / "assets"
MT_BENCH = ASSETS / "data" / "mt_bench.jsonl"
CSS_PATH = ASSETS / "app.css"
DEFAULTS = Settings()
DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
CONCURRENCY = int(os.environ.get("MEDUSA_LAB_CONCURRENCY", "2"))
STATE_TTL_S = 2 * 3600
TRACE_DIR = Path(tempfile.gettempdir()) / "medusa-lab-traces"
TRACE_TTL_S = 3600
FORCE_LIGHT_JS = "() => { document.body.classList.remove('dark'); }"

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
def _status(run: Run, message: str) -> str:
    session = run.session
    state = f"finished ({session.stop_reason})" if session.finished else "running"
    parts = [f"**{len(session.records)} step(s)** · {run.settings.strategy} · {run.settings.precision} · {state}."]
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
        "model": run.runtime.base.source, "heads": run.runtime.heads_description,
    }


def _tree_titles(run: Run) -> tuple[str, str]:
    settings = run.settings
    if settings.strategy == "dynamic":
        main = f"Dynamic tree (budget {settings.budget}, top-{settings.top_m}, depth {settings.depth})"
    elif settings.strategy == "fixed":
        main = f"Fixed tree {settings.fixed_preset}"
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
        return (lab, *_empty_view(message or "Type a prompt and press **Start** or **Step**."))
    records = run.session.records
    index = len(records) - 1 if index is None else max(0, min(int(index), len(records) - 1))
    record = records[index]
    stats, check = _stats(lab, run, compute_check)
    tokens = emitted_tokens(records, run.session.output_ids[0], records[0].outcome.node_texts[0],
                            len(run.session.output_ids))
    main_title, compare_title = _tree_titles(run)
    compare = (tree_figure(record.comparison, compare_title) if record.comparison is not None else
               empty_figure("The fixed-tree comparison is shown for the dynamic strategy with “compare” on."))
    slider = gr.Slider(minimum=0, maximum=max(len(records) - 1, 1), value=index, interactive=len(records) > 1,
                       label=f"Revisit a step (0 … {len(records) - 1})")
    return (
        lab, _status(run, message), stats_html(stats), text_html(tokens, index),
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
    view[0] = _status(run, message or default)
    view[1] = stats_html(stats)
    view[2] = text_html(emitted_tokens([], first, text, 1))
    view[3] = run.runtime.base.decode([first])
    view[4] = _summary(run, stats, check, None)
    blank = empty_figure("Prefill done: the base model chose the first token." +
                         ("" if run.session.finished else " Press Step for the first tree."))
    view[6] = view[7] = blank
    return (lab, *view)


# -- event handlers -------------------------------------------------------------------------------
def _warn(lab: LabState | None, error: LabInputError) -> tuple:
    gr.Warning(str(error))
    return render(lab, message=f"⚠️ {error}")


def _ensure_run(lab: LabState | None, prompt: str, settings_values: tuple) -> tuple[LabState, Run, str]:
    """The current run, or a new one when there is none (so Step and Run also start)."""
    lab = lab if lab is not None else LabState()
    settings = labstate.parse_settings(*settings_values)
    run = lab.run
    changed = run is not None and (prompt != run.prompt or settings != run.settings)
    if run is not None and not run.session.finished:
        return lab, run, "Prompt or settings changed: press **Start** to apply them." if changed else ""
    if run is not None and not changed:
        raise LabInputError(f"Decoding has finished ({run.session.stop_reason}). Press Start for a new run.")
    return lab, labstate.start_run(lab, prompt, settings), ""


def on_start(lab: LabState | None, prompt: str, strategy: str, budget: float, top_m: float, depth: float,
             fixed_preset: str, rule: str, temperature: float, precision: str, max_new_tokens: float,
             compare_fixed: bool) -> tuple:
    """Start (or restart) decoding `prompt`: prefill only."""
    lab = lab if lab is not None else LabState()
    try:
        settings = labstate.parse_settings(strategy, budget, top_m, depth, fixed_preset, rule, temperature,
                                           precision, max_new_tokens, compare_fixed)
        labstate.start_run(lab, prompt, settings)
    except LabInputError as error:
        return _warn(lab, error)
    return render(lab)


def on_step(lab: LabState | None, prompt: str, strategy: str, budget: float, top_m: float, depth: float,
            fixed_preset: str, rule: str, temperature: float, precision: str, max_new_tokens: float,
            compare_fixed: bool) -> tuple:
    """One decoding step (starting a run first when there is none)."""
    settings_values = (strategy, budget, top_m, depth, fixed_preset, rule, temperature, precision, max_new_tokens,
                       compare_fixed)
    try:
        lab, run, note = _ensure_run(lab, prompt, settings_values)
        labstate.step_run(lab, run)
    except LabInputError as error:
        return _warn(lab, error)
    return render(lab, message=note, compute_check=run.session.finished)


def on_run(lab: LabState | None, prompt: str, strategy: str, budget: float, top_m: float, depth: float,
           fixed_preset: str, rule: str, temperature: float, precision: str, max_new_tokens: float,
           compare_fixed: bool) -> Iterator[tuple]:
    """Step to the end, streaming every step; the Stop button cancels it."""
    settings_values = (strategy, budget, top_m, depth, fixed_preset, rule, temperature, precision, max_new_tokens,
                       compare_fixed)
    try:
        lab, run, note = _ensure_run(lab, prompt, settings_values)
    except LabInputError as error:
        yield _warn(lab, error)
        return
    while not run.session.finished and lab.run is run:
        try:
            labstate.step_run(lab, run)
        except LabInputError as error:
            yield _warn(lab, error)
            return
        yield render(lab, message=note if not run.session.finished else "Comparing with plain greedy decoding…")
    if lab.run is run:
        yield render(lab, message=note, compute_check=True)


def on_view(lab: LabState | None, step_index: float) -> tuple:
    """Show a past step (slider)."""
    return render(lab, index=int(step_index) if step_index is not None else None)


def on_check(lab: LabState | None) -> tuple:
    """Run plain greedy decoding now and compare the output so far."""
    if lab is None or lab.run is None:
        return _warn(lab, LabInputError("Nothing to check yet: press Start or Step first."))
    return render(lab, message="Compared with a plain greedy run.", compute_check=True)


def on_reset(lab: LabState | None) -> tuple:
    """Forget the current run (cached plain runs stay)."""
    if lab is not None:
        lab.run = None
    return render(lab, message="Reset. Type a prompt and press **Start** or **Step**.")


def on_trace(lab: LabState | None) -> str | None:
    """Write the run as a JSON trace and return the file for download."""
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
with their probabilities. Untrained heads (the default until trained ones ship) mostly guess wrong, so
expect about one token per step.

**Trees.** Combining the heads' guesses gives candidate continuations: a path root → head 1 rank r1 →
head 2 rank r2 … is one guess of the next tokens. Medusa's *fixed* tree uses the same rank paths at every
step (right plot). The *dynamic* tree (left plot) picks, at every step, the *budget* paths with the highest
joint probability p1[r1]·p2[r2]·…, so it grows where the heads are confident. Node colour and size show that
joint probability.

**Tree attention.** All candidates are checked in **one** forward pass of the base model. The
**Attention mask** tab shows how: each node may look at the whole context and at its own ancestors only,
so every branch is scored as if it were the only continuation. Position ids are context length + depth.

**Acceptance.** The base model's predictions at each node decide which path survives (green). *Greedy*
keeps the longest path that matches the base model's argmax, so the text is exactly plain greedy
decoding's (the check card above says so); *typical* accepts plausible tokens (faster, not exact);
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
    presets = list(load_named_trees())
    with gr.Accordion("Settings (applied at Start)", open=True):
        strategy = gr.Radio(list(STRATEGIES), value=DEFAULTS.strategy, label="Strategy", elem_id="strategy")
        budget = gr.Slider(1, MAX_BUDGET, value=DEFAULTS.budget, step=1, label="Node budget (dynamic tree)",
                           elem_id="budget")
        top_m = gr.Slider(1, MAX_TOP_M, value=DEFAULTS.top_m, step=1, label="Top-m per head (dynamic tree)",
                          elem_id="top-m")
        depth = gr.Slider(1, num_heads, value=min(DEFAULTS.depth, num_heads), step=1, label="Depth (heads used)",
                          elem_id="depth")
        preset = gr.Dropdown(presets, value=DEFAULTS.fixed_preset, label="Fixed tree preset", elem_id="preset")
        compare = gr.Checkbox(value=DEFAULTS.compare_fixed, label="Compare with the fixed tree (dynamic only; "
                                                                   "costs a second verify)", elem_id="compare")
        rule = gr.Radio(list(RULES), value=DEFAULTS.rule, label="Acceptance rule", elem_id="rule")
        temperature = gr.Slider(0.0, labstate.MAX_TEMPERATURE, value=DEFAULTS.temperature, step=0.05,
                                label="Temperature (0 = greedy)", elem_id="temperature")
        precision = gr.Radio([("fp32 (exact)", "fp32"), ("bf16 (fast)", "bf16")], value=DEFAULTS.precision,
                             label="Precision", elem_id="precision")
        max_new = gr.Slider(1, MAX_NEW_TOKENS, value=DEFAULTS.max_new_tokens, step=1, label="Max new tokens",
                            elem_id="max-new")
    return [strategy, budget, top_m, depth, preset, rule, temperature, precision, max_new, compare]


def _num_heads() -> int:
    """Heads available for the depth slider (reads the shipped config when present; no model load)."""
    config = ASSETS / "heads" / "config.json"
    if config.exists():
        return int(json.loads(config.read_text())["num_heads"])
    return DEFAULTS.depth


def build_demo() -> gr.Blocks:
    """The whole UI. Nothing is loaded or launched here."""
    with gr.Blocks(title="Medusa Tree Lab", delete_cache=(3600, 3600)) as demo:
        lab = gr.State(None, time_to_live=STATE_TTL_S)
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
                    with gr.Tab("Text & summary"):
                        plain_text = gr.Textbox(label="Decoded text", lines=8, interactive=False,
                                                buttons=["copy"], elem_id="plain-text")
                        summary = gr.JSON(label="Run summary", elem_id="summary")
                with gr.Accordion("How it works", open=False):
                    gr.Markdown(HOW_IT_WORKS)

        view = [lab, status, stats, text, plain_text, summary, step_slider, tree, tree_compare, heads, mask,
                phases, accepted, cumulative]
        inputs = [lab, prompt, *settings]
        progress = {"show_progress": "minimal", "concurrency_id": "decode"}
        run_event = run_btn.click(on_run, inputs, view, api_name="run", **progress)
        start_btn.click(on_start, inputs, view, api_name="start", cancels=[run_event], **progress)
        step_btn.click(on_step, inputs, view, api_name="step", **progress)
        stop_btn.click(None, None, None, cancels=[run_event], api_visibility="private")
        reset_btn.click(on_reset, [lab], view, api_name="reset", cancels=[run_event])
        check_btn.click(on_check, [lab], view, api_name="check", **progress)
        step_slider.release(on_view, [lab, step_slider], view, api_name="view", show_progress="hidden")
        trace_btn.click(on_trace, [lab], [trace_file], api_name="trace")
        example.input(EXAMPLES.get, [example], [prompt], api_visibility="private", queue=False)
        demo.load(on_load, None, [model_info], api_visibility="private")
    demo.queue(default_concurrency_limit=CONCURRENCY)
    return demo


demo = build_demo()


def launch_kwargs() -> dict[str, Any]:
    """Styling options that Gradio 6 takes at launch time."""
    return {"css_paths": [CSS_PATH], "js": FORCE_LIGHT_JS, "theme": gr.themes.Default(), "share": False}


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
