"""The lab's switches: one object read from the environment once (core/settings.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from core import settings
from core.settings import Settings, overridden

REPO = Path(__file__).resolve().parent.parent


def test_each_switch_reads_its_variable_and_defaults_without_one():
    assert Settings.from_environment({}) == Settings()
    read = Settings.from_environment({"MEDUSA_LAB_ENGINE": "lean", "MEDUSA_LAB_MAX_SESSIONS": "3",
                                      "MEDUSA_LAB_SESSION_IDLE_S": "1.5", "MEDUSA_LAB_NO_KERNELS": "1",
                                      "MEDUSA_LAB_CUDA_GRAPHS": "0", "MEDUSA_LAB_STORE": " ", "OTHER": "x"})
    assert (read.engine, read.max_sessions, read.session_idle_s, read.no_kernels, read.cuda_graphs, read.store) == \
        ("lean", 3, 1.5, True, False, "")


@pytest.mark.parametrize("variable, value, expected", [("MEDUSA_LAB_MAX_SESSIONS", "many", "an integer"),
                                                       ("MEDUSA_LAB_RUN_REDRAW_S", "soon", "a number"),
                                                       ("MEDUSA_LAB_REPLAY_ONLY", "maybe", "1 or 0")])
def test_a_bad_value_names_its_variable(variable, value, expected):
    with pytest.raises(ValueError, match=f"{variable}='{value}': expected {expected}"):
        Settings.from_environment({variable: value})


def test_overridden_lasts_for_its_block_only():
    before = settings.SETTINGS
    with overridden(engine="lean") as inside:
        assert settings.SETTINGS is inside and inside.engine == "lean"
        assert dataclasses.replace(inside, engine=before.engine) == before
    assert settings.SETTINGS is before


def test_no_code_reads_a_switch_from_the_environment_but_the_settings():
    sources = [path for folder in ("core", "labstate", "viz", "offline") for path in (REPO / folder).rglob("*.py")]
    sources += [REPO / name for name in ("app.py", "page.py", "server.py", "replay_events.py")]
    readers = [path.relative_to(REPO).as_posix() for path in sources
               if path.name != "settings.py" and any(read in path.read_text(encoding="utf-8") for read in
                                                     ('environ.get("MEDUSA_LAB_', 'environ["MEDUSA_LAB_', 'getenv("MEDUSA_LAB_'))]
    assert readers == []
