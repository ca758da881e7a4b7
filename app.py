"""Medusa Tree Lab: step through Medusa-style speculative decoding with a dynamic candidate tree.

Layout and event wiring only: `labstate` runs the decoder (core/) and replays recorded runs, `viz`
draws, `page` builds the components. Importing this module builds the Blocks and launches nothing;
`python app.py [--port N] [--replay-only]` serves on 127.0.0.1. Replay-only (or MEDUSA_LAB_REPLAY_ONLY=1)
serves the recorded gallery without torch or transformers; a server whose model cannot load falls back to it.

API (gradio_client): start, step, run (streams) take (prompt, **settings) by `labstate.SETTING_NAMES`
(defaults: the page's; strategies in core.strategy's grammar); step, run and stop also take an optional
clicked_at (ms; the page sends its clock: a Step or Run clicked before a Stop is dropped); view(step_index),
check(), reset() take none; each returns the outputs named in `VIEW_OUTPUT_NAMES`; trace() returns the
JSON trace. Bad input: the API gets gr.Error(message), the page a toast and its view untouched, both
from `server.answer`; never a traceback. Each tab / client owns a LabState in `labstate.SessionRegistry`
(MEDUSA_LAB_MAX_SESSIONS, MEDUSA_LAB_SESSION_IDLE_S); a replay lives in the page's `gr.State`.
"""
from __future__ import annotations

import os
import sys

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no network calls

import argparse
import functools
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr
from starlette.middleware import Middleware

import labstate
import space_setup
from core.settings import SETTINGS
from labstate import replay
from server import (answer, browser_on_this_machine, client_address, quiet_queue, session_key,
                    wait_for_the_browser)
from replay_events import (on_pick, on_replay_back, on_replay_end, on_replay_step, on_replay_view, on_upload,
                           prewarm, replay_view)
from page import (FirstInHead, economics_panel, header, live_controls, replay_controls, revisit_slider, settings_event,
                  view_outputs, view_panel)
from viz import economics
from viz.view import PROGRESS_FIELDS, VIEW_FIELDS, build_progress, build_view

ASSETS = Path(__file__).resolve().parent / "assets"
RESULTS = ASSETS / "results"
REPLAY_ONLY = "--replay-only" in sys.argv[1:] or SETTINGS.replay_only
DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
CONCURRENCY = SETTINGS.concurrency
MAX_SESSIONS = SETTINGS.max_sessions
QUEUE_SIZE = SETTINGS.queue_size
SESSIONS = labstate.SessionRegistry(max_sessions=MAX_SESSIONS, idle_seconds=SETTINGS.session_idle_s,
                                    per_client=SETTINGS.sessions_per_client)
TRACE_DIR = Path(tempfile.gettempdir()) / "medusa-lab-traces"
TRACE_TTL_S = 3600
# Run to end redraws at most this often, and only the run's progress (`viz.view.Progress`): a redraw takes the
# cores from decoding (the two trees cost the browser ~0.4 s of CPU); the figures follow when the run stops.
RUN_REDRAW_S = SETTINGS.run_redraw_s
REDRAW_CLOCK = time.monotonic  # the pacer's clock (tests start one at 0, as on a machine just booted)
DRAW_WAIT_S = SETTINGS.draw_wait_s  # see server.wait_for_the_browser
QUEUE_POLL_S = SETTINGS.queue_poll_s  # see server.quiet_queue
PROGRESS_POLL_S = 0.1
PAGE_JS = (ASSETS / "page.js").read_text(encoding="utf-8")  # light theme, Enter in Revisit, arrow-key stepping
VIEW_OUTPUT_NAMES = VIEW_FIELDS
D = dict.fromkeys(labstate.SETTING_NAMES) if REPLAY_ONLY else labstate.Settings().raw()  # the API's = the page's
log = logging.getLogger("medusa_lab")


