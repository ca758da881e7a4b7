"""Where the project is and where it caches what it builds or measures on this machine (compiled
kernels, cost profiles, precision choices). A leaf: imports nothing of the project."""
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("MEDUSA_LAB_CACHE", REPO_ROOT / ".cache"))
