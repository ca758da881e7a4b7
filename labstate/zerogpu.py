"""Hugging Face ZeroGPU Spaces: a GPU exists only inside a function decorated with `spaces.GPU`, for one
call, so per-user KV caches cannot live across the page's events there. On ZeroGPU (the `spaces`
package importable and SPACES_ZERO_GPU set by the Space) Start decodes the whole run inside one GPU
call and the page steps through the recording with the replay machinery; everywhere else this module
changes nothing (MEDUSA_LAB_RECORD_ON_START=1 takes the same path on a CPU, to try it and to test it).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Callable, TypeVar

from core import settings

GPU_SECONDS = 120  # one whole run of up to 1024 tokens, with its plain-greedy check
Function = TypeVar("Function", bound=Callable)


def on_zero_gpu() -> bool:
    """True on a ZeroGPU Space (the Space sets SPACES_ZERO_GPU; the `spaces` package is installed there)."""
    return bool(os.environ.get("SPACES_ZERO_GPU")) and importlib.util.find_spec("spaces") is not None


def records_on_start() -> bool:
    """Whether Start decodes a whole run and the page replays it (ZeroGPU, or asked for on a CPU)."""
    return on_zero_gpu() or settings.SETTINGS.record_on_start


def gpu_call(function: Function, seconds: int = GPU_SECONDS) -> Function:
    """`function` run inside one ZeroGPU call (`spaces.GPU`); `function` itself anywhere else."""
    if not on_zero_gpu():
        return function
    import spaces  # only on a ZeroGPU Space

    return spaces.GPU(duration=seconds)(function)