def render(lab: labstate.LabState | None, index: int | None = None, message: str = "") -> tuple:
    """Every output for step `index` (0-based; default: the latest) of the user's current run; the time
    it takes is the page's overhead, shown beside the speed (never in it)."""
    started = time.perf_counter()
    run = lab.run if lab is not None else None
    outputs = view_outputs(build_view(labstate.facts_of(lab, run) if run is not None else None, index, message))
    labstate.note_page_time(lab, time.perf_counter() - started)
    return outputs


def render_progress(lab: labstate.LabState, message: str = "", draw_number: int | None = None) -> tuple:
    """A redraw while the user's run is running: its progress alone, built without its figures (the
    other outputs stay as they are); timed as the page's overhead like `render`. With `draw_number` the
    cards carry it, and the page says when it has drawn them (assets/page.js, `on_drawn`)."""
    started = time.perf_counter()
    progress = build_progress(labstate.facts_of(lab, lab.run), message)
    values = {name: getattr(progress, name) for name in PROGRESS_FIELDS}
    if draw_number is not None:
        values["stats"] += f'<i hidden data-draw="{draw_number}"></i>'
    values["step_slider"] = revisit_slider(progress.step_slider)
    outputs = tuple(values.get(name, gr.skip()) for name in VIEW_OUTPUT_NAMES)
    labstate.note_page_time(lab, time.perf_counter() - started)
    return outputs


def _user_view(request: gr.Request | None) -> Callable[[str], tuple]:
    """Redraw the user's current run, untouched, with a message (what an error answer shows)."""
    def redraw(message: str) -> tuple:
        try:
            lab = SESSIONS.get(session_key(request))
        except labstate.LabNotice:
            lab = None
        return render(lab, message=message)
    return redraw


def _guarded(request: gr.Request | None, action: Callable[[], tuple]) -> tuple:
    try:
        return action()
    except Exception as error:  # noqa: BLE001  (never a traceback in the page)
        return answer(request, error, _user_view(request))


def _settings(values: dict[str, Any]) -> tuple[str, labstate.Settings, str]:
    """The clean prompt and the checked settings."""
    prompt, note = labstate.sanitize_prompt(values.pop("prompt"))
    if note:
        gr.Warning(note)
    return prompt, labstate.parse_settings(values), note


def _decoding(request: gr.Request | None, values: dict[str, Any], act: Callable) -> tuple:
    """One settings event: parse, then `act(lab, prompt, settings)` -> message, then draw the run."""
    def action() -> tuple:
        prompt, settings, note = _settings(values)
        labstate.warm_up(settings.precision, settings.spec.drafts, gr.Info)  # says what it does
        key = session_key(request)
        client = client_address(request)
        lab = (labstate.decoding_state(SESSIONS, key, client) if act is not labstate.start_fresh
               else SESSIONS.open(key, client))
        with lab.working():
            return render(lab, message=" ".join(m for m in (note, act(lab, prompt, settings)) if m))
    return _guarded(request, action)


@settings_event(D)
def on_start(values: dict[str, Any], request: gr.Request | None) -> tuple:
    """Start (or restart) decoding `prompt`: prefill only."""
    return _decoding(request, values, labstate.start_fresh)


@settings_event(D, "clicked_at")
def on_step(values: dict[str, Any], request: gr.Request | None, clicked_at: float | None) -> tuple:
    """One decoding step (starting a run first when there is none). A step clicked before Stop is dropped."""
    def step(lab: labstate.LabState, prompt: str, settings: labstate.Settings) -> str:
        return labstate.step_once(lab, prompt, settings, clicked_at=labstate.parse_clicked_at(clicked_at))
    return _decoding(request, values, step)


