"""The lab's switches: every `MEDUSA_LAB_*` environment variable, read once at import into `SETTINGS`.

Code reads `settings.SETTINGS`' fields at the moment it needs them, never the environment. A test or a
script that needs another value replaces the object for a while (`overridden(engine="lean")`, or
pytest's `monkeypatch.setattr(settings, "SETTINGS", ...)`); a subprocess gets the variables. A bad
value stops the import with the variable's name. A leaf: imports nothing of the project.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Iterator, Mapping

PREFIX = "MEDUSA_LAB_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """One field per switch; its variable is MEDUSA_LAB_ and the field's name in capitals."""

    # the model and its engine (core)
    model: str = ""  # another causal LM (a hub id or a path); "": the shipped SmolLM2 GGUF
    engine: str = "auto"  # auto | exact | lean | hf (core.model.ENGINES)
    cache: str = ""  # where compiled kernels and measured profiles are kept; "": the repository's .cache
    no_kernels: bool = False  # never build the exact kernels: the lean forward serves
    cuda_graphs: bool = True  # on a GPU, replay each row count's forward as a CUDA graph
    store: str = ""  # more answer files for the datastore drafter, comma-separated
    # the page (labstate, app)
    max_prompt_tokens: int = 2048
    record_on_start: bool = False  # Start decodes the whole run and the page replays it (as on ZeroGPU)
    replay_only: bool = False  # serve the gallery and uploaded traces only, no model
    concurrency: int = 2  # decoding events at once
    max_sessions: int = 32
    sessions_per_client: int = 8
    session_idle_s: float = 1200.0
    queue_size: int = 64
    run_redraw_s: float = 0.5  # Run to end redraws its progress at most this often
    draw_wait_s: float = 0.5  # how long a redraw waits for the browser to finish drawing the last one
    queue_poll_s: float = 0.02  # how often the event queue looks for work

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """The defaults, with each variable that is set (and not empty) in `environ`."""
        values = {}
        for spec in fields(cls):
            name = PREFIX + spec.name.upper()
            raw = environ.get(name, "").strip()
            if raw:
                values[spec.name] = _parsed(name, raw, type(spec.default))
        return cls(**values)


def _parsed(name: str, raw: str, kind: type) -> object:
    if kind is bool:
        if raw.lower() in TRUE + FALSE:
            return raw.lower() in TRUE
        raise ValueError(f"{name}={raw!r}: expected 1 or 0")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a{'n integer' if kind is int else ' number'}") from None


SETTINGS = Settings.from_environment()


@contextmanager
def overridden(**changes: object) -> Iterator[Settings]:
    """`SETTINGS` with `changes` for the block's duration (one recording of a script, a test)."""
    global SETTINGS
    saved = SETTINGS
    SETTINGS = replace(SETTINGS, **changes)
    try:
        yield SETTINGS
    finally:
        SETTINGS = saved
