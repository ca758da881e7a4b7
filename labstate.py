"""Per-user lab state and the few services the UI calls: start, step, plain-greedy reference.

No gradio and no plotting here (app.py wires events, viz/ draws). The model and heads are
shared, loaded once per precision and never modified; everything a user changes lives in a
`LabState`, kept server-side in a `SessionRegistry` (keyed by Gradio's session hash) with a
cap on live sessions and idle expiry, so memory stays bounded however many people visit.

Input checks live here too: every raw UI/API value (any JSON type) goes through
`sanitize_prompt`, `parse_settings`, `parse_custom_tree` and `prepare`, which raise
`LabInputError` with a message meant for the page. `LabNotice` is for actions that do not
apply right now (the run has finished, the session expired): not an error, just a note.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from core.accept import RULES, AcceptConfig
from core.decoder import MAX_BUDGET, MAX_NEW_TOKENS, MAX_TOP_M, STRATEGIES, DecodeConfig, DecodeSession, \
    decode, start_session
from core.exactness import explain_divergence
from core.heads import MedusaHeads, default_heads
from core.kvcache import truncate
from core.lookup import CHAIN_TOKENS
from core.records import StepRecord
from core.model import BaseModel, ModelConfig, load_base_model
from core.profile import CostProfile, verify_profile
from core.sampling import SamplingConfig
from core.tree import fixed_tree, load_named_trees
from core.verify import forward_tokens
from viz.timing_plot import ArBaseline

PRECISIONS = ("fp32", "bf16")
AUTO_STRATEGY = "dynamic:auto"  # the UI's "dynamic (auto budget)": dynamic + DecodeConfig.auto_budget
LOOKUP_STRATEGY = "dynamic:auto+lookup"  # the same plus a prompt-lookup chain in every tree
UI_STRATEGIES = (*STRATEGIES, AUTO_STRATEGY, LOOKUP_STRATEGY)
CUSTOM_TREE = "custom"  # the fixed-preset choice that uses the custom-tree text box
MAX_TEMPERATURE = 2.0
# Prompts: refused above MAX_PROMPT_TOKENS (chat template included). 2048 keeps a session's KV cache
# (46 KB/token in fp32 for SmolLM2-135M) under ~150 MB even with 1024 new tokens and a 256-node tree,
# and a CPU prefill to a few seconds. Texts above MAX_PROMPT_CHARS are refused without tokenizing.
MAX_PROMPT_TOKENS = int(os.environ.get("MEDUSA_LAB_MAX_PROMPT_TOKENS", "2048"))
MAX_PROMPT_CHARS = 100_000
MAX_CUSTOM_TREE_NODES = MAX_BUDGET
MAX_CUSTOM_TREE_CHARS = 20_000
MAX_REFERENCES = 8  # plain-greedy runs cached per session
STEP_LOCK_TIMEOUT_S = 120.0
KEEP_CHARS = {"\n", "\t"}  # control characters a prompt may keep ("\r\n" becomes "\n")


class LabInputError(ValueError):
    """Bad user input (prompt, settings, custom tree); the message is for the page and the API."""


class LabNotice(LabInputError):
    """An action that does not apply right now (run finished, nothing to check, session expired): shown as a
    note rather than an error. A LabInputError subclass, so callers that catch LabInputError see both."""


@dataclass(frozen=True)
class Settings:
    """Everything the settings panel controls."""

    strategy: str = "dynamic"
    budget: int = 63
    top_m: int = 32
    depth: int = 4
    fixed_preset: str = "mc_sim_7b_63"
    rule: str = "greedy"
    temperature: float = 0.0
    precision: str = "fp32"
    max_new_tokens: int = 128
    compare_fixed: bool = True
    auto_budget: bool = False  # dynamic only: per step the node count (<= budget) with the best tokens/s
    lookup: bool = False  # dynamic only: a prompt-lookup chain joins every tree
    custom_tree: tuple[tuple[int, ...], ...] = ()  # rank paths, used when fixed_preset == "custom"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def strategy_label(self) -> str:
        label = f"dynamic (auto budget ≤ {self.budget})" if self.auto_budget else self.strategy
        return label + " + prompt lookup" if self.lookup else label


@dataclass(frozen=True)
class Runtime:
    """The shared, read-only model and heads for one precision."""

    base: BaseModel
    heads: MedusaHeads
    heads_description: str

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads


@functools.lru_cache(maxsize=len(PRECISIONS))
def runtime(precision: str) -> Runtime:
    """Load (once) the base model in `precision` and heads of the same dtype and device."""
    base = load_base_model(ModelConfig(dtype=precision))
    config = base.model.config
    heads, description = default_heads(config.hidden_size, config.vocab_size, dtype=base.dtype, device=base.device)
    return Runtime(base=base, heads=heads, heads_description=description)


def _as_int(name: str, value: object, low: int, high: int) -> int:
    """An integer setting (sliders may send 63.0); LabInputError when missing, fractional or out of range."""
    if isinstance(value, str):  # the API may send "12"; anything else that is not a number is refused below
        try:
            value = float(value.strip())
        except ValueError:
            raise LabInputError(f"{name} must be a whole number, got {_show(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
            value in (float("inf"), float("-inf")) or int(value) != value:
        raise LabInputError(f"{name} must be a whole number, got {_show(value)}")
    if not low <= int(value) <= high:
        raise LabInputError(f"{name} must be between {low} and {high}, got {int(value)}")
    return int(value)


def _as_float(name: str, value: object, low: float, high: float) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise LabInputError(f"{name} must be a number between {low:g} and {high:g}, got {_show(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
        raise LabInputError(f"{name} must be a number between {low:g} and {high:g}, got {_show(value)}")
    return float(value)


def _as_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1, None):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise LabInputError(f"{name} must be true or false, got {_show(value)}")


def _show(value: object, limit: int = 60) -> str:
    """A short repr for messages (an API client may send a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _choice(name: str, value: object, choices: tuple[str, ...] | list[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise LabInputError(f"{name} must be one of {', '.join(choices)}, got {_show(value)}")
    return value


def parse_settings(strategy: object, budget: object, top_m: object, depth: object, fixed_preset: object,
                   rule: object, temperature: object, precision: object, max_new_tokens: object,
                   compare_fixed: object, custom_tree: object = "") -> Settings:
    """Validated settings from raw UI/API values (any JSON type); LabInputError with a clear message otherwise.

    `strategy` may be "dynamic:auto" (dynamic with the adaptive budget) or "dynamic:auto+lookup" (that
    plus a prompt-lookup chain in every tree). `custom_tree` (JSON text) is
    read only when `fixed_preset` is "custom".
    """
    strategy = _choice("strategy", strategy, UI_STRATEGIES)
    rule = _choice("acceptance rule", rule, tuple(RULES))
    precision = _choice("precision", precision, PRECISIONS)
    presets = load_named_trees()
    if not isinstance(fixed_preset, str) or (fixed_preset not in presets and fixed_preset != CUSTOM_TREE):
        raise LabInputError(f"unknown fixed tree {_show(fixed_preset)}; choose one of {', '.join(presets)} "
                            f"or {CUSTOM_TREE}")
    temperature = _as_float("temperature", temperature, 0.0, MAX_TEMPERATURE)
    if rule == "greedy" and temperature > 0:
        raise LabInputError("the greedy rule needs temperature 0; pick typical or speculative acceptance to sample")
    paths = parse_custom_tree(custom_tree) if fixed_preset == CUSTOM_TREE else ()
    auto, lookup = strategy in (AUTO_STRATEGY, LOOKUP_STRATEGY), strategy == LOOKUP_STRATEGY
    return Settings(strategy="dynamic" if auto else strategy, budget=_as_int("node budget", budget, 1, MAX_BUDGET),
                    top_m=_as_int("top-m", top_m, 1, MAX_TOP_M), depth=_as_int("depth", depth, 1, 16),
                    fixed_preset=fixed_preset, rule=rule, temperature=temperature, precision=precision,
                    max_new_tokens=_as_int("max new tokens", max_new_tokens, 1, MAX_NEW_TOKENS),
                    compare_fixed=_as_bool("compare with the fixed tree", compare_fixed), auto_budget=auto,
                    lookup=lookup, custom_tree=paths)


def parse_custom_tree(text: object) -> tuple[tuple[int, ...], ...]:
    """Rank paths from the custom-tree box: a JSON list of non-empty lists of ranks, prefix-closed.

    e.g. `[[0], [1], [0, 0]]`. Depth against the loaded heads is checked in `decode_config`.
    """
    example = "e.g. [[0], [1], [0, 0]]"
    if text is None or (isinstance(text, str) and not text.strip()):
        raise LabInputError(f"custom tree: the box is empty; type a JSON list of rank paths, {example}")
    if isinstance(text, str):
        if len(text) > MAX_CUSTOM_TREE_CHARS:
            raise LabInputError(f"custom tree: the text is {len(text):,} characters; up to "
                                f"{MAX_CUSTOM_TREE_CHARS:,} are accepted")
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as error:
            detail = f" ({error.msg} at line {error.lineno} column {error.colno})" if \
                isinstance(error, json.JSONDecodeError) else ""
            raise LabInputError(f"custom tree: not valid JSON{detail}; expected a list of rank paths, {example}") \
                from None
    else:
        value = text  # the API may send the list itself
    if not isinstance(value, list):
        raise LabInputError(f"custom tree must be a JSON list of rank paths ({example}), got "
                            f"{type(value).__name__ if not isinstance(value, dict) else 'an object'}")
    if not value:
        raise LabInputError(f"custom tree is empty: give at least one rank path, {example}")
    if len(value) > MAX_CUSTOM_TREE_NODES:
        raise LabInputError(f"custom tree has {len(value)} paths; the lab accepts up to {MAX_CUSTOM_TREE_NODES}")
    paths = []
    for number, path in enumerate(value, start=1):
        if not isinstance(path, list) or not path:
            raise LabInputError(f"custom tree: path {number} must be a non-empty list of ranks, got {_show(path)}")
        if len(path) > 16:
            raise LabInputError(f"custom tree: path {number} is {len(path)} deep; no model here has that many heads")
        for rank in path:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_TOP_M:
                raise LabInputError(f"custom tree: ranks must be whole numbers from 0 to {MAX_TOP_M - 1}; "
                                    f"path {_show(path)} has {_show(rank)}")
        paths.append(tuple(path))
    try:
        tree = fixed_tree([list(p) for p in paths])  # core's own check: prefix-closed (every parent present)
    except ValueError as error:
        raise LabInputError(f"custom tree: {error}") from None
    return tuple(tree.paths)


def fixed_choice(preset: str, depth: int, custom: tuple[tuple[int, ...], ...] = ()) -> tuple[str | tuple, str]:
    """The fixed tree for `depth` heads: the named preset (or the custom paths), cut at `depth` with a note."""
    paths = custom if preset == CUSTOM_TREE else load_named_trees()[preset]
    if max(len(p) for p in paths) <= depth:
        return (tuple(paths) if preset == CUSTOM_TREE else preset), ""
    kept = tuple(tuple(p) for p in paths if len(p) <= depth)
    return kept, f"fixed tree {preset} cut to depth {depth} ({len(kept)} of {len(paths)} nodes)"


def decode_config(settings: Settings, num_heads: int) -> tuple[DecodeConfig, str]:
    """The core DecodeConfig for these settings, plus a note on any adjustment made."""
    if settings.depth > num_heads:
        raise LabInputError(f"depth {settings.depth} exceeds the {num_heads} heads loaded")
    uses_fixed = settings.strategy == "fixed" or (settings.compare_fixed and settings.strategy == "dynamic")
    if settings.fixed_preset == CUSTOM_TREE:
        if not settings.custom_tree:
            raise LabInputError("custom tree is empty: give at least one rank path, e.g. [[0], [1], [0, 0]]")
        deepest = max(settings.custom_tree, key=len)
        if len(deepest) > num_heads:
            raise LabInputError(f"custom tree: path {list(deepest)} is {len(deepest)} deep but only {num_heads} "
                                f"heads are loaded")
    tree, note = fixed_choice(settings.fixed_preset, settings.depth, settings.custom_tree)
    accept = AcceptConfig(rule=settings.rule, sampling=SamplingConfig(temperature=settings.temperature))
    config = DecodeConfig(strategy=settings.strategy, budget=settings.budget, top_m=settings.top_m,
                          depth=settings.depth, fixed_tree=tree, accept=accept,
                          max_new_tokens=settings.max_new_tokens,
                          compare_fixed=settings.compare_fixed and settings.strategy == "dynamic",
                          auto_budget=settings.auto_budget and settings.strategy == "dynamic",
                          lookup_tokens=CHAIN_TOKENS if settings.lookup and settings.strategy == "dynamic" else 0)
    return config, note if uses_fixed else ""


@dataclass
class Reference:
    """A plain autoregressive run of the same prompt, precision and length (the greedy yardstick)."""

    output_ids: list[int]
    step_seconds: list[float]
    gaps: dict[int, float] = field(default_factory=dict)  # divergence position -> plain top-2 logit gap


@dataclass(frozen=True)
class GreedyCheck:
    """How this run's output compares with plain greedy decoding."""

    state: str  # ok | diff | pending | na
    text: str
    position: int | None = None
    logit_gap: float | None = None


@dataclass
class Run:
    """One prompt being decoded with fixed settings."""

    prompt: str
    settings: Settings
    runtime: Runtime
    session: DecodeSession
    note: str = ""

    @property
    def reference_key(self) -> tuple[str, str, int]:
        return self.prompt, self.settings.precision, self.settings.max_new_tokens


@dataclass
class LabState:
    """Everything one user (browser tab or API client) owns. Kept in a SessionRegistry, never global."""

    run: Run | None = None
    references: OrderedDict[tuple[str, str, int], Reference] = field(default_factory=OrderedDict)
    forward_seconds: dict[str, float] = field(default_factory=dict)  # precision -> one-token forward
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    epoch: int = 0  # bumped by Start, Stop, Reset and eviction: a running loop stops when it changes
    last_used: float = 0.0  # SessionRegistry clock
    active: int = 0  # handlers working on this state now (never evicted while > 0 unless idle-expired)
    _count_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def interrupt(self) -> None:
        """Make any running loop stop before its next step."""
        with self._count_lock:
            self.epoch += 1

    def enter(self) -> None:
        """A handler starts working on this state (see `active`)."""
        with self._count_lock:
            self.active += 1

    def leave(self) -> None:
        with self._count_lock:
            self.active -= 1


# -- prompt checks --------------------------------------------------------------------------------
def sanitize_prompt(prompt: object) -> tuple[str, str]:
    """The prompt with what a tokenizer cannot take removed, and a note saying what changed.

    Lone UTF-16 surrogates (a browser can send "\\ud800"; UTF-8 cannot encode them) become U+FFFD;
    control characters other than newline and tab are removed (CR LF becomes LF). Right-to-left
    text, emoji, joiners and direction marks are kept as they are. LabInputError for non-text.
    """
    if prompt is None:
        return "", ""
    if not isinstance(prompt, str):
        raise LabInputError(f"the prompt must be text, got {type(prompt).__name__}")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise LabInputError(f"The prompt is {len(prompt):,} characters; the lab accepts prompts of up to "
                            f"{MAX_PROMPT_TOKENS:,} tokens (a few thousand characters). Shorten it.")
    text = prompt.replace("\r\n", "\n")
    surrogates = controls = 0
    out = []
    for char in text:
        if "\ud800" <= char <= "\udfff":
            surrogates += 1
            out.append("\ufffd")
        elif char not in KEEP_CHARS and unicodedata.category(char) == "Cc":
            controls += 1
        else:
            out.append(char)
    notes = []
    if surrogates:
        notes.append(f"replaced {surrogates} invalid character{'s' if surrogates > 1 else ''} "
                     f"(lone UTF-16 surrogate{'s' if surrogates > 1 else ''}) with �")
    if controls:
        notes.append(f"removed {controls} control character{'s' if controls > 1 else ''}")
    note = ("Prompt cleaned: " + " and ".join(notes) + ".") if notes else ""
    return "".join(out) if notes else text, note


@dataclass(frozen=True)
class Prepared:
    """A checked prompt and settings, tokenized, ready to prefill (nothing touched a session yet)."""

    prompt: str
    settings: Settings
    runtime: Runtime
    prompt_ids: list[int]
    config: DecodeConfig
    note: str


def prepare(prompt: object, settings: Settings) -> Prepared:
    """Check the prompt (sanitized first: see `sanitize_prompt`) against the token limit and build the config."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise LabInputError("Type a prompt (or pick an MT-Bench example) first.")
    rt = runtime(settings.precision)
    config, note = decode_config(settings, rt.num_heads)
    try:
        prompt_ids = rt.base.chat_ids(prompt)
    except (TypeError, ValueError, UnicodeError) as error:  # sanitize_prompt should have made this impossible
        raise LabInputError(f"the prompt could not be tokenized ({error})") from error
    limit = min(MAX_PROMPT_TOKENS, rt.base.max_positions - MAX_NEW_TOKENS - MAX_BUDGET - 2)
    if len(prompt_ids) > limit:
        raise LabInputError(f"The prompt is {len(prompt_ids):,} tokens ({len(prompt):,} characters); the lab "
                            f"accepts prompts of up to {limit:,} tokens (the model's context is "
                            f"{rt.base.max_positions:,} tokens). Shorten it.")
    return Prepared(prompt=prompt, settings=settings, runtime=rt, prompt_ids=prompt_ids, config=config, note=note)


_PROFILES: dict[str, CostProfile] = {}  # precision -> verify-cost profile (tests may seed it)
_PROFILE_LOCK = threading.Lock()


def cost_profile(rt: Runtime) -> CostProfile:
    """The verify-cost profile for auto budget: measured once (5-10 s on a CPU), then cached on disk."""
    key = str(rt.base.dtype)
    with _PROFILE_LOCK:  # two users starting auto budget at once measure it once
        if key not in _PROFILES:
            _PROFILES[key] = verify_profile(rt.base)
        return _PROFILES[key]


def start_prepared(lab: LabState, prepared: Prepared) -> Run:
    """Prefill a prepared prompt and make it the current run (the previous run is dropped)."""
    rt, config = prepared.runtime, prepared.config
    profile = cost_profile(rt) if config.auto_budget else None
    lab.interrupt()  # a Run loop on the previous run stops
    if not _acquire(lab):
        raise LabNotice("Still busy with the previous step; try again in a moment.")
    try:
        session = start_session(rt.base, rt.heads, prepared.prompt_ids, config, profile)
        precision = prepared.settings.precision
        if precision not in lab.forward_seconds:
            lab.forward_seconds[precision] = measure_forward_seconds(rt.base, session.prompt_ids)
    except ValueError as error:  # core's own checks (prompt too long for the context, tree too deep)
        raise LabInputError(str(error)) from error
    finally:
        lab.lock.release()
    lab.run = Run(prompt=prepared.prompt, settings=prepared.settings, runtime=rt, session=session,
                  note=prepared.note)
    return lab.run


def start_run(lab: LabState, prompt: object, settings: Settings) -> Run:
    """Check, tokenize and prefill `prompt` and make it the current run."""
    return start_prepared(lab, prepare(prompt, settings))


def _acquire(lab: LabState) -> bool:
    return lab.lock.acquire(timeout=STEP_LOCK_TIMEOUT_S)


def step_run(lab: LabState, run: Run) -> StepRecord:
    """One decoding step of `run` (serialised per user: a session is not thread-safe)."""
    if run.session.finished:
        raise LabNotice(f"Decoding has finished ({run.session.stop_reason}). Press Start for a new run.")
    if not _acquire(lab):
        raise LabNotice("Still busy with the previous step; try again in a moment.")
    try:
        if run.session.finished:  # another request finished it while this one waited
            raise LabNotice(f"Decoding has finished ({run.session.stop_reason}). Press Start for a new run.")
        return run.session.step()  # a finished session frees its own KV cache
    finally:
        lab.lock.release()


# -- sessions -------------------------------------------------------------------------------------
class SessionExpired(LabNotice):
    """The session's state was dropped (idle too long, or evicted to make room)."""


class SessionRegistry:
    """Per-session LabStates keyed by Gradio's session hash, with a cap and idle expiry.

    At most `max_sessions` live states; a state unused for `idle_seconds` is dropped. When a new
    session arrives and the registry is full, the least recently used state that is not working
    right now is evicted (idle sessions go first). Evicted keys are remembered (bounded) so that
    their owner is told the session expired instead of silently getting a fresh one. Thread-safe.
    """

    def __init__(self, max_sessions: int = 32, idle_seconds: float = 1200.0, clock=time.monotonic,
                 remember_evicted: int = 4096) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._labs: OrderedDict[str, LabState] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[str, str] = OrderedDict()  # key -> why
        self._remember = remember_evicted
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._labs)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._labs

    def get(self, key: str) -> LabState | None:
        """The session's state (touched), None when it never had one; SessionExpired when it was dropped."""
        with self._lock:
            self._sweep()
            lab = self._labs.get(key)
            if lab is not None:
                self._touch(key, lab)
                return lab
            why = self._evicted.get(key)
        if why is not None:
            raise SessionExpired(f"Your session expired ({why}), so its run is gone. Press **Start** to begin "
                                 f"again.")
        return None

    def open(self, key: str) -> LabState:
        """The session's state, created when missing (forgetting an expiry). LabInputError when full and busy."""
        with self._lock:
            self._sweep()
            lab = self._labs.get(key)
            if lab is None:
                if len(self._labs) >= self.max_sessions:
                    victim = next((k for k, v in self._labs.items() if v.active == 0 and not v.lock.locked()), None)
                    if victim is None:
                        raise LabInputError(f"The lab is full: {len(self._labs)} sessions are busy right now. "
                                            f"Try again in a minute.")
                    self._evict(victim, f"{self.max_sessions} sessions were open and yours was the least "
                                        f"recently used")
                lab = LabState()
                self._labs[key] = lab
                self._evicted.pop(key, None)
            self._touch(key, lab)
            return lab

    def drop(self, key: str) -> None:
        """Forget a session for good (its browser tab closed)."""
        with self._lock:
            lab = self._labs.pop(key, None)
            self._evicted.pop(key, None)
        if lab is not None:
            _clear(lab)

    def forget_expiry(self, key: str) -> None:
        with self._lock:
            self._evicted.pop(key, None)

    def is_live(self, key: str, lab: LabState) -> bool:
        with self._lock:
            return self._labs.get(key) is lab

    def touch(self, key: str, lab: LabState) -> None:
        with self._lock:
            if self._labs.get(key) is lab:
                self._touch(key, lab)

    def sweep(self) -> None:
        with self._lock:
            self._sweep()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"live": len(self._labs), "max": self.max_sessions, "evictions": self.evictions,
                    "remembered_expired": len(self._evicted)}

    # -- internals (self._lock held) --
    def _touch(self, key: str, lab: LabState) -> None:
        lab.last_used = self.clock()
        self._labs.move_to_end(key)

    def _sweep(self) -> None:
        now = self.clock()
        for key, lab in list(self._labs.items()):
            if now - lab.last_used <= self.idle_seconds:
                break  # ordered by last use: the rest are fresher
            self._evict(key, f"idle for more than {self.idle_seconds / 60:g} min")

    def _evict(self, key: str, why: str) -> None:
        lab = self._labs.pop(key)
        self._evicted[key] = why
        while len(self._evicted) > self._remember:
            self._evicted.popitem(last=False)
        self.evictions += 1
        _clear(lab)


def _clear(lab: LabState) -> None:
    """Free what a dropped state holds, even if a running loop still references it."""
    lab.interrupt()
    lab.run = None
    lab.references.clear()


@torch.inference_mode()
def measure_forward_seconds(base: BaseModel, prompt_ids: list[int], repeats: int = 3) -> float:
    """Median wall time of one single-token forward over the prompt's cache (the cost of a plain step)."""
    cache = DynamicCache()
    context = len(prompt_ids)
    forward_tokens(base, cache, torch.tensor(prompt_ids), torch.arange(context), None)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward_tokens(base, cache, torch.tensor(prompt_ids[-1:]), torch.tensor([context]), None)
        if base.device.type == "cuda":
            torch.cuda.synchronize(base.device)
        times.append(time.perf_counter() - start)
        truncate(cache, context)
    return statistics.median(times)


def reference(lab: LabState, run: Run) -> Reference:
    """The plain greedy run for this prompt/precision/length, computed once per user and cached."""
    key = run.reference_key
    if key not in lab.references:
        config = DecodeConfig(strategy="autoregressive", max_new_tokens=run.settings.max_new_tokens,
                              record_texts=False)
        plain = decode(run.runtime.base, None, run.session.prompt_ids, config)
        lab.references[key] = Reference(output_ids=list(plain.output_ids),
                                        step_seconds=[r.times.total for r in plain.records])
        while len(lab.references) > MAX_REFERENCES:
            lab.references.popitem(last=False)
    return lab.references[key]


def greedy_check(lab: LabState, run: Run, compute: bool) -> GreedyCheck:
    """Compare the output so far with plain greedy decoding (running it first when `compute`)."""
    if not run.settings.greedy:
        return GreedyCheck("na", "sampling: no single right answer")
    if run.settings.strategy == "autoregressive":
        return GreedyCheck("ok", "this is plain decoding")
    if run.reference_key not in lab.references and not compute:
        return GreedyCheck("pending", "checked when the run ends")
    ref = reference(lab, run)
    ours = run.session.output_ids
    common = min(len(ours), len(ref.output_ids))
    position = next((i for i in range(common) if ours[i] != ref.output_ids[i]), None)
    if position is None:
        if len(ours) == len(ref.output_ids):
            return GreedyCheck("ok", f"identical ({len(ours)} tokens)")
        return GreedyCheck("ok", f"identical so far ({common} of {len(ref.output_ids)} tokens)")
    if position not in ref.gaps:
        divergence = explain_divergence(run.runtime.base, run.session.prompt_ids, ref.output_ids, ours)
        ref.gaps[position] = divergence.logit_gap if divergence else float("nan")
    gap = ref.gaps[position]
    return GreedyCheck("diff", f"differs at token {position} (plain top-2 logit gap {gap:.3g})", position, gap)


def ar_baseline(lab: LabState, run: Run) -> ArBaseline:
    """The plain run's measured times when it exists, else the one-token forward estimate."""
    ref = lab.references.get(run.reference_key)
    if ref is not None:
        return ArBaseline(step_seconds=ref.step_seconds)
    return ArBaseline(seconds_per_token=lab.forward_seconds.get(run.settings.precision))