@settings_event(D, "clicked_at")
def on_run(values: dict[str, Any], request: gr.Request | None, clicked_at: float | None) -> Iterator[tuple]:
    """Step to the end, streaming every step; stops between steps on Stop, Start, Reset or eviction."""
    key = session_key(request)
    try:
        prompt, settings, note = _settings(values)
        clicked_at = labstate.parse_clicked_at(clicked_at)
        labstate.warm_up(settings.precision, settings.spec.drafts, gr.Info)
        lab = labstate.decoding_state(SESSIONS, key, client_address(request))
        local_browser = browser_on_this_machine(request) and labstate.decoding_takes_every_core()
        with lab.working():
            pacer, latest = labstate.RedrawPacer(RUN_REDRAW_S, clock=REDRAW_CLOCK), note
            for message in labstate.run_to_end(lab, prompt, settings, alive=lambda: SESSIONS.is_live(key, lab),
                                               clicked_at=clicked_at, burst_s=RUN_REDRAW_S):
                SESSIONS.touch(key, lab)
                latest = " ".join(m for m in (note, message) if m)
                if pacer.due():  # a redraw competes with decoding for the cores; the first is always drawn
                    number = lab.expect_drawing() if local_browser else None
                    yield render_progress(lab, message=latest, draw_number=number)
                    if number is not None:
                        wait_for_the_browser(lab, DRAW_WAIT_S)
            latest = labstate.run_end_message(lab, latest)
            best = labstate.most_accepted_step(lab.run)  # a finished run opens where it accepted the most
            shown = f" Showing step {best + 1}, where a step emitted the most tokens." if best is not None else ""
            yield render(lab, index=best, message=latest + shown)  # the run's state, figures and all
    except Exception as error:  # noqa: BLE001
        yield answer(request, error, _user_view(request))


def on_drawn(number: float | None, request: gr.Request = None) -> None:
    """The page has drawn the Run-to-end redraw `number` (its cards carry it): the run decodes on."""
    try:
        lab = SESSIONS.get(session_key(request))
    except labstate.SessionExpired:
        return
    if lab is not None and isinstance(number, (int, float)):
        lab.mark_drawn(int(number))


@functools.cache
def _whole_run_recorder() -> Callable[..., str]:
    """`labstate.record_run` inside one ZeroGPU call there (wrapped once), itself elsewhere."""
    return labstate.gpu_call(labstate.record_run)


@settings_event(D)
def on_record(values: dict[str, Any], request: gr.Request | None) -> tuple:
    """Start where a GPU lives for one call only (ZeroGPU): decode the whole run in that call, then show
    it as a recording that Step, Back and Run to end go through (the replay machinery)."""
    def record() -> tuple:
        prompt, settings, note = _settings(values)
        text = _whole_run_recorder()(prompt, settings, {"title": "your run, decoded whole in one GPU call"})
        message = "Decoded the whole run in one GPU call: press Step to go through it, or Run to end."
        return replay_view(replay.moved(replay.open_upload(text), 1), " ".join(m for m in (note, message) if m))
    try:
        return record()
    except Exception as error:  # noqa: BLE001  (never a traceback in the page)
        return (None, *answer(request, error, _user_view(request)))


def on_view(step_index: float, shown: replay.Replay | None = None, request: gr.Request = None) -> tuple:
    """Show a past step (steps count from 1) of what the page shows: the replay `shown` (a recording picked
    or uploaded since the last live event), else the user's live run."""
    if shown is not None:
        return on_replay_view(step_index, shown)
    return (None, *_guarded(request, lambda: render(SESSIONS.get(session_key(request)),
                                                    index=labstate.parse_step_index(step_index))))


def _forget_replay() -> None:
    """A live event draws the live run: the Revisit slider must revisit that run, not an earlier replay."""


def on_live(request: gr.Request = None) -> tuple:
    """Leave the recording on screen for the user's live run (its prompt and settings as they left them)."""
    return (None, *_user_view(request)(""))


def on_check(request: gr.Request = None) -> tuple:
    """Run plain greedy decoding now and compare the output so far."""
    def check() -> tuple:
        lab = SESSIONS.get(session_key(request))
        verdict = labstate.check_now(lab)
        gr.Info(verdict)  # where the eye is, beside the status line's clause
        return render(lab, message=verdict)
    return _guarded(request, check)


