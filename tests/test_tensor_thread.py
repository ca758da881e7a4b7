"""The app's tensor work runs on one thread (core.tensor_thread): calls from many threads, nesting, errors."""
from __future__ import annotations

import threading

import pytest

from core.tensor_thread import on_tensor_thread_now, run_on_tensor_thread, tensor_work


def _thread_name() -> str:
    return threading.current_thread().name


def test_calls_from_many_threads_run_on_one_thread():
    names: list[str] = []
    callers = [threading.Thread(target=lambda: names.append(run_on_tensor_thread(_thread_name))) for _ in range(6)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(names) == 6 and len(set(names)) == 1 and names[0] != _thread_name()
    assert not on_tensor_thread_now()


def test_a_nested_call_runs_in_place_and_errors_reach_the_caller():
    @tensor_work
    def outer() -> tuple[str, str]:
        return _thread_name(), run_on_tensor_thread(_thread_name)  # would deadlock if queued again

    first, nested = outer()
    assert first == nested and on_tensor_thread_now() is False

    @tensor_work
    def fails() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        fails()
