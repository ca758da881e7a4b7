"""Verify-cost profile and the adaptive node budget (`dynamic:auto`).

On a GPU a tree of a few hundred nodes costs about what one token costs; on a 2-core CPU a
64-node verify costs several plain steps (gguf-q8 on a Zen 5 with AVX512-VNNI: 4 rows 1.5x, 16 rows
3x, 64 rows 8.6x). The best tree size therefore
depends on the hardware, and on the context: attention over 1,500 cached tokens costs more than
over 100. The profile measures the verify latency of n tokens over 100, 500 and 1,500 cached
tokens (interpolated in both) on the current device. It is cached under a key of the model,
thread count, CPU model and flags, torch and transformers versions and the verify code
(`ProfileKey`), and only when one-token costs measured before and after it agree (a busy
machine's profile serves its run but is never kept); each run still corrects it with its own
measurements (`core.budget.controller`). Each step then keeps the
prefix of the best-first node order that maximises expected tokens per second:

    n* = argmax_n  (1 + sum_{i<n} c[depth_i] * score_i) / (cost(n + 1, context) + overhead)

where score_i is node i's joint head probability (its chance to be accepted if the heads are
calibrated) and c[d] corrects it per depth from the acceptance observed so far. The decoder
skips the heads for the next 16 steps when the best tree is expected to be more than 20 % slower
than plain decoding, or when the tokens per ms that the last 24 tree steps actually delivered
fell more than 10 % below plain steps' (acceptance comes in streaks: shorter records back off
on noise); when the best prefix is the root alone, the next 1, 2, 4 ... 16 steps are plain
(reset once a tree pays again). Speculation that cannot pay (random text, scripts the heads
never saw) then costs almost nothing.
"""
from __future__ import annotations

import functools
import hashlib
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch
import transformers

from core.model import CACHE_DIR, BaseModel
from core.kvcache import KVCache, truncate
from core.machine import cpu_fingerprint, measured_quietly, median_ms
from core.tree import CandidateTree, chain_tree
from core.verify import forward_tokens, verify_tree

PROFILE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PROFILE_CONTEXTS = (100, 500, 1500)  # context lengths (cached tokens) the cost is measured at


@dataclass(frozen=True)
class CostProfile:
    """Median verify latency (ms) of `sizes[i]` tokens over a context of `contexts[0]` tokens
    (`ms`), and over each longer context in `contexts[1:]` (`ms_by_context`, one row each)."""

    sizes: list[int]
    ms: list[float]
    device: str = ""
    model: str = ""
    contexts: list[int] = field(default_factory=lambda: [PROFILE_CONTEXTS[0]])
    ms_by_context: list[list[float]] = field(default_factory=list)

    def cost(self, tokens: int, context: int | None = None) -> float:
        """Interpolated latency of a verify over `tokens` tokens (root included) on top of a
        `context`-token cache (default: the first profiled context); linear in both."""
        first = _interpolate(self.sizes, self.ms, tokens)
        if context is None or not self.ms_by_context or context <= self.contexts[0]:
            return first
        costs = [first] + [_interpolate(self.sizes, row, tokens) for row in self.ms_by_context]
        return max(first, _interpolate(self.contexts, costs, context))

    def costs(self, count: int, context: int | None = None) -> list[float]:
        """`[cost(1, context), ..., cost(count, context)]`, the same numbers, each profiled row walked
        once for all sizes (a step's choice prices every prefix of its tree: ~10 cost calls a step,
        each walking four rows)."""
        tokens = range(1, count + 1)
        first = _interpolate_sorted(self.sizes, self.ms, tokens)
        if context is None or not self.ms_by_context or context <= self.contexts[0]:
            return first
        rows = [_interpolate_sorted(self.sizes, row, tokens) for row in self.ms_by_context]
        return [max(at_first, _interpolate(self.contexts, [at_first, *at_rows], context))
                for at_first, *at_rows in zip(first, *rows)]


