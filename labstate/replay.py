"""Recorded runs stepped without a model: the gallery shipped in assets/gallery and uploaded traces.

A `Replay` is what a user's page holds (in `gr.State`): which trace, and how many of its steps are
shown. Step, Back, Run to end and Revisit only move that count; the facts of the first `shown`
steps are drawn exactly as a live run's are (viz.view), with the recorded timings and the
recorded plain-decoding baseline. Imports no torch and no transformers: the replay-only page
runs on this module alone.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labstate.errors import LabInputError, LabNotice
from viz.facts import RunFacts, RunStats
from labstate.trace import Trace, TraceError, load_trace

GALLERY_DIR = Path(__file__).resolve().parent.parent / "assets" / "gallery"
GALLERY_INDEX = GALLERY_DIR / "index.json"
MAX_UPLOADS = 64  # uploaded traces kept in memory (least recently used dropped first)...
MAX_UPLOAD_BYTES = 64_000_000  # ...and at most this many bytes of their JSON (a loaded trace holds ~3-4x)


@dataclass(frozen=True)
class GalleryEntry:
    """One recorded run of the gallery and what it is there to show."""

    name: str
    title: str
    notice: str  # "what to notice", for the whole run
    file: str


@dataclass(frozen=True)
class Replay:
    """A user's replay: `source` names the trace (gallery:<name> or upload:<hash>); `shown` steps are drawn."""

    source: str
    shown: int = 0

    @property
    def gallery_name(self) -> str:
        return self.source.split(":", 1)[1] if self.source.startswith("gallery:") else ""


@functools.cache
def gallery() -> tuple[GalleryEntry, ...]:
    """The shipped gallery, in its index's order (empty when none is shipped)."""
    if not GALLERY_INDEX.exists():
        return ()
    rows = json.loads(GALLERY_INDEX.read_text(encoding="utf-8"))["runs"]
    return tuple(GalleryEntry(**row) for row in rows)


@functools.cache
def _gallery_trace(name: str) -> Trace:
    entry = next((e for e in gallery() if e.name == name), None)
    if entry is None:
        raise LabInputError(f"no gallery run named {name!r}; the gallery has {', '.join(e.name for e in gallery())}")
    trace = load_trace((GALLERY_DIR / entry.file).read_bytes())
    return dataclasses.replace(trace, facts=dataclasses.replace(trace.facts, recording=entry.title))


