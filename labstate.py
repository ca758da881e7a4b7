"""Per-user lab state and the few services the UI calls: start, step, plain-greedy reference.

No gradio and no plotting here (app.py wires events, viz/ draws). The model and heads are
shared, loaded once per precision and never modified; everything a user changes lives in a
`LabState` that app.py keeps in `gr.State`.
"""
from __future__ import annotations

import functools
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from core.accept import RULES, AcceptConfig
from core.decoder import MAX_BUDGET, MAX_NEW_TOKENS, MAX_TOP_M, STRATEGIES, DecodeConfig, DecodeSession, StepRecord, \
    decode, start_session
from core.exactness import explain_divergence
from core.heads import MedusaHeads, default_heads
from core.kvcache import truncate
from core.model import BaseModel, ModelConfig, load_base_model
from core.sampling import SamplingConfig
from core.tree import load_named_trees
from core.verify import forward_tokens
from viz.timing_plot import ArBaseline

PRECISIONS = ("fp32", "bf16")
MAX_TEMPERATURE = 2.0
MAX_PROMPT_CHARS = 8000
STEP_LOCK_TIMEOUT_S = 120.0


class LabInputError(ValueError):
    """Bad user input (settings, prompt, or an action that does not apply now); the message is for the page."""


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or int(value) != value:
        raise LabInputError(f"{name} must be a whole number, got {value!r}")
    if not low <= int(value) <= high:
        raise LabInputError(f"{name} must be between {low} and {high}, got {int(value)}")
    return int(value)


def parse_settings(strategy: object, budget: object, top_m: object, depth: object, fixed_preset: object,
                   rule: object, temperature: object, precision: object, max_new_tokens: object,
                   compare_fixed: object) -> Settings:
    """Validated settings from raw UI/API values; LabInputError with a clear message otherwise."""
    if strategy not in STRATEGIES:
        raise LabInputError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if rule not in RULES:
        raise LabInputError(f"acceptance rule must be one of {', '.join(RULES)}, got {rule!r}")
    if precision not in PRECISIONS:
        raise LabInputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    presets = load_named_trees()
    if fixed_preset not in presets:
        raise LabInputError(f"unknown fixed tree {fixed_preset!r}; choose one of {', '.join(presets)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not 0.0 <= float(temperature) <= MAX_TEMPERATURE:
        raise LabInputError(f"temperature must be a number between 0 and {MAX_TEMPERATURE:g}, got {temperature!r}")
    if rule == "greedy" and float(temperature) > 0:
        raise LabInputError("the greedy rule needs temperature 0; pick typical or speculative acceptance to sample")
    return Settings(strategy=str(strategy), budget=_as_int("node budget", budget, 1, MAX_BUDGET),
                    top_m=_as_int("top-m", top_m, 1, MAX_TOP_M), depth=_as_int("depth", depth, 1, 16),
                    fixed_preset=str(fixed_preset), rule=str(rule), temperature=float(temperature),
                    precision=str(precision),
                    max_new_tokens=_as_int("max new tokens", max_new_tokens, 1, MAX_NEW_TOKENS),
                    compare_fixed=bool(compare_fixed))


def fixed_choice(preset: str, depth: int) -> tuple[str | tuple, str]:
    """The fixed tree for `depth` heads: the named preset, or its paths cut at `depth` (and a note saying so)."""
    paths = load_named_trees()[preset]
    if max(len(p) for p in paths) <= depth:
        return preset, ""
    kept = tuple(tuple(p) for p in paths if len(p) <= depth)
    return kept, f"fixed tree {preset} cut to depth {depth} ({len(kept)} of {len(paths)} nodes)"


def decode_config(settings: Settings, num_heads: int) -> tuple[DecodeConfig, str]:
    """The core DecodeConfig for these settings, plus a note on any adjustment made."""
    if settings.depth > num_heads:
        raise LabInputError(f"depth {settings.depth} exceeds the {num_heads} heads loaded")
    tree, note = fixed_choice(settings.fixed_preset, settings.depth)
    accept = AcceptConfig(rule=settings.rule, sampling=SamplingConfig(temperature=settings.temperature))
    config = DecodeConfig(strategy=settings.strategy, budget=settings.budget, top_m=settings.top_m,
                          depth=settings.depth, fixed_tree=tree, accept=accept,
                          max_new_tokens=settings.max_new_tokens,
                          compare_fixed=settings.compare_fixed and settings.strategy == "dynamic")
    uses_fixed = settings.strategy == "fixed" or config.compare_fixed
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
    """Everything one user (browser tab or API client) owns. Kept in gr.State, never global."""

    run: Run | None = None
    references: dict[tuple[str, str, int], Reference] = field(default_factory=dict)
    forward_seconds: dict[str, float] = field(default_factory=dict)  # precision -> one-token forward
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def start_run(lab: LabState, prompt: object, settings: Settings) -> Run:
    """Prefill `prompt` and make it the current run (the previous run is dropped)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise LabInputError("Type a prompt (or pick an MT-Bench example) first.")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise LabInputError(f"The prompt is {len(prompt)} characters; the lab accepts up to {MAX_PROMPT_CHARS}.")
    rt = runtime(settings.precision)
    config, note = decode_config(settings, rt.num_heads)
    if not _acquire(lab):
        raise LabInputError("Still busy with the previous step; try again in a moment.")
    try:
        session = start_session(rt.base, rt.heads, prompt, config)
        if settings.precision not in lab.forward_seconds:
            lab.forward_seconds[settings.precision] = measure_forward_seconds(rt.base, session.prompt_ids)
    except ValueError as error:  # core's own checks (prompt too long for the context, tree too deep)
        raise LabInputError(str(error)) from error
    finally:
        lab.lock.release()
    lab.run = Run(prompt=prompt, settings=settings, runtime=rt, session=session, note=note)
    return lab.run


def _acquire(lab: LabState) -> bool:
    return lab.lock.acquire(timeout=STEP_LOCK_TIMEOUT_S)


def step_run(lab: LabState, run: Run) -> StepRecord:
    """One decoding step of `run` (serialised per user: a session is not thread-safe)."""
    if run.session.finished:
        raise LabInputError(f"Decoding has finished ({run.session.stop_reason}). Press Start for a new run.")
    if not _acquire(lab):
        raise LabInputError("Still busy with the previous step; try again in a moment.")
    try:
        return run.session.step()
    finally:
        lab.lock.release()


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
        plain = decode(run.runtime.base, None, run.prompt, config)
        lab.references[key] = Reference(output_ids=list(plain.output_ids),
                                        step_seconds=[r.times.total for r in plain.records])
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