def _interpolate_sorted(xs: list[int], ys: list[float], points: Sequence[float]) -> list[float]:
    """Piecewise-linear y(x) through the points (xs, ys), extended by the last segment's slope, at
    each of `points` (ascending): the segments walked once for all of them."""
    values, segment = [], 0
    for x in points:
        if x <= xs[0] or len(xs) == 1:
            values.append(ys[0])
            continue
        while segment < len(xs) - 2 and x > xs[segment + 1]:
            segment += 1
        x0, x1, y0, y1 = xs[segment], xs[segment + 1], ys[segment], ys[segment + 1]
        if x <= x1:
            values.append(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
        else:  # past the last point: the last segment's slope
            values.append(ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1]))
    return values


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """`_interpolate_sorted` at one point."""
    return _interpolate_sorted(xs, ys, (x,))[0]


@dataclass(frozen=True)
class ProfileKey:
    """Everything a measured verify cost depends on; a profile is reused only where all match."""

    model: str
    threads: int
    cpu: str  # model name and instruction-set flags
    versions: str  # torch and transformers
    code: str  # hash of the code that runs a verify (model preparation, verify, KV cache)

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _verify_code_hash() -> str:
    """Hash of the modules whose change changes a verify's cost."""
    core = Path(__file__).resolve().parent.parent
    digest = hashlib.sha1()
    for path in ("model.py", "engine/lean.py", "engine/exact.py", "engine/kernels/exact.cpp", "verify.py",
                 "kvcache.py", "budget/cost_profile.py"):
        digest.update((core / path).read_bytes())
    return digest.hexdigest()[:12]


def profile_key(base: BaseModel) -> ProfileKey:
    """The key of `base`'s profile on this machine, with this software."""
    return ProfileKey(model=f"{base.source}|{base.engine_name}|ctx{PROFILE_CONTEXTS}|sizes{PROFILE_SIZES}",
                      threads=torch.get_num_threads(), cpu=cpu_fingerprint() if base.device.type == "cpu"
                      else f"{base.device}|{torch.cuda.get_device_name(base.device) if base.device.type == 'cuda' else ''}",
                      versions=f"torch {torch.__version__}|transformers {transformers.__version__}",
                      code=_verify_code_hash())


# A prior until the machine's own profile is measured: a verify of n rows against a plain step, on the
# cheap side of what CPUs measure (a 2-core Zen 5 with AVX512-VNNI: 16 rows 3x, 64 rows 8.6x) so that
# trees are tried; the controller scales it by the steps' own measured times within a few steps
# (core.budget.controller).
PROVISIONAL_RATIOS = {1: 1.0, 16: 1.6, 64: 3.0, 256: 10.0}


def provisional_profile(plain_ms: float, device: str = "cpu", model: str = "") -> CostProfile:
    """A rough profile from one measured plain step (`plain_ms`): what a run starts on while the real
    profile is measured off the request path."""
    return CostProfile(sizes=list(PROVISIONAL_RATIOS), ms=[plain_ms * r for r in PROVISIONAL_RATIOS.values()],
                       device=device, model=f"{model} (provisional)")


T = TypeVar("T")


def _direct(work: Callable[[], T]) -> T:
    return work()


def _no_grad(work: Callable[[], T]) -> Callable[[], T]:
    """`work` under inference mode wherever it runs (inference mode is per thread)."""
    def piece() -> T:
        with torch.inference_mode():
            return work()
    return piece


@torch.inference_mode()
def measure_profile(base: BaseModel, sizes: tuple[int, ...] = PROFILE_SIZES,
                    contexts: tuple[int, ...] = PROFILE_CONTEXTS, repeats: int = 3,
                    run: Callable[[Callable[[], T]], T] = _direct) -> CostProfile:
    """Time one verify of n nodes (a chain tree; cost depends on n, not on the shape) on top of
    caches of each context length (one prefill per context; each verify is cropped off again).
    `run` executes each piece (a prefill, one size's timing): the page passes the tensor thread's
    runner, so a user's Start waits for one piece at most, never the whole profile."""
    contexts = tuple(c for c in contexts if c + max(sizes) < base.max_positions) or contexts[:1]
    rows = [_measure_row(base, sizes, context, repeats, run) for context in contexts]
    for low, high in zip(rows, rows[1:]):  # a longer context cannot be cheaper: smooth noise
        high[:] = [max(a, b) for a, b in zip(low, high)]
    return CostProfile(sizes=list(sizes), ms=rows[0], device=str(base.device), model=base.source,
                       contexts=list(contexts), ms_by_context=rows[1:])


