"""The page's components: header, live controls, settings panel, the view's tabs and the replay box
(no events here), and the API shape of the settings events (`settings_event`).

app.py wires them. Each builder returns its components by name.
"""
from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr

import labstate
from viz.view import VIEW_FIELDS, StepControl, View, empty_view
from viz import economics
from viz.bench_plot import (bench_figure, bench_heading, category_table, markdown_table, result_order,
                            step_trace_figure, stepped_strategies)
from core.families import FAMILIES
from core.strategy import ACCEPT_RULES, MAX_BUDGET, MAX_NEW_TOKENS, MAX_TOP_M

ASSETS = Path(__file__).resolve().parent / "assets"


def rivals() -> list[tuple[str, str]]:
    """The compare-heads choices: none, the family table's usual rival, or each family offered as one."""
    return [("none", ""), ("the usual rival (Medusa ↔ Hydra, EAGLE → Hydra)", "auto"),
            *((FAMILIES[name].rival_choice, name) for name in labstate.rival_choices()[2:])]


CUSTOM_TREE_EXAMPLE = "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"
FIRST_SCRIPT = (ASSETS / "timer_frames.js").read_text(encoding="utf-8")
INTRO = ('<div class="lab-header"><h1>Medusa Tree Lab</h1><p>Speculative decoding one step at a time: heads '
         'propose a <b>dynamic candidate tree</b>, one forward pass verifies it, the base model accepts a path.'
         '</p></div>')


