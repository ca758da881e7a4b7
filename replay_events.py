"""The replay's events: a gallery run or an uploaded trace stepped through without a model. Each recorded
step is drawn once and kept (`RECORDED_VIEWS`, bounded), the next one drawn ahead on a background thread,
and a trace that cannot be drawn is answered with a message, never a traceback. app.py wires these.
"""
from __future__ import annotations

import concurrent.futures
import logging
import pickle
from typing import Callable

import gradio as gr

import labstate
from labstate import replay
from page import view_outputs
from viz.view import VIEW_FIELDS, View, build_view, empty_view

LOOK_AHEAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-look-ahead")
# a recorded step always draws the same: Back and revisits are instant. Bounded in bytes too (a 64-node step's
# view pickles to ~85 KB, a maximal upload's to a few MB), so uploads cannot fill memory
RECORDED_VIEWS = replay.BoundedCache(capacity=512, max_bytes=128_000_000)


def recorded_view(state: replay.Replay, message: str) -> View:
    view = RECORDED_VIEWS.get((state, message))
    if view is None:
        view = build_view(replay.replay_facts(state), state.shown - 1 if state.shown else None, message)
        RECORDED_VIEWS.put((state, message), view, len(pickle.dumps(view)))
    return view


def replay_view(state: replay.Replay, message: str = "") -> tuple:
    view = recorded_view(state, message)
    look_ahead(state)
    return (state, *view_outputs(view))


def prewarm() -> None:
    """Draw (and cache) every step of the first gallery run (replay-only mode, once the server is up):
    ~3 s here (35 steps); without it the first steps of the opening run drew in 0.31-0.33 s in the
    browser test instead of 0.20-0.23 s (Xeon, 2 cores)."""
    state = replay.open_gallery(replay.gallery()[0].name) if replay.gallery() else None
    for shown in range(replay.total_steps(state) + 1 if state else 0):
        recorded_view(replay.moved(state, shown), "")


def look_ahead(state: replay.Replay) -> None:
    """Draw the recording's next step on a background thread, so that a Step at a reader's pace finds
    it cached (any gallery run or upload, not only the prewarmed first run)."""
    if state.shown < replay.total_steps(state):
        LOOK_AHEAD.submit(recorded_view, replay.moved(state, state.shown + 1), "")


def replay_guard(state: replay.Replay | None, action: Callable[[], tuple]) -> tuple:
    try:
        return action()
    except Exception as error:  # noqa: BLE001  a bad upload, the end of a recording: the page keeps its view
        if not isinstance(error, labstate.LabInputError):  # a trace that loaded but cannot be drawn
            logging.getLogger(__name__).exception("drawing a recorded run failed")
            error = labstate.LabInputError("This trace is damaged: a step of it cannot be drawn "
                                           f"({type(error).__name__}). Pick a gallery run or upload another.")
            if state is not None and state.source.startswith("upload:"):
                state = None  # its steps cannot be drawn either
        gr.Warning(str(error).replace("**", ""))
        if state is not None:
            return (state, *replay_view(state, f"⚠️ {error}")[1:])
        return (state, *view_outputs(empty_view(f"⚠️ {error}", hint="Pick a gallery run or upload a trace.")))


def on_pick(name: str, state: replay.Replay | None = None) -> tuple:
    """Open a gallery run on the step its notes are about (`replay.open_gallery`)."""
    def pick() -> tuple:
        opened = replay.open_gallery(name)
        return replay_view(opened, replay.opening_message(opened))
    return replay_guard(state, pick)


def on_upload(data: bytes | None, state: replay.Replay | None = None) -> tuple:
    """Replay an uploaded trace (the Export button's JSON)."""
    if data is None:  # the file was cleared: nothing to change
        return tuple(gr.skip() for _ in range(len(VIEW_FIELDS) + 1))
    return replay_guard(state, lambda: replay_view(replay.open_upload(data), "Loaded your trace: press Step."))


def replay_move(state: replay.Replay | None, move: Callable[[replay.Replay], replay.Replay]) -> tuple:
    def action() -> tuple:
        if state is None:
            raise labstate.LabNotice("Pick a gallery run or upload a trace first.")
        return replay_view(move(state))
    return replay_guard(state, action)


def on_replay_step(state: replay.Replay | None) -> tuple:
    """The recording's next step."""
    return replay_move(state, replay.step)


def on_replay_back(state: replay.Replay | None) -> tuple:
    """The recording one step back."""
    return replay_move(state, replay.back)


def on_replay_end(state: replay.Replay | None) -> tuple:
    """The whole recording at once (Run to end, without waiting)."""
    return replay_move(state, replay.to_end)


def on_replay_view(step_index: float, state: replay.Replay | None) -> tuple:
    """Revisit step `step_index` of the recording."""
    return replay_move(state, lambda s: replay.moved(s, labstate.parse_step_index(step_index) + 1))