def _measure_row(base: BaseModel, sizes: tuple[int, ...], context: int, repeats: int,
                 run: Callable[[Callable[[], T]], T] = _direct) -> list[float]:
    cache = _prefilled_cache(base, context, max(sizes), run)
    medians = []
    for size in sizes:
        def timed(size: int = size) -> float:
            verify = _chain_verify(base, cache, size)
            return median_ms(verify, repeats, base.device, setup=lambda: truncate(cache, context))
        medians.append(run(_no_grad(timed)))
    # latency cannot fall with more tokens: smooth measurement noise
    for i in range(len(medians) - 2, -1, -1):
        medians[i] = min(medians[i], medians[i + 1])
    return medians


def _prefilled_cache(base: BaseModel, context: int, room: int,
                     run: Callable[[Callable[[], T]], T] = _direct) -> KVCache:
    """A cache holding `context` made-up prompt tokens, with room for `room` more. Made by `run` too:
    zeroing a cache this size is a parallel operator, and one on another thread than the decoding's
    gives the process a second OpenMP team, after which every later operator pays a wake-up
    (core.tensor_thread: a plain step 4.7 -> 9.7 ms in gguf-q8 on a 2-core EPYC)."""
    def prefilled() -> KVCache:
        prompt = torch.arange(1000, 1000 + context) % base.model.config.vocab_size  # [context]
        cache = base.new_cache(context + room)
        forward_tokens(base, cache, prompt, torch.arange(context))
        return cache
    return run(_no_grad(prefilled))


def _chain_verify(base: BaseModel, cache: KVCache, size: int) -> Callable[[], None]:
    """One verify of a chain tree of `size` nodes on top of `cache` (the caller crops it off again)."""
    tree = chain_tree(size - 1) if size > 1 else CandidateTree(paths=[])
    buffers = tree.buffers()
    tokens = torch.arange(2000, 2000 + size) % base.model.config.vocab_size  # [size]

    def verify() -> None:
        verified = verify_tree(base, cache, tokens, buffers.attn_mask, buffers.position_ids)
        verified.logits(list(range(0, size, 3)))  # acceptance projects about a third of the nodes
    return verify


WARM_SIZES = tuple(size for size in PROFILE_SIZES if 1 < size <= 64)  # the trees a page verifies


def warm_verifies(base: BaseModel, sizes: tuple[int, ...] = WARM_SIZES,
                  run: Callable[[Callable[[], T]], T] = _direct) -> None:
    """One untimed verify of each size over a short context. Why: a process whose profile was read from
    disk never ran a tree verify, and the first of a size pays more (a 64-row verify in gguf-q8 166 ms
    against 129-138 after it, 2-core EPYC), in a user's tree step."""
    context = PROFILE_CONTEXTS[0]
    cache = _prefilled_cache(base, context, max(sizes), run)
    for size in sizes:
        def verify_and_crop(size: int = size) -> None:
            _chain_verify(base, cache, size)()
            truncate(cache, context)
        run(_no_grad(verify_and_crop))


_MEASURING = threading.Lock()


PROFILE_DIR = CACHE_DIR / "profiles"


def _profile_path(base: BaseModel, cache_dir: Path) -> Path:
    return cache_dir / f"{profile_key(base).digest()}.json"


def profile_cached(base: BaseModel, cache_dir: Path = PROFILE_DIR) -> bool:
    """Whether `verify_profile` will read a profile measured earlier (no measuring to announce)."""
    return _profile_path(base, cache_dir).exists()


