"""Where the project is and where it caches what it builds or measures on this machine (compiled
kernels, cost profiles, precision choices). Imports only the settings leaf."""
from pathlib import Path

from core.settings import SETTINGS

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(SETTINGS.cache) if SETTINGS.cache else REPO_ROOT / ".cache"