def on_reset(request: gr.Request = None) -> tuple:
    """Forget the current run (cached plain runs stay)."""
    def reset() -> tuple:
        SESSIONS.forget_expiry(session_key(request))
        lab = SESSIONS.get(session_key(request))
        labstate.reset(lab)
        return render(lab, message="Reset. Type a prompt and press **Start** or **Step**.")
    return _guarded(request, reset)


def on_stop(clicked_at: float | None = None, request: gr.Request = None) -> tuple:
    """Stop a running Run (and any Step waiting for its turn or clicked before `clicked_at`, the page's clock
    at the Stop click), then draw the run as it really stands."""
    def stop() -> tuple:
        lab = SESSIONS.get(session_key(request))
        return render(lab, message=labstate.stop(lab, labstate.parse_clicked_at(clicked_at)))
    return _guarded(request, stop)


def on_unload(request: gr.Request = None) -> None:
    """The tab closed: drop its state now (Gradio calls this when the page's heartbeat ends)."""
    if request is not None and getattr(request, "session_hash", None):
        SESSIONS.drop(request.session_hash)


def on_strategy(strategy: str) -> Any:
    """The strategy's own help text under the choice."""
    return gr.Radio(info=labstate.strategy_help().get(strategy, ""))


def on_trace(request: gr.Request = None) -> str | None:
    """Write the run as a JSON trace and return the file for download."""
    try:
        return str(labstate.export_trace(SESSIONS.get(session_key(request)), TRACE_DIR, TRACE_TTL_S))
    except labstate.LabNotice as notice:
        gr.Warning(str(notice).replace("**", ""))
        return None


def on_load() -> str:
    """The header line: the model, heads, forward and default precision (loads the model once)."""
    return labstate.header_line()


def _clear_trace() -> None:
    """A new or reset run has no trace yet (the Export box drops the previous run's file)."""


def on_lecture() -> tuple:
    """The Lecture preset into the prompt and the settings (the rest, the precision among them, as they are):
    press Start or Step next."""
    values = labstate.LECTURE_SETTINGS
    return (labstate.LECTURE_PROMPT, *(values.get(name, gr.skip()) for name in labstate.SETTING_NAMES))


def on_economics(*values: Any) -> tuple:
    """The "when does a tree pay?" sliders (acceptance by depth, a step's cost) and the marked points ->
    the figure and the sentence; values outside the sliders' ranges are refused as the settings are."""
    *numbers, points = values
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        raise gr.Error("the sliders take numbers")
    *acceptance, cost = (float(v) for v in numbers)
    if not all(0.0 <= a <= 1.0 for a in acceptance) or not 1.0 <= cost <= 8.0:
        raise gr.Error("acceptance is between 0 and 1, a step's cost between 1 and 8 plain steps")
    return economics.economics_figure(acceptance, cost, points or []), economics.economics_sentence(acceptance, cost)


def _wire_economics(panel: dict[str, Any]) -> None:
    inputs = [*panel["depths"], panel["cost"], panel["points"]]
    for slider in [*panel["depths"], panel["cost"]]:
        slider.change(on_economics, inputs, [panel["figure"], panel["sentence"]], api_visibility="private",
                      show_progress="hidden", queue=False)


def _settings_panel() -> list[gr.components.Component]:
    """The settings, built by name; returned in `labstate.SETTING_NAMES` order (the handlers' order)."""
    from page import settings_panel

    panel = settings_panel(labstate.Settings())  # the live page only: its defaults measure the machine's precision
    panel["strategy"].change(on_strategy, [panel["strategy"]], [panel["strategy"]], api_visibility="private",
                             queue=False, show_progress="hidden")
    return [panel[name] for name in labstate.SETTING_NAMES]


