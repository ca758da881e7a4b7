"""The machine a figure was measured on: names that key cached measurements and label results."""
from __future__ import annotations

import platform
from pathlib import Path

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


def cpu_fingerprint() -> str:
    """The CPU's model name and feature flags (AVX512-BF16 and friends decide the fast paths)."""
    return f"{cpu_name()}|{_cpuinfo_fields().get('flags', '')}"


BUSY_SPREAD = 0.15  # repeated timings of one thing may differ this much on a quiet machine


def measured_quietly(*same_thing_ms: float) -> bool:
    """True when repeated timings of the same work agree within BUSY_SPREAD: nothing else competed for
    the cores, so a measurement taken between them may be cached for later runs."""
    return max(same_thing_ms) <= (1 + BUSY_SPREAD) * min(same_thing_ms)
