"""The settings panel, said once: names, defaults, checks, and the core DecodeConfig they map to.

`SETTING_NAMES` is the one list of settings in UI/API order; the app builds its handlers' named
parameters and its panel from it, and `parse_settings` reads raw values (any JSON type) by name.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from core.strategy import (ACCEPT_RULES, DEFAULT_BUDGET, DEFAULT_DEPTH, DEFAULT_FIXED_TREE,
                           DEFAULT_NEW_TOKENS, DEFAULT_TOP_M, DYNAMIC, MAX_BUDGET, MAX_NEW_TOKENS,
                           MAX_TOP_M, StrategyError, StrategySpec, check_int, parse_strategy)
from core.families import FAMILIES
from core.tree import fixed_tree, load_named_trees
from core.tensor_thread import tensor_work
from labstate.errors import LabInputError, show
from labstate.limits import MAX_CUSTOM_TREE_CHARS, MAX_CUSTOM_TREE_NODES, MAX_DEPTH, MAX_TEMPERATURE

PRECISIONS = ("fp32", "bf16", "gguf", "gguf-q8")


@functools.lru_cache(maxsize=1)  # later calls answer at once, without waiting for the tensor thread's queue
@tensor_work  # the first call measures both precisions (core.tensor_thread)
def machine_precision() -> str:
    """The precision a run starts in: fp32 unless bf16 measured clearly faster here (measured once, cached)."""
    from core.precision import default_precision  # measured on first use: replay never loads torch for it

    return default_precision()
# The strategies the panel offers, in the one grammar (core.strategy), family by family from the family table
# (core.families: its help texts and variants); the node budget is its own slider. Read when asked, so a
# family added to the table is offered too.
def panel_strategies() -> dict[str, tuple[StrategySpec, str]]:
    """Strategy text -> (its spec, its help), in the panel's order."""
    offered = {}
    for name, entry in FAMILIES.items():
        for variant, help_text in entry.panel_variants():
            spec = parse_strategy(f"{name}:{variant}" if variant else name)
            offered[spec.text] = (spec, help_text)
    return offered


def ui_strategies() -> tuple[str, ...]:
    """The panel's strategy texts."""
    return tuple(panel_strategies())


def strategy_labels() -> dict[str, str]:
    """Strategy text -> what a reader sees."""
    return {text: spec.label for text, (spec, _) in panel_strategies().items()}


def strategy_help() -> dict[str, str]:
    """Strategy text -> the panel's help for it."""
    return {text: help_text for text, (_, help_text) in panel_strategies().items()}


AUTO_STRATEGY = StrategySpec(DYNAMIC, auto=True).text
LOOKUP_STRATEGY = StrategySpec(DYNAMIC, auto=True, lookup=True).text
STORE_STRATEGY = StrategySpec(DYNAMIC, auto=True, lookup=True, store=True).text
CUSTOM_TREE = "custom"  # the fixed-preset choice that uses the custom-tree text box
CUSTOM_TREE_EXAMPLE = "e.g. [[0], [1], [0, 0]]"


@dataclass(frozen=True)
class Settings:
    """Everything the settings panel controls. The defaults are the page's first run: a tree that pays on a CPU."""

    spec: StrategySpec = StrategySpec(DYNAMIC, auto=True, lookup=True)  # the strategy (its budget is `budget`)
    budget: int = DEFAULT_BUDGET
    top_m: int = DEFAULT_TOP_M
    depth: int = DEFAULT_DEPTH
    fixed_preset: str = DEFAULT_FIXED_TREE
    rule: str = "greedy"
    temperature: float = 0.0
    precision: str = field(default_factory=machine_precision)
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    compare_fixed: bool = True
    custom_tree: tuple[tuple[int, ...], ...] = ()  # rank paths, used when fixed_preset == "custom"
    compare_heads: str = ""  # another family's tree on the same context: "" none, "auto" the table's rival, or a family

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def strategy(self) -> str:
        """The decoding family: autoregressive, fixed, dynamic or hydra."""
        return self.spec.family

    @property
    def auto_budget(self) -> bool:
        return self.spec.auto

    @property
    def uses_fixed_tree(self) -> bool:
        """The fixed tree is decoded (fixed strategy) or drawn beside a dynamic run (the comparison)."""
        return uses_fixed_tree(self.spec, self.compare_fixed)

    @property
    def lookup(self) -> bool:
        return self.spec.lookup

    @property
    def store(self) -> bool:
        return self.spec.store

    @property
    def ui_strategy(self) -> str:
        """The strategy as the panel and the API name it (the grammar's printer)."""
        return self.spec.text

    @property
    def strategy_label(self) -> str:
        """The strategy for a reader, with this run's budget (the grammar's label)."""
        return self.spec.with_budget(self.budget).label

    def raw(self) -> dict[str, object]:
        """The UI/API values, by name in SETTING_NAMES order (the inverse of `parse_settings`)."""
        values = {name: getattr(self, name) for name in SETTING_NAMES}
        values["strategy"] = self.ui_strategy
        values["custom_tree"] = json.dumps([list(p) for p in self.custom_tree]) if self.custom_tree else ""
        return values