class BoundedCache:
    """Values by key, least recently used dropped first once more than `capacity` values or `max_bytes`
    bytes (each value's size said when it is put) are held; thread-safe. Shared read-only values."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self._values: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.capacity, self.max_bytes, self.bytes = capacity, max_bytes, 0
        self.hits = 0  # gets that found their value
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def put(self, key: Any, value: Any, size: int) -> None:
        with self._lock:
            old = self._values.pop(key, None)
            self.bytes -= old[1] if old else 0
            self._values[key] = (value, size)
            self.bytes += size
            while len(self._values) > 1 and (len(self._values) > self.capacity or self.bytes > self.max_bytes):
                _, (_, dropped) = self._values.popitem(last=False)
                self.bytes -= dropped

    def get(self, key: Any) -> Any | None:
        with self._lock:
            held = self._values.get(key)
            if held is None:
                return None
            self.hits += 1
            self._values.move_to_end(key)
            return held[0]

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.bytes = 0


UPLOADS = BoundedCache(MAX_UPLOADS, MAX_UPLOAD_BYTES)


def open_gallery(name: str) -> Replay:
    """A gallery run, opened on its point (the step its `meta.point` names, else the first step its notes
    are about), drawn at once (Back reaches the steps before it); ready at its first step without either."""
    trace = _gallery_trace(name)
    point, notes = trace.meta.get("point"), trace.facts.step_notes
    if isinstance(point, int) and not isinstance(point, bool) and 1 <= point <= len(trace.facts.records):
        return Replay(source=f"gallery:{name}", shown=point)
    return Replay(source=f"gallery:{name}", shown=min(notes) + 1 if notes else 0)


def opening_message(replay: Replay) -> str:
    """What the page says when a gallery run opens on its point."""
    if not replay.shown:
        return ""
    return (f"Opened on step {replay.shown}, the point of this run: ← goes back to step 1, "
            f"Step goes on.")


def open_upload(raw: bytes | str) -> Replay:
    """An uploaded trace (the Export button's JSON); LabInputError saying why when it cannot be replayed."""
    try:
        trace = load_trace(raw, untrusted=True)
    except TraceError as error:
        raise LabInputError(str(error)) from None
    key = hashlib.sha1(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    UPLOADS.put(key, trace, len(raw))
    return Replay(source=f"upload:{key}")


def trace_of(replay: Replay) -> Trace:
    """The replay's trace; LabNotice when an uploaded one was dropped to make room."""
    kind, _, key = replay.source.partition(":")
    if kind == "gallery":
        return _gallery_trace(key)
    trace = UPLOADS.get(key) if kind == "upload" else None
    if trace is None:
        raise LabNotice("That uploaded trace is no longer in memory (the lab needed room): upload it again.")
    return trace


def total_steps(replay: Replay) -> int:
    return len(trace_of(replay).facts.records)


def moved(replay: Replay, to: int) -> Replay:
    """The replay showing `to` steps (clamped to what was recorded)."""
    return dataclasses.replace(replay, shown=max(0, min(to, total_steps(replay))))


def step(replay: Replay) -> Replay:
    """One more recorded step; LabNotice at the end, as a finished live run says."""
    if replay.shown >= total_steps(replay):
        raise LabNotice("The recording has no more steps: press Back, revisit a step, or pick another run.")
    return moved(replay, replay.shown + 1)


def back(replay: Replay) -> Replay:
    """One recorded step back."""
    return moved(replay, replay.shown - 1)


def to_end(replay: Replay) -> Replay:
    """The whole recording (Run to end, without waiting)."""
    return moved(replay, total_steps(replay))


def _prefix_stats(full: RunFacts, shown: int, tokens: int) -> RunStats:
    """The speed card after `shown` recorded steps (`tokens` emitted): recorded timings against the
    recorded plain baseline."""
    records = full.records[:shown]
    seconds = sum(r.times.total for r in records)
    rate = (tokens - 1) / seconds if seconds > 0 else 0.0
    plain = None
    if full.ar is not None and full.ar.step_seconds:
        plain = len(full.ar.step_seconds) / sum(full.ar.step_seconds)
    elif full.ar is not None and full.ar.seconds_per_token:
        plain = 1.0 / full.ar.seconds_per_token
    ratio = rate / plain if plain and records and full.stats.vs_plain is not None else None
    return dataclasses.replace(full.stats, tokens=tokens, steps=len(records), tokens_per_s=rate, vs_plain=ratio,
                               mean_accepted=(tokens - 1) / len(records) if records else 0.0,
                               status=f"replay: step {shown} of {len(full.records)}",
                               check=full.stats.check if shown == len(full.records) else "",
                               check_state=full.stats.check_state if shown == len(full.records) else "na")


def replay_facts(replay: Replay) -> RunFacts:
    """What the views draw after `replay.shown` steps; the whole recording equals the recorded run's facts."""
    full = trace_of(replay).facts
    if replay.shown >= len(full.records):
        return full
    records = full.records[:replay.shown]
    tokens = min(1 + sum(len(r.new_tokens) for r in records), len(full.output_ids))
    output_ids = full.output_ids[:tokens]
    text = b"".join(full.token_bytes.get(t, b"") for t in output_ids).decode("utf-8", errors="replace")
    return dataclasses.replace(full, records=records, output_ids=output_ids, text=text,
                               stats=_prefix_stats(full, replay.shown, tokens), finished=False, stop_reason="",
                               state=f"replay: step {replay.shown} of {len(full.records)}, press Step")
