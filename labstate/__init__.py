"""Per-user lab state and the few services the UI calls, one concern per module.

No gradio and no plotting here (app.py wires events, viz/ draws):
- `settings`: the settings said once (`SETTING_NAMES`, `Settings`, `parse_settings`) and the DecodeConfig they map to;
- `prompt`: prompt clean-up; `errors`: the messages a user sees instead of tracebacks; `limits`: accepted sizes;
- `runtime`: the shared read-only model and heads per precision, the verify-cost profile, token bytes;
- `runs`: a run (prepare, prefill, step); `sessions`: per-user `LabState` in a bounded `SessionRegistry`;
- `plain`: plain decoding as the yardstick (greedy reference, check, speed against plain).
"""
from __future__ import annotations

from labstate.errors import LabInputError, LabNotice, SessionExpired
from labstate.limits import MAX_CUSTOM_TREE_NODES, MAX_TEMPERATURE
from labstate.plain import (GreedyCheck, PlainComparison, Reference, ar_baseline, compute_check, greedy_check,
                            reference, require_run, speed_vs_plain)
from labstate.prompt import sanitize_prompt
from labstate.runs import (PAUSED, READY, RUNNING, STOPPED, Prepared, Run, prepare, start_prepared, start_run,
                           step_run, wait_idle)
from labstate.runtime import _PROFILES, Runtime, cost_profile, measure_forward_seconds, runtime
from labstate.sessions import LabState, SessionRegistry
from labstate.settings import (AUTO_STRATEGY, CUSTOM_TREE, LOOKUP_STRATEGY, PRECISIONS, SETTING_NAMES, STORE_STRATEGY,
                               STRATEGY_HELP, STRATEGY_LABELS, UI_STRATEGIES, Settings, decode_config, fixed_choice,
                               parse_custom_tree, parse_settings)
from core.tree import load_named_trees

__all__ = [
    "LabInputError", "LabNotice", "SessionExpired", "MAX_CUSTOM_TREE_NODES", "MAX_TEMPERATURE", "GreedyCheck",
    "PlainComparison", "Reference", "ar_baseline", "compute_check", "greedy_check", "reference", "require_run",
    "speed_vs_plain", "sanitize_prompt", "PAUSED", "READY", "RUNNING", "STOPPED", "Prepared", "Run", "prepare",
    "start_prepared", "start_run", "step_run", "wait_idle", "_PROFILES", "Runtime", "cost_profile", "measure_forward_seconds",
    "runtime", "LabState", "SessionRegistry", "AUTO_STRATEGY", "CUSTOM_TREE", "LOOKUP_STRATEGY", "STORE_STRATEGY", "PRECISIONS",
    "SETTING_NAMES", "STRATEGY_HELP", "STRATEGY_LABELS", "UI_STRATEGIES", "Settings", "decode_config",
    "fixed_choice", "parse_custom_tree", "parse_settings", "load_named_trees",
]