def _as_int(name: str, value: object, low: int, high: int) -> int:
    """An integer setting (sliders may send 63.0, the API "12"), range-checked by `core.strategy.check_int`;
    LabInputError when missing, fractional or out of range."""
    if isinstance(value, str):  # the API may send "12"; anything else that is not a number is refused below
        try:
            value = float(value.strip())
        except ValueError:
            raise LabInputError(f"{name} must be a whole number, got {show(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
            value in (float("inf"), float("-inf")) or int(value) != value:
        raise LabInputError(f"{name} must be a whole number, got {show(value)}")
    try:
        check_int(name, int(value), low, high)
    except ValueError as error:
        raise LabInputError(str(error)) from None
    return int(value)


def _as_float(name: str, value: object, low: float, high: float) -> float:
    """A number in [low, high] (the API may send it as text)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise LabInputError(f"{name} must be a number between {low:g} and {high:g}, got {show(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
        raise LabInputError(f"{name} must be a number between {low:g} and {high:g}, got {show(value)}")
    return float(value)


def _as_bool(name: str, value: object) -> bool:
    """True/false, 0/1, None or the words true/false."""
    if isinstance(value, bool):
        return value
    if value in (0, 1, None):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise LabInputError(f"{name} must be true or false, got {show(value)}")


def rival_choices() -> tuple[str, ...]:
    """What the compare-heads setting takes: "" (none), "auto" (the family table's rival) or a family that
    may be drawn beside another's (its `rival_choice`)."""
    return ("", "auto", *(name for name, entry in FAMILIES.items() if entry.rival_choice))


def _as_rival(value: object) -> str:
    """The family drawn beside the run's: one of rival_choices(); true = "auto" (the family table's
    rival: Medusa <-> Hydra, EAGLE -> Hydra) and false = "" (none), as the old check box sent."""
    if isinstance(value, str) and value in rival_choices():
        return value
    try:
        return "auto" if _as_bool("the drafter drawn beside", value) else ""
    except LabInputError:
        return _choice("the drafter drawn beside", value, rival_choices())


def _choice(name: str, value: object, choices: tuple[str, ...] | list[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise LabInputError(f"{name} must be one of {', '.join(choices)}, got {show(value)}")
    return value


def _strategy(value: object) -> StrategySpec:
    """One of the panel's strategies, in the grammar (`autoregressive` and `ar` alike)."""
    try:
        spec = parse_strategy(value)
    except StrategyError:
        spec = None
    offered = ui_strategies()
    if spec is None or spec.text not in offered:
        raise LabInputError(f"strategy must be one of {', '.join(offered)}, got {show(value)} (the node "
                            f"budget is its own setting)")
    return spec


def _preset(value: object) -> str:
    presets = load_named_trees()
    if not isinstance(value, str) or (value not in presets and value != CUSTOM_TREE):
        raise LabInputError(f"unknown fixed tree {show(value)}; choose one of {', '.join(presets)} or {CUSTOM_TREE}")
    return value


# One checker per setting, in SETTING_NAMES order: raw value -> checked value.
CHECKS: dict[str, Callable[[object], object]] = {
    "strategy": _strategy,
    "budget": lambda v: _as_int("node budget", v, 1, MAX_BUDGET),
    "top_m": lambda v: _as_int("top-m", v, 1, MAX_TOP_M),
    "depth": lambda v: _as_int("depth", v, 1, MAX_DEPTH),
    "fixed_preset": _preset,
    "rule": lambda v: _choice("acceptance rule", v, ACCEPT_RULES),
    "temperature": lambda v: _as_float("temperature", v, 0.0, MAX_TEMPERATURE),
    "precision": lambda v: _choice("precision", v, PRECISIONS),
    "max_new_tokens": lambda v: _as_int("max new tokens", v, 1, MAX_NEW_TOKENS),
    "compare_fixed": lambda v: _as_bool("compare with the fixed tree", v),
    "custom_tree": lambda v: v,  # read by parse_custom_tree, and only when the preset is "custom"
    "compare_heads": _as_rival,
}
SETTING_NAMES: tuple[str, ...] = tuple(CHECKS)


def parse_settings(values: Mapping[str, object]) -> Settings:
    """Validated settings from raw UI/API values keyed by SETTING_NAMES (missing ones take the defaults).

    LabInputError with a clear message for anything else. `strategy` may be "dynamic:auto" (dynamic
    with the adaptive budget) or "dynamic:auto+lookup" (that plus a prompt-lookup chain in every tree).
    """
    unknown = sorted(set(values) - set(SETTING_NAMES))
    if unknown:
        raise LabInputError(f"unknown setting{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    raw = {**Settings().raw(), **values}
    checked = {name: CHECKS[name](raw[name]) for name in SETTING_NAMES}
    if checked["rule"] == "greedy" and checked["temperature"] > 0:
        raise LabInputError("the greedy rule needs temperature 0; pick typical or speculative acceptance to sample")
    spec = checked.pop("strategy")
    custom = checked.pop("custom_tree")
    used = checked["fixed_preset"] == CUSTOM_TREE and uses_fixed_tree(spec, checked["compare_fixed"])
    try:
        paths = parse_custom_tree(custom) if used else ()  # a box nothing reads never blocks Start
    except LabInputError as error:
        if FAMILIES[spec.family].decodes_fixed_tree:
            raise
        raise LabInputError(f"{error} (with the {spec.text} strategy only the fixed-tree comparison uses the custom "
                            f"tree: fix it, pick a preset, or untick the comparison)") from None
    return Settings(spec=spec, custom_tree=paths, **checked)


def uses_fixed_tree(spec: StrategySpec, compare_fixed: bool) -> bool:
    """Whether a run of `spec` reads the fixed tree: decoding with it, or the comparison of a dynamic run."""
    entry = FAMILIES[spec.family]
    return entry.decodes_fixed_tree or (compare_fixed and entry.fixed_beside)


def _custom_tree_value(text: object) -> object:
    """The JSON value in the custom-tree box (or the list itself from the API)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        raise LabInputError(f"custom tree: the box is empty; type a JSON list of rank paths, {CUSTOM_TREE_EXAMPLE}")
    if not isinstance(text, str):
        return text
    if len(text) > MAX_CUSTOM_TREE_CHARS:
        raise LabInputError(f"custom tree: the text is {len(text):,} characters; up to "
                            f"{MAX_CUSTOM_TREE_CHARS:,} are accepted")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        detail = f" ({error.msg} at line {error.lineno} column {error.colno})" if \
            isinstance(error, json.JSONDecodeError) else ""
        raise LabInputError(f"custom tree: not valid JSON{detail}; expected a list of rank paths, "
                            f"{CUSTOM_TREE_EXAMPLE}") from None


def _rank_path(number: int, path: object) -> tuple[int, ...]:
    """One checked rank path of the custom tree."""
    if not isinstance(path, list) or not path:
        raise LabInputError(f"custom tree: path {number} must be a non-empty list of ranks, got {show(path)}")
    if len(path) > MAX_DEPTH:
        raise LabInputError(f"custom tree: path {number} is {len(path)} deep; no model here has that many heads")
    for rank in path:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_TOP_M:
            raise LabInputError(f"custom tree: ranks must be whole numbers from 0 to {MAX_TOP_M - 1}; "
                                f"path {show(path)} has {show(rank)}")
    return tuple(path)


def parse_custom_tree(text: object) -> tuple[tuple[int, ...], ...]:
    """Rank paths from the custom-tree box: a JSON list of non-empty lists of ranks, prefix-closed.

    e.g. `[[0], [1], [0, 0]]`. Depth against the loaded heads is checked in `decode_config`.
    """
    value = _custom_tree_value(text)
    if not isinstance(value, list):
        raise LabInputError(f"custom tree must be a JSON list of rank paths ({CUSTOM_TREE_EXAMPLE}), got "
                            f"{type(value).__name__ if not isinstance(value, dict) else 'an object'}")
    if not value:
        raise LabInputError(f"custom tree is empty: give at least one rank path, {CUSTOM_TREE_EXAMPLE}")
    if len(value) > MAX_CUSTOM_TREE_NODES:
        raise LabInputError(f"custom tree has {len(value)} paths; the lab accepts up to {MAX_CUSTOM_TREE_NODES}")
    paths = [_rank_path(number, path) for number, path in enumerate(value, start=1)]
    try:
        tree = fixed_tree([list(p) for p in paths])  # core's own check: prefix-closed (every parent present)
    except ValueError as error:
        raise LabInputError(f"custom tree: {error}") from None
    return tuple(tree.paths)


# "Lecture": a prompt the shipped heads guess well and a fixed 31-node dynamic tree (not the auto budget,
# which keeps trees small on a CPU), so that the first Steps already show accepted head paths (2-core
# Zen 5, gguf-q8: 1, 1, 1, 2, 1, 2 head tokens accepted at steps 1-6, 2.8 tokens a step over 64 tokens);
# the precision is left as it is.
LECTURE_PROMPT = "Count from 1 to 30, one number per line."
LECTURE_SETTINGS = {"strategy": "dynamic", "budget": 31, "top_m": 32, "depth": 4, "rule": "greedy",
                    "temperature": 0.0, "max_new_tokens": 64, "compare_fixed": True, "fixed_preset": "mc_sim_7b_63",
                    "compare_heads": ""}


def parse_clicked_at(value: object) -> float | None:
    """The page's clock at a click (ms), or None when the client sent none; LabInputError for anything
    but a finite number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LabInputError(f"clicked_at must be the page's clock in milliseconds (a number), got {value!r:.40}")
    return float(value)


def parse_step_index(value: object) -> int:
    """A 0-based record index from the Revisit box (steps are numbered from 1 on the page)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise LabInputError(f"step index must be a whole number, got {value!r}")
    return int(max(min(value, 10**6), 1)) - 1
