"""One thread for a server's tensor work (imports no torch: replay-only mode imports it too).

Why: each thread that runs a parallel torch operator gets an OpenMP thread team of its own, and
once a process holds more OpenMP threads than cores, libgomp stops spinning between parallel
regions, so every operator after that pays a futex wake-up. Gradio runs each event on a worker
thread of its pool, so a model loaded on one thread and stepped on others ran every forward
about 1.8x slower (2-core AMD EPYC, fp32 plain step: 29-33 ms on the loading thread, 51-59 ms on
a second thread, and 52-56 ms on the first one afterwards). The app sends all of its tensor work
(loading, measuring, prefill, steps, the plain reference run) to this one thread instead; scripts
and tests that run on one thread need none of it.
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

THREAD_NAME = "tensor-work"
# process-wide and stateless, like torch's own thread pool: jobs run one at a time, in order
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)


def on_tensor_thread_now() -> bool:
    """True when the calling thread is the tensor thread."""
    return threading.current_thread().name.startswith(THREAD_NAME)


def run_on_tensor_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on the tensor thread (directly when already there); waits for it and
    returns its result or raises its exception."""
    if on_tensor_thread_now():
        return fn(*args, **kwargs)
    return _POOL.submit(fn, *args, **kwargs).result()


def tensor_work(fn: Callable[P, T]) -> Callable[P, T]:
    """Decorator: every call of `fn` runs on the tensor thread."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_on_tensor_thread(fn, *args, **kwargs)
    return wrapper