@functools.lru_cache(maxsize=8)
def verify_profile(base: BaseModel, cache_dir: Path = PROFILE_DIR,
                   run: Callable[[Callable[[], T]], T] = _direct) -> CostProfile:
    """The cached profile for this device/model/precision/threads, measured on first use (`run`:
    where each piece of the measurement runs, as in `measure_profile`)."""
    with _MEASURING:  # two sessions starting at once measure once
        return _load_or_measure(base, cache_dir, run)


def _load_or_measure(base: BaseModel, cache_dir: Path,
                     run: Callable[[Callable[[], T]], T] = _direct) -> CostProfile:
    path = _profile_path(base, cache_dir)
    if path.exists():
        return CostProfile(**json.loads(path.read_text()))
    before = _measure_row(base, (1,), PROFILE_CONTEXTS[0], 5, run)[0]
    profile = measure_profile(base, run=run)
    after = _measure_row(base, (1,), PROFILE_CONTEXTS[0], 5, run)[0]
    if not measured_quietly(before, after, profile.ms[0]):
        return profile  # the machine was busy: use it for this run (the run corrects it), never cache it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(profile)))
    except OSError:
        pass  # read-only checkout: measure again next start
    return profile


CALIBRATION_DECAY = 0.95


@dataclass
class DepthCalibration:
    """Observed / predicted acceptance per depth, learned online (starts at 1: trust the heads)."""

    predicted: list[float] = field(default_factory=lambda: [2.0] * 16)
    observed: list[float] = field(default_factory=lambda: [2.0] * 16)

    def factor(self, depth: int) -> float:
        return self.observed[depth - 1] / self.predicted[depth - 1]

    def update(self, depths: list[int], scores: list[float], accepted_depth: int) -> None:
        """depths/scores of the tree's non-root nodes; accepted_depth = accepted head tokens.

        Older evidence fades (CALIBRATION_DECAY per update of a depth, a memory of about 20
        steps): heads that were wrong at the start of an answer and right later (a list, a code
        block) are trusted again once they are right, instead of being discounted for good."""
        per_depth: dict[int, float] = {}
        for depth, score in zip(depths, scores):
            per_depth[depth] = per_depth.get(depth, 0.0) + score
        for depth, predicted in per_depth.items():
            self.predicted[depth - 1] *= CALIBRATION_DECAY
            self.observed[depth - 1] *= CALIBRATION_DECAY
            self.predicted[depth - 1] += min(predicted, 1.0)
            self.observed[depth - 1] += 1.0 if accepted_depth >= depth else 0.0


def best_prefix(scores: list[float], depths: list[int], profile: CostProfile, overhead_ms: float,
                calibration: DepthCalibration | None = None, context: int | None = None,
                tree_overhead_ms: float = 0.0) -> tuple[int, float]:
    """(n, expected tokens per ms) of the best prefix length n (0 = root only). Pure function.

    scores/depths: the best-first node order of a dynamic tree (any prefix is a valid tree).
    `overhead_ms` is paid by every choice, `tree_overhead_ms` only by a tree of one node or more
    (accepting and committing a tree costs more than a plain step's token).
    """
    expected = 1.0  # the bonus token always comes
    costs = profile.costs(len(scores) + 1, context)  # [n + 1]: the root and n nodes
    best_n, best_rate = 0, expected / (costs[0] + overhead_ms)
    tree_ms = overhead_ms + tree_overhead_ms
    for n, (score, depth) in enumerate(zip(scores, depths), start=1):
        expected += score * (calibration.factor(depth) if calibration else 1.0)
        rate = expected / (costs[n] + tree_ms)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n, best_rate


def plain_rate(profile: CostProfile, overhead_ms: float, context: int | None = None) -> float:
    """Tokens per ms of plain decoding: one token per single-token forward, no heads."""
    return 1.0 / (profile.cost(1, context) + overhead_ms)
