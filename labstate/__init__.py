"""Per-user lab state and the few services the UI calls, one concern per module.

No gradio and no plotting here (app.py wires events, viz/ draws):
- `settings`: the settings said once (`SETTING_NAMES`, `Settings`, `parse_settings`), strategies in
  core's one grammar; `prompt`: prompt clean-up; `errors`: the messages a user sees instead of
  tracebacks; `limits`: accepted sizes;
- `shared`: the shared read-only model and heads per precision, the verify-cost profile, token bytes;
- `runs`: a run (prepare: check, tokenize, the DecodeConfig); `sessions`: per-user `LabState` in a
  bounded `SessionRegistry`; `plain`: plain decoding as the yardstick (greedy reference, check,
  speed against plain); `lifecycle`: Start, Step, Run to end, Stop, Reset, Check, a run's facts
  for the views and its JSON trace;
- `replay`: recorded runs (traces and the gallery) stepped without a model: imports no torch; `trace`:
  the JSON trace format a run is written to and read back from.

Names are loaded on first use (`labstate.parse_settings` imports `labstate.settings` only), so the
replay-only page imports neither torch nor transformers.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "errors": ("LabInputError", "LabNotice", "SessionExpired"),
    "limits": ("MAX_CUSTOM_TREE_NODES", "MAX_TEMPERATURE"),
    "prompt": ("sanitize_prompt",),
    "settings": ("AUTO_STRATEGY", "CUSTOM_TREE", "LECTURE_PROMPT", "LECTURE_SETTINGS", "LOOKUP_STRATEGY",
                 "PRECISIONS", "SETTING_NAMES", "STORE_STRATEGY", "Settings", "load_named_trees",
                 "machine_precision", "panel_strategies", "rival_choices", "strategy_help", "strategy_labels",
                 "ui_strategies",
                 "parse_clicked_at", "parse_custom_tree", "parse_settings", "parse_step_index"),
    "shared": ("Runtime", "SharedModels", "cost_profile", "header_line", "measure_forward_seconds", "runtime",
               "warm_up"),
    "modes": ("PAUSED", "READY", "RUNNING", "STOPPED"),
    "runs": ("Prepared", "Run", "decode_config", "fixed_choice", "page_views", "prepare"),
    "sessions": ("LabState", "SessionRegistry"),
    "zerogpu": ("gpu_call", "on_zero_gpu", "records_on_start"),
    "plain": ("GreedyCheck", "PlainComparison", "Reference", "ar_baseline", "compute_check", "greedy_check",
              "reference", "speed_vs_plain"),
    "lifecycle": ("DROPPED_STEP", "STOPPED_MESSAGE", "RedrawPacer", "check_now", "decoding_state", "ensure_run",
                  "export_trace", "facts_of", "most_accepted_step", "note_page_draw", "note_page_time", "record_lab",
                  "record_run", "require_run", "reset", "run_end_message", "run_to_end", "run_trace", "start_fresh",
                  "start_prepared", "start_run", "step_once", "step_run", "stop", "wait_idle"),
    # core's own, for the page (app.py reaches core through labstate alone)
    "core.machine": ("decoding_takes_every_core",),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """`labstate.X` for every public name, imported from its module on first use."""
    if name in _HOMES:  # a submodule (tests patch `labstate.plain`)
        return importlib.import_module(f"labstate.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'labstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module if "." in module else f"labstate.{module}"), name)
    globals()[name] = value
    return value