def _wire_live(controls: dict, view: list, shown_replay: gr.State) -> None:
    """The live decoding events (API names start, step, run, stop, reset, check, view, trace)."""
    for name in ("start", "step", "run", "stop", "reset", "check"):  # the page shows the live run again
        controls[name].click(_forget_replay, None, [shown_replay], api_visibility="private", queue=False)
    inputs, clicked_at = [controls["prompt"], *controls["settings"]], controls["clicked_at"]
    # labstate checks the values; the progress timer shows on the status line alone (one on each of the
    # view's outputs repainted them all ten times a second, CPU the browser took from decoding on a small machine)
    decode = {"show_progress": "minimal", "show_progress_on": view[:1], "concurrency_id": "decode",
              "preprocess": False}
    stamp = {"js": f"(...v) => [...v.slice(0, {len(inputs)}), Date.now()]", **decode}  # the click's time, page clock
    # the status line's minimal tracker: while the run waits for a decoding slot it says its place in the
    # queue ("queue: 1/2"), then the run's elapsed time beside the status the run writes itself
    run_event = controls["run"].click(on_run, [*inputs, clicked_at], view, api_name="run", **stamp)
    start_event = controls["start"].click(on_start, inputs, view, api_name="start", cancels=[run_event], **decode)
    step_event = controls["step"].click(on_step, [*inputs, clicked_at], view, api_name="step", trigger_mode="multiple",
                                        **stamp)
    controls["stop"].click(None, None, None, cancels=[run_event, step_event], api_visibility="private")
    controls["drawn"].click(on_drawn, [controls["drawn_number"]], None, queue=False, show_progress="hidden",
                            trigger_mode="multiple",  # one redraw's word may still be on its way at the next
                            js="() => [Number(document.querySelector('#stats [data-draw]')?.dataset.draw || 0)]",
                            api_visibility="private")
    controls["stop"].click(on_stop, [clicked_at], view, api_name="stop", queue=False,  # waits for the step in flight
                           js="() => [Date.now()]")
    reset_event = controls["reset"].click(on_reset, None, view, api_name="reset", cancels=[run_event, step_event])
    for event in (start_event, reset_event):
        event.then(_clear_trace, None, [controls["trace_file"]], api_visibility="private", queue=False)
    controls["check"].click(on_check, None, view, api_name="check", **decode)
    controls["trace"].click(on_trace, None, [controls["trace_file"]], api_name="trace")


def _wire_replay(replay_box: dict, view: list) -> None:
    """The replay events (private: recorded runs are the page's, not the API's)."""
    state, outputs = replay_box["state"], [replay_box["state"], *view]
    private = {"api_visibility": "private", "show_progress": "hidden", "queue": False}  # quick: no queue round trip
    replay_box["pick"].input(on_pick, [replay_box["pick"], state], outputs, **private)
    replay_box["upload"].upload(on_upload, [replay_box["upload"], state], outputs, **private)
    for name, handler in (("step", on_replay_step), ("back", on_replay_back), ("end", on_replay_end)):
        replay_box[name].click(handler, [state], outputs, **private)


