"""Building and loading the exact engine's C++ kernels (once per machine, cached on disk).

`torch.utils.cpp_extension` compiles `kernels/exact.cpp` for this CPU (`-march=native`) into
`<cache>/extensions/<key>`, the key naming the source, the CPU, torch and the flags; later
processes load the cached library in well under a second. Where no compiler is present or the
build fails, `load_kernels` returns None, `kernels_unavailable_reason` says why, and the lean
forward serves.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from core import settings
from core.machine import cpu_fingerprint

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "exact.cpp"
# -ffp-contract=off: only the multiply-adds the source writes as fused are fused, so every
# rounding happens where the source says, whatever the compiler would prefer
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17")
# the same libgomp torch loaded (its soname), so the kernels join torch's OpenMP team, never a second one
LDFLAGS = ("-fopenmp",)

_failure: list[str] = []


def build_key() -> str:
    """What the compiled library depends on: source, CPU, torch, compiler flags, compiler."""
    text = "|".join([SOURCE.read_text(), cpu_fingerprint(), torch.__version__, " ".join(CFLAGS),
                     os.environ.get("CXX", "c++")])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kernels_unavailable_reason() -> str | None:
    """Why the exact kernels are not loaded (None when they are, or were never asked for)."""
    return _failure[-1] if _failure else None


@functools.lru_cache(maxsize=1)
def load_kernels(cache_dir: Path) -> ModuleType | None:
    """The compiled kernels (built on first use, then loaded from `cache_dir`), or None with the
    reason logged when they cannot be built here."""
    if settings.SETTINGS.no_kernels:  # never build: the lean forward serves (tests, comparisons)
        _failure.append("MEDUSA_LAB_NO_KERNELS=1")
        return None
    from torch.utils import cpp_extension
    _put_ninja_on_path()
    key = build_key()
    folder = cache_dir / "extensions" / key
    name = f"medusa_exact_{key}"
    fresh = not any(folder.glob("*.so"))
    if fresh:
        log.warning("building the exact engine's kernels for this CPU (once, about a minute; cached in %s)", folder)
    started = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                                    extra_ldflags=list(LDFLAGS), build_directory=str(folder), verbose=False)
    except (OSError, RuntimeError, ImportError, SystemExit) as error:  # no compiler, failed build, bad library
        reason = f"the exact kernels could not be built here ({type(error).__name__}: {str(error).strip()[:300]})"
        log.warning("%s; the lean forward serves (exact up to rounding)", reason)
        _failure.append(reason)
        return None
    if fresh:
        log.warning("exact kernels built in %.0f s (%s)", time.perf_counter() - started, module.ISA)
    _failure.clear()
    return module


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja`: the one pip installed beside this Python (requirements.txt) serves
    where none is on PATH (a venv that was never activated)."""
    import shutil
    import sys
    folder = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=folder) is not None:
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def main() -> None:
    """Build (or find) the kernels for this machine: `python -m core.engine.build` (scripts/setup.sh)."""
    from core.paths import CACHE_DIR
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    started = time.perf_counter()
    module = load_kernels(CACHE_DIR)
    if module is None:
        print(f"exact kernels: not available ({kernels_unavailable_reason()}); the lean forward will serve")
    else:
        print(f"exact kernels: ready ({module.ISA}, {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
