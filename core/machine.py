"""The machine a figure was measured on: names that key cached measurements and label results,
and the one timing loop every measurement uses (`median_ms`)."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_fields() -> dict[str, str]:
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_name() -> str:
    """The CPU's model name (figures are only comparable on one machine)."""
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


MATRIX_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def cpu_summary() -> str:
    """The CPU in one line for a result: its name, family / model and the matrix instructions it has
    ("AMD EPYC, family 26 model 2: avx2 avx512f avx512_vnni avx512_bf16")."""
    fields = _cpuinfo_fields()
    flags = set(fields.get("flags", "").split())
    family = f", family {fields['cpu family']} model {fields.get('model', '?')}" if "cpu family" in fields else ""
    return f"{cpu_name()}{family}: {' '.join(f for f in MATRIX_FLAGS if f in flags) or 'no AVX2'}"


def cpu_fingerprint() -> str:
    """The CPU's model name and feature flags (AVX512-BF16 and friends decide the fast paths)."""
    return f"{cpu_name()}|{_cpuinfo_fields().get('flags', '')}"


BUSY_SPREAD = 0.15  # repeated timings of one thing may differ this much on a quiet machine


def measured_quietly(*same_thing_ms: float) -> bool:
    """True when repeated timings of the same work agree within BUSY_SPREAD: nothing else competed for
    the cores, so a measurement taken between them may be cached for later runs."""
    return max(same_thing_ms) <= (1 + BUSY_SPREAD) * min(same_thing_ms)


@torch.inference_mode()
def median_ms(call: Callable[[], object], repeats: int, device: object | None = None, *,
              setup: Callable[[], object] | None = None) -> float:
    """Median wall ms of `repeats` calls of `call` after one untimed warm-up call (the upper middle
    one for an even count). `setup` runs untimed before every call (e.g. a cache cut back to its
    context); on a GPU (`device` a CUDA torch.device) each call is waited for."""
    def synchronise() -> None:
        if getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)

    def timed() -> float:
        if setup is not None:
            setup()
        synchronise()
        start = time.perf_counter()
        call()
        synchronise()
        return 1000 * (time.perf_counter() - start)

    timed()
    samples = sorted(timed() for _ in range(repeats))
    return samples[len(samples) // 2]


def decoding_takes_every_core() -> bool:
    """Whether the decoding's threads use every core this process may run on (so anything else on the
    machine, a browser drawing the page, runs in their time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() >= cores