def build_demo(replay_only: bool = REPLAY_ONLY, why: str = "", record_on_start: bool | None = None) -> gr.Blocks:
    """The whole UI. Nothing is loaded or launched here; `replay_only` leaves live decoding out entirely;
    `record_on_start` (default: on a ZeroGPU Space, `labstate.records_on_start`) makes Start decode a whole
    run and replay it, with no live stepping."""
    record_on_start = not replay_only and (labstate.records_on_start() if record_on_start is None else record_on_start)
    with gr.Blocks(title="Medusa Tree Lab", delete_cache=(3600, 3600)) as demo:
        model_info = header(replay_only, why)
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=330, elem_classes=["controls"]):
                replay_box = replay_controls(replay.gallery(), open_=replay_only, live=not replay_only)
                controls = None if replay_only else live_controls(DEFAULT_PROMPT, _settings_panel,
                                                                  whole_runs=record_on_start)
            with gr.Column(scale=3, min_width=600):
                panel = view_panel(RESULTS, ASSETS / "how_it_works.md")
                _wire_economics(economics_panel(RESULTS))
        panel["recording"] = replay_box["recording"]  # drawn where the live settings are
        view = [panel[name] for name in VIEW_OUTPUT_NAMES]
        _wire_replay(replay_box, view)
        if replay_only:
            panel["step_slider"].release(on_replay_view, [panel["step_slider"], replay_box["state"]],
                                         [replay_box["state"], *view], api_visibility="private", show_progress="hidden")
            if replay.gallery():
                first = replay.gallery()[0].name
                demo.load(lambda: on_pick(first), None, [replay_box["state"], *view], api_visibility="private")
        elif record_on_start:  # ZeroGPU: Start decodes a whole run in one GPU call; the replay's buttons step it
            controls["start"].click(on_record, [controls["prompt"], *controls["settings"]], [replay_box["state"], *view],
                                    api_name="start", concurrency_id="decode", preprocess=False)
        else:
            _wire_live(controls, view, replay_box["state"])
        if not replay_only:
            controls["example"].input(controls["examples"].get, [controls["example"]], [controls["prompt"]],
                                      api_visibility="private", queue=False)
            controls["lecture"].click(on_lecture, None, [controls["prompt"], *controls["settings"]],
                                      api_visibility="private", queue=False, show_progress="hidden")
            replay_box["live"].click(on_live, None, [replay_box["state"], *view], api_visibility="private",
                                     show_progress="hidden", queue=False)
            panel["step_slider"].release(on_view, [panel["step_slider"], replay_box["state"]],
                                         [replay_box["state"], *view], api_name="view", show_progress="hidden",
                                         preprocess=False)
            # the header's model line: no loader over it (a shown tracker gets frames, assets/timer_frames.js)
            demo.load(on_load, None, [model_info], api_visibility="private", show_progress="hidden")
            demo.unload(on_unload)
    demo.queue(default_concurrency_limit=CONCURRENCY, max_size=QUEUE_SIZE)
    quiet_queue(demo, QUEUE_POLL_S, PROGRESS_POLL_S)
    return demo


demo = build_demo()


def launch_kwargs() -> dict[str, Any]:
    """Styling and safety options that Gradio 6 takes at launch time (never a public share link)."""
    return {"css_paths": [ASSETS / "app.css"], "js": PAGE_JS, "theme": gr.themes.Default(), "share": False,
            "max_file_size": "8mb",  # a trace upload; Gradio's own session store is bounded like ours
            "state_session_capacity": max(64, 4 * MAX_SESSIONS),
            "app_kwargs": {"middleware": [Middleware(FirstInHead)]}}  # Gradio's idle 60-frame loop, slowed


def main(argv: list[str] | None = None) -> None:
    """Load the model (unless replay-only), then serve on 127.0.0.1 (--port, else GRADIO_SERVER_PORT, else 7860)."""
    global demo
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--replay-only", action="store_true", help="serve the recorded gallery; load no model")
    args = parser.parse_args(argv)
    replay_only = REPLAY_ONLY
    if not replay_only:
        if os.environ.get("SPACE_ID"):
            space_setup.prepare_space()  # the model package a Space's requirements.txt cannot hold
        try:
            labstate.runtime(labstate.machine_precision())  # load once before the first visitor
        except Exception as error:  # noqa: BLE001  (a Space without the model still shows the gallery)
            log.exception("the model could not be loaded: serving the recorded gallery only")
            demo = build_demo(replay_only=True, why=f"the model could not be loaded here ({type(error).__name__})")
            replay_only = True
    demo.launch(server_name=args.host, server_port=args.port, prevent_thread_lock=True, **launch_kwargs())
    if replay_only:
        prewarm()  # after the server is up: beside its start it cost ~1 s more of the launch-to-tree time
    else:  # the verify-cost profile, measured off the request path (a Start that comes first waits for the rest)
        threading.Thread(target=labstate.warm_up, args=(labstate.machine_precision(), True, log.info),
                         kwargs={"wait": True}, name="warm-up", daemon=True).start()
    demo.block_thread()


if __name__ == "__main__":
    main()
