"""What a run is doing, for the status card (finished comes from the decoding session itself)."""
from __future__ import annotations

# READY after Start, PAUSED after a Step, RUNNING inside Run to end, STOPPED after Stop
READY, PAUSED, RUNNING, STOPPED = "ready", "paused", "running", "stopped"