def mt_bench_examples() -> dict[str, str]:
    """Dropdown label -> first turn, from the shipped copy of MT-Bench."""
    examples = {}
    for line in (ASSETS / "data" / "mt_bench.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            first = row["turns"][0]
            short = first if len(first) <= 70 else first[:69] + "…"
            examples[f"{row['question_id']} · {row['category']} · {short}"] = first
    return examples


def header(replay_only: bool, why: str = "") -> gr.Markdown:
    """The title, and the line that says what this server runs (the model, or recordings only)."""
    gr.HTML(INTRO)
    if replay_only:
        reason = f" because {why}" if why else ""
        return gr.Markdown(f"**Replay-only mode{reason}: live decoding is off.** The gallery below replays runs "
                           f"recorded on the real model (trees, timings and the plain-decoding baseline as "
                           f"measured then); upload a trace exported from a live lab to replay it too.",
                           elem_classes=["model-info", "replay-only"], elem_id="model-info")
    return gr.Markdown("Loading the model…", elem_classes=["model-info"], elem_id="model-info")


def replay_controls(gallery: tuple, open_: bool, live: bool) -> dict:
    """The gallery picker, the trace upload, the replay's Back / Step / Run to end, with its state, and the
    recording's settings (read-only). On a `live` page the replay's buttons and the recording's settings
    show only while a recording is on screen, in place of the live controls (assets/app.css), with a button
    back to the live run: one Step / Run to end pair on screen at a time."""
    with gr.Accordion("Recorded runs: the gallery (no model needed)", open=open_, elem_id="replay-box",
                      elem_classes=["live-page"] if live else []):
        # numbered in the order a lecture takes them (scripts/record_gallery.py's order)
        choices = [(f"{number}. {entry.title}", entry.name) for number, entry in enumerate(gallery, start=1)]
        box = {"state": gr.State(None),
               "pick": gr.Dropdown(choices, value=choices[0][1] if open_ and choices else None,
                                   label="Gallery run, in lecture order (each shows one thing)",
                                   elem_id="gallery-pick"),
               "upload": gr.UploadButton("…or replay a trace you exported (.json)", file_types=[".json"],
                                         type="binary", size="sm", elem_id="trace-upload")}
        with gr.Row(elem_id="replay-buttons"):
            box["back"] = gr.Button("◀ Back", size="sm", elem_id="replay-back-btn")
            box["step"] = gr.Button("Step ▶", variant="primary", size="sm", elem_id="replay-step-btn")
            box["end"] = gr.Button("Run to end ▶▶", size="sm", elem_id="replay-end-btn")
        box["recording"] = gr.Markdown("", visible=False, elem_id="recording-settings")
        if live:
            box["live"] = gr.Button("◀ Back to the prompt and settings (your live run)", size="sm",
                                    elem_id="back-to-live-btn")
        gr.Checkbox(False, label="Large type (presenter: ← → keys step the replay)", elem_id="presenter-toggle",
                    interactive=True)
    return box


def live_controls(default_prompt: str, settings_panel: Callable[[], list], whole_runs: bool = False) -> dict:
    """The prompt, the decoding buttons, the settings and the export box; with `whole_runs` (a ZeroGPU
    Space) the prompt, one Start that decodes a whole run, and the settings."""
    examples = mt_bench_examples()
    with gr.Column(elem_id="live-controls"):  # hidden while a recording is on screen (assets/app.css)
        controls = {"examples": examples,
                    "lecture": gr.Button("Lecture preset: heads that guess well",
                                         size="sm", elem_id="lecture-btn"),
                    "example": gr.Dropdown(list(examples), value=None, label="MT-Bench examples", filterable=True),
                    "prompt": gr.Textbox(default_prompt, label="Prompt", lines=4, max_lines=10, elem_id="prompt")}
        if whole_runs:
            controls["start"] = gr.Button("Start: decode the whole run on the GPU, then step through it",
                                          variant="primary", elem_id="start-btn")
            controls["settings"] = settings_panel()
            return controls
        return _live_controls(controls, settings_panel)


def _live_controls(controls: dict, settings_panel: Callable[[], list]) -> dict:
    with gr.Row():
        controls["start"] = gr.Button("Start / Restart", variant="secondary", elem_id="start-btn")
        controls["step"] = gr.Button("Step ▶", variant="primary", elem_id="step-btn")
    with gr.Row():
        controls["run"] = gr.Button("Run to end ▶▶", elem_id="run-btn")
        controls["stop"] = gr.Button("Stop ■", variant="stop", elem_id="stop-btn")
    with gr.Row():
        controls["reset"] = gr.Button("Reset", size="sm", elem_id="reset-btn")
        controls["check"] = gr.Button("Check vs plain greedy", size="sm", elem_id="check-btn")
    controls["settings"] = settings_panel()
    # the page's clock at a Step, Run or Stop click (set by the click's js): a click made before Stop is dropped
    controls["clicked_at"] = gr.Number(None, visible=False, label="clicked at (ms, page clock)")
    # a browser on the serving machine says it has drawn a Run's redraw (assets/page.js clicks it): the run waits
    controls["drawn"] = gr.Button("drawn", visible="hidden", elem_id="drawn-btn")
    controls["drawn_number"] = gr.Number(None, visible=False, label="redraw drawn")
    with gr.Accordion("Export", open=False):
        controls["trace"] = gr.Button("Build JSON trace of this run", size="sm", elem_id="trace-btn")
        controls["trace_file"] = gr.File(label="JSON trace", interactive=False, elem_id="trace-file")
    return controls


def _num_heads(default: int) -> int:
    """Heads available for the depth slider (reads the shipped config when present; no model load)."""
    config = ASSETS / "heads" / "config.json"
    return int(json.loads(config.read_text())["num_heads"]) if config.exists() else default


def settings_panel(defaults: labstate.Settings) -> dict[str, gr.components.Component]:
    """The settings by name (`labstate.SETTING_NAMES`), showing `defaults`."""
    values, num_heads = defaults.raw(), _num_heads(defaults.depth)
    presets = [*labstate.load_named_trees(), labstate.CUSTOM_TREE]
    choices = [(label, name) for name, label in labstate.strategy_labels().items()]
    with gr.Accordion("Settings (applied at Start)", open=True):
        return {
            "strategy": gr.Radio(choices, value=values["strategy"], label="Strategy", elem_id="strategy",
                                 info=labstate.strategy_help()[values["strategy"]]),
            "budget": gr.Slider(1, MAX_BUDGET, value=values["budget"], step=1,
                                label="Node budget (dynamic tree; the auto budget's ceiling)", elem_id="budget"),
            "top_m": gr.Slider(1, MAX_TOP_M, value=values["top_m"], step=1, label="Top-m per head (dynamic tree)",
                               elem_id="top-m"),
            "depth": gr.Slider(1, num_heads, value=min(values["depth"], num_heads), step=1,
                               label="Depth (heads used)", elem_id="depth"),
            "fixed_preset": gr.Dropdown(presets, value=values["fixed_preset"], label="Fixed tree preset",
                                        elem_id="preset"),
            "custom_tree": gr.Textbox(values["custom_tree"], label="Custom tree (JSON list of rank paths; used when "
                                      "the preset is “custom”)", placeholder=CUSTOM_TREE_EXAMPLE, lines=2,
                                      max_lines=6, elem_id="custom-tree",
                                      info=f"Path [r1, r2, …] = head 1's rank-r1 token, then head 2's rank-r2 token, "
                                           f"…; every path's parent must be in the list; up to "
                                           f"{labstate.MAX_CUSTOM_TREE_NODES} paths, {num_heads} deep, ranks 0-"
                                           f"{MAX_TOP_M - 1} (a fixed tree reads the ranks it names, whatever "
                                           f"the top-m setting)."),
            "compare_fixed": gr.Checkbox(value=values["compare_fixed"], label="Compare with the fixed tree "
                                         "(dynamic only; costs a second verify, not counted in tokens/s)",
                                         elem_id="compare"),
            "compare_heads": gr.Dropdown(rivals(), value=values["compare_heads"], elem_id="compare-heads",
                                         label="Also draw another drafter's tree on the same context (a third "
                                               "verify, not counted; for the dynamic, Hydra and EAGLE trees)"),
            "rule": gr.Radio(list(ACCEPT_RULES), value=values["rule"], label="Acceptance rule", elem_id="rule"),
            "temperature": gr.Slider(0.0, labstate.MAX_TEMPERATURE, value=values["temperature"], step=0.05,
                                     label="Temperature (0 = greedy)", elem_id="temperature"),
            "precision": gr.Radio([("gguf (the GGUF's own 4-bit weights, read as they are)", "gguf"),
                                   ("gguf-q8 (the same weights times 8-bit inputs: llama.cpp's arithmetic)",
                                    "gguf-q8"),
                                   ("bf16 weights", "bf16"), ("fp32", "fp32")], value=values["precision"],
                                  label="Precision (every one exact: a tree changes the speed, never the text)",
                                  elem_id="precision"),
            "max_new_tokens": gr.Slider(1, MAX_NEW_TOKENS, value=values["max_new_tokens"], step=1,
                                        label="Max new tokens", elem_id="max-new"),
        }


def benchmark_tab(results: Path) -> None:
    """The committed benchmark results (the current ones; earlier ones live in git's history): CPU runs
    first, MT-Bench first, each with its table, its figure and, folded, its step-by-step traces."""
    files = sorted(results.glob("bench_*.json"), key=lambda path: result_order(path.stem))
    if not files:
        gr.Markdown("No benchmark results are shipped yet: run `python -m core.bench ... --out assets/results/X.json`.")
        return
    for path in files:
        result = json.loads(path.read_text())
        gr.Markdown(bench_heading(result) + "\n\n" + markdown_table(result), elem_classes=["bench-table"])
        gr.Plot(bench_figure(result), show_label=False)  # titled in words (set, precision, prompts)
        for strategy in stepped_strategies(result):
            with gr.Accordion(f"{strategy} step by step: tree sizes and controller state per prompt", open=False):
                gr.Plot(step_trace_figure(result, strategy), show_label=False)
        if category_table(result):
            with gr.Accordion("Per category (worst prompt in brackets)", open=False):
                gr.Markdown(category_table(result), elem_classes=["bench-table"])


def view_panel(results: Path, how_it_works: Path) -> dict[str, gr.components.Component]:
    """The outputs every decoding and replay event redraws, by name (`viz.view.VIEW_FIELDS`), in their
    tabs, then the benchmark tab (`results`) and How it works (the Markdown file `how_it_works`)."""
    blank = empty_view()
    view = {"status": gr.Markdown(blank.status, elem_id="status", label="run status"),
            "stats": gr.HTML(blank.stats, elem_id="stats", label="stats"),
            "text": gr.HTML(blank.text, elem_id="gen-text", label="text"),
            "step_slider": gr.Slider(1, 2, value=1, step=1, label="Revisit a step (after the first step)",
                                     interactive=False, visible=False, elem_id="step-slider")}
    with gr.Tabs():
        with gr.Tab("Trees: dynamic vs fixed"):
            with gr.Row(equal_height=False):  # what to notice beside the tree (below it when narrow)
                view["tree"] = gr.Plot(blank.tree, show_label=False, elem_id="tree-plot", label="tree", scale=4,
                                       min_width=520)
                view["notice"] = gr.Markdown(blank.notice, elem_id="notice", elem_classes=["notice"], min_width=220,
                                             visible=False)
            with gr.Accordion("Verification: why the path stopped there", open=True):
                view["verify"] = gr.HTML(blank.verify, elem_id="verify", label="verify")
            view["tree_compare"] = gr.Plot(blank.tree_compare, show_label=False, elem_id="tree-compare-plot",
                                           label="tree_compare")
            view["tree_rival"] = gr.Plot(blank.tree_rival, show_label=False, elem_id="tree-rival-plot",
                                         label="tree_rival", visible=False)
            view["heads"] = gr.HTML(blank.heads, elem_id="heads", label="heads")
        with gr.Tab("Attention mask"):
            view["mask"] = gr.Plot(blank.mask, show_label=False, elem_id="mask-plot", label="mask")
        with gr.Tab("Timing"):
            for name, elem_id in (("phases", "phase-plot"), ("accepted", "accepted-plot"),
                                  ("cumulative", "cumulative-plot")):
                view[name] = gr.Plot(getattr(blank, name), show_label=False, elem_id=elem_id, label=name)
        with gr.Tab("Benchmarks"):
            benchmark_tab(results)
        with gr.Tab("Text & summary"):
            view["plain_text"] = gr.Textbox(label="Decoded text", lines=8, interactive=False, buttons=["copy"],
                                            elem_id="plain-text")
            view["summary"] = gr.JSON(label="Run summary", elem_id="summary")
    with gr.Accordion("How it works", open=False):
        gr.Markdown(how_it_works.read_text())
    return view


def economics_panel(results: Path) -> dict[str, gr.components.Component]:
    """"When does a tree pay?": sliders for the acceptance by depth and a step's cost, the arithmetic in
    a sentence and a figure with the trees this project measured (`viz.economics`); app.py wires them."""
    acceptance, cost = economics.DEFAULT_ACCEPTANCE, economics.DEFAULT_COST
    points = economics.measured_points(results)
    with gr.Accordion("When does a tree pay? Move the sliders", open=False, elem_id="economics"):
        with gr.Row():
            depths = [gr.Slider(0, 1, value=rate, step=0.01, label=f"accepted at depth {k + 1}, given depth {k}"
                                if k else "accepted at depth 1", elem_id=f"economics-a{k + 1}")
                      for k, rate in enumerate(acceptance)]
            step_cost = gr.Slider(1, 8, value=cost, step=0.05, elem_id="economics-cost",
                                  label="a step's cost, in plain steps (drafting + verify)")
        sentence = gr.Markdown(economics.economics_sentence(acceptance, cost), elem_id="economics-sentence")
        figure = gr.Plot(economics.economics_figure(acceptance, cost, points), show_label=False,
                         elem_id="economics-plot")
    return {"depths": depths, "cost": step_cost, "sentence": sentence, "figure": figure,
            "points": gr.State(points)}


def settings_event(defaults: dict[str, Any], *extra: str) -> Callable[[Callable], Callable]:
    """`handler(values, request=..., **extra)` as an event handler whose signature (the API's parameters
    and their defaults) is the prompt, every setting by name (`defaults`: the page's), then `extra`,
    then the request Gradio injects; `values` holds the prompt and the settings by name."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature([inspect.Parameter("prompt", kind, annotation=str)]
                                  + [inspect.Parameter(name, kind, default=defaults[name]) for name in labstate.SETTING_NAMES]
                                  + [inspect.Parameter(name, kind, default=None) for name in (*extra, "request")])

    def wrap(handler: Callable) -> Callable:
        def split(args: tuple, kwargs: dict) -> tuple[dict, dict]:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            return values, {name: values.pop(name) for name in (*extra, "request")}

        def event(*args: Any, **kwargs: Any) -> tuple:
            values, others = split(args, kwargs)
            return handler(values, **others)

        def streamed(*args: Any, **kwargs: Any) -> Iterator[tuple]:  # Gradio streams a generator function
            values, others = split(args, kwargs)
            yield from handler(values, **others)

        chosen = streamed if inspect.isgeneratorfunction(handler) else event
        functools.update_wrapper(chosen, handler, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
        chosen.__signature__ = signature
        chosen.__annotations__ = {"request": gr.Request}  # where Gradio injects the request
        return chosen
    return wrap


class FirstInHead:
    """ASGI middleware: `script` as the first element of the page's <head> (Gradio's own `head=` lands after
    its modules have run, too late to wrap what they capture at load). Only the page's HTML is touched;
    the API, files and the queue's event stream pass through unbuffered."""

    def __init__(self, app: Callable, script: str = FIRST_SCRIPT) -> None:
        self.app = app
        self.tag = f"<script>{script}</script>".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or not scope["path"].endswith("/"):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body = bytearray()

        async def send_html_with_script(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if not headers.get(b"content-type", b"").startswith(b"text/html") or b"content-encoding" in headers:
                    await send(message)
                    return
                start = message  # held until the body is whole: its length changes
                return
            if start is None:
                await send(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            html = bytes(body).replace(b"<head>", b"<head>" + self.tag, 1)
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(html)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": html})

        await self.app(scope, receive, send_html_with_script)


def view_outputs(view: View) -> tuple:
    """A View as the page's outputs, in VIEW_FIELDS order (the step control becomes a slider)."""
    values = {name: getattr(view, name) for name in VIEW_FIELDS}
    values["step_slider"] = revisit_slider(view.step_slider)
    values["notice"] = gr.Markdown(view.notice, visible=bool(view.notice))  # no empty box beside a live tree
    values["tree_rival"] = gr.Plot(view.tree_rival, visible=view.tree_rival is not None)
    values["recording"] = gr.Markdown(view.recording, visible=bool(view.recording))  # in place of the live controls
    return tuple(values[name] for name in VIEW_FIELDS)


def revisit_slider(control: StepControl) -> gr.Slider:
    """The "Revisit a step" control as the page's slider."""
    return gr.Slider(
        minimum=1, maximum=max(control.count, 2), value=control.value, interactive=control.count > 1,
        visible=control.count > 1,  # nothing to revisit before a second step (no "1 … 2" on an empty page)
        label=f"Revisit a step (1 … {control.count}): drag, or type a number and press Enter" if control.count
        else "Revisit a step (after the first step)")
