"""Which precision a first run uses on this machine, decided by measurement and cached
(`precision_choice`): with the exact kernels, the mode whose plain step plus small tree costs least
(every mode is exact there); without them, fp32 unless bf16 measures clearly faster. Also whether torch's
bf16 is the fast choice for many-row work (drafters' layers, feature extraction, training).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from core import settings
from core.machine import cpu_fingerprint, measured_quietly, median_ms
from core.paths import gguf_location
from core.paths import CACHE_DIR

log = logging.getLogger(__name__)


# bf16 becomes the default only when it measures at least this much faster than fp32 (fp32 is exact)
BF16_MIN_SPEEDUP = 1.3


@dataclass(frozen=True)
class PrecisionChoice:
    """Which precision a first run uses here, and the measurement that decided it."""

    dtype: str  # "fp32", "bf16", "gguf" or "gguf-q8"
    fp32_ms: float  # one-row products over the shipped model's layer shapes (a plain step's), median
    bf16_ms: float
    device: str
    fp32_tree_ms: float = 0.0  # the same products on 8 rows (a small tree verify's)
    bf16_tree_ms: float = 0.0
    # measured through the exact kernels (every precision exact): the fastest wins; gguf: Q4_1 blocks
    exact: bool = False
    gguf_ms: float = 0.0
    gguf_tree_ms: float = 0.0
    gguf_q8_ms: float = 0.0  # the same blocks times 8-bit activations
    gguf_q8_tree_ms: float = 0.0
    # torch's own 8-row products (what drafters' layers, feature extraction and training run on), beside
    # the kernels' where those decided: on an AVX2 EPYC the kernels' bf16 ran 1.8x fp32's speed, torch's 0.51x
    torch_fp32_tree_ms: float = 0.0
    torch_bf16_tree_ms: float = 0.0

    @property
    def speedup(self) -> float:
        return self.fp32_ms / self.bf16_ms if self.bf16_ms else 0.0

    @property
    def tree_speedup(self) -> float:
        return self.fp32_tree_ms / self.bf16_tree_ms if self.bf16_tree_ms else 0.0

    @property
    def torch_tree_speedup(self) -> float:
        """bf16 over fp32 on 8 rows in torch's own products (the kernels' measurement is not theirs)."""
        if self.exact:
            return self.torch_fp32_tree_ms / self.torch_bf16_tree_ms if self.torch_bf16_tree_ms else 0.0
        return self.tree_speedup

    def describe(self) -> str:
        """One line for the page and the benchmark output."""
        if self.device == "cuda":
            return f"{self.dtype} (a GPU{'' if self.dtype == 'bf16' else ' without native bf16'}; exact kernels in every precision)"
        if self.exact:
            return (f"{self.dtype}: every precision is exact here; the exact kernels measured a plain step's / an "
                    f"8-node tree's products at {self.gguf_ms:.1f} / {self.gguf_tree_ms:.1f} ms from the GGUF's "
                    f"4-bit blocks ({self.gguf_q8_ms:.1f} / {self.gguf_q8_tree_ms:.1f} with 8-bit activations), "
                    f"{self.bf16_ms:.1f} / {self.bf16_tree_ms:.1f} in bf16, "
                    f"{self.fp32_ms:.1f} / {self.fp32_tree_ms:.1f} in fp32")
        verdict = ("so bf16" if self.dtype == "bf16" else
                   f"so fp32 (exact; bf16 needs >= {BF16_MIN_SPEEDUP}x on both)")
        return (f"{self.dtype}: on this CPU bf16 measured {self.speedup:.2f}x fp32 on a plain step's products "
                f"and {self.tree_speedup:.2f}x on an 8-node tree's, {verdict}")


# one layer's projections of the shipped model (q/k/v, output, gate/up, down): [out, in]
PLAIN_STEP_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _time_products(dtype: torch.dtype, rows: int = 1, layers: int = 12, repeats: int = 5) -> float:
    """Median ms of `rows` rows through `layers` layers of the shipped model's projection shapes
    (random weights, more than a CPU cache holds, so they stream from memory as in a real step)."""
    shapes = PLAIN_STEP_SHAPES
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator).to(dtype) for _ in range(layers) for shape in shapes]
    inputs = {width: torch.randn(rows, width).to(dtype) for width in (576, 1536)}
    with torch.inference_mode():
        return median_ms(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights], repeats)


def _decided(measured: PrecisionChoice) -> str:
    """With the exact kernels: the precision whose plain step plus small tree costs least (gguf only
    where the shipped GGUF is installed). Otherwise bf16 only when a plain step's products and an
    8-node tree's both run >= BF16_MIN_SPEEDUP x faster (fp32 is the exact one there)."""
    if measured.exact:
        costs = {"fp32": measured.fp32_ms + measured.fp32_tree_ms, "bf16": measured.bf16_ms + measured.bf16_tree_ms}
        if gguf_location() is not None:  # the gguf modes read the shipped GGUF's blocks
            gguf_costs = {"gguf": (measured.gguf_ms, measured.gguf_tree_ms),
                          "gguf-q8": (measured.gguf_q8_ms, measured.gguf_q8_tree_ms)}
            costs.update({mode: one + eight for mode, (one, eight) in gguf_costs.items() if one})
        return min(costs, key=costs.get)
    fast = measured.speedup >= BF16_MIN_SPEEDUP and measured.tree_speedup >= BF16_MIN_SPEEDUP
    return "bf16" if fast else "fp32"


@functools.lru_cache(maxsize=1)
def precision_choice(cache_dir: Path | None = None) -> PrecisionChoice:
    """The default precision, decided by measurement (not by a CPU flag) and cached on disk per CPU
    and torch version: bf16 on a GPU; on a CPU bf16 only if a plain step's products run >=
    BF16_MIN_SPEEDUP x faster and a small tree's no slower (a lab of trees must not get slower
    trees: on an AVX2 CPU a bf16 plain step measured 1.36x faster, an 8-node verify 2.4x slower).
    Trees must be clearly faster too: on that CPU the 8-row products measured 0.79x and then 1.19x in
    two sessions, and a default that flips between runs breaks a class's plan (and greedy equality)."""
    if torch.cuda.is_available():  # bf16 where the GPU computes it natively; every mode is exact there too
        return PrecisionChoice(dtype="bf16" if torch.cuda.is_bf16_supported() else "fp32", fp32_ms=0.0, bf16_ms=0.0,
                               device="cuda", exact=True)
    folder = cache_dir or CACHE_DIR / "precision"
    kernels = _exact_kernels()
    kind = "plain+tree"
    if kernels is not None:  # a kernel change changes what each precision costs
        from core.engine.build import build_key
        kind = f"exact-modes+torch|{build_key()}"
    key = hashlib.sha256(f"{kind}|{cpu_fingerprint()}|{torch.__version__}|{torch.get_num_threads()}".encode()
                         ).hexdigest()[:16]
    path = folder / f"{key}.json"
    if path.exists():
        try:
            stored = PrecisionChoice(**json.loads(path.read_text()))
            return dataclasses.replace(stored, dtype=_decided(stored))  # the measurement kept, today's rule applied
        except (TypeError, ValueError):
            log.warning("ignoring an unreadable precision measurement in %s", path)
    measured = _measure_exact_modes(kernels) if kernels is not None else _measure_torch_precisions()
    choice = dataclasses.replace(measured, dtype=_decided(measured))
    again = _exact_fp32_ms(kernels) if kernels is not None else _time_products(torch.float32)
    if not measured_quietly(measured.fp32_ms, again):
        # a busy machine (a generator beside it once timed bf16 at 14x fp32 on a Xeon where it is 1.1x):
        # decide for this process only, measure again next time
        log.warning("the machine was busy while measuring precision; not caching %s", choice.describe())
        return choice
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(choice)))
    except OSError as error:
        log.warning("could not cache the precision measurement in %s: %s", folder, error)
    return choice


def _exact_kernels():
    """The exact kernels where they build here (None elsewhere or with engine `hf`/`lean` forced)."""
    if torch.cuda.is_available() or settings.SETTINGS.engine not in ("auto", "exact"):
        return None
    from core.engine.build import load_kernels
    return load_kernels(CACHE_DIR)


def _measure_torch_precisions() -> PrecisionChoice:
    fp32_ms, bf16_ms = _time_products(torch.float32), _time_products(torch.bfloat16)
    fp32_tree_ms, bf16_tree_ms = _time_products(torch.float32, rows=8), _time_products(torch.bfloat16, rows=8)
    return PrecisionChoice(dtype="fp32", fp32_ms=round(fp32_ms, 2), bf16_ms=round(bf16_ms, 2), device="cpu",
                           fp32_tree_ms=round(fp32_tree_ms, 2), bf16_tree_ms=round(bf16_tree_ms, 2))


def _measure_exact_modes(kernels) -> PrecisionChoice:
    """The shipped model's layer shapes through the exact kernels in each precision, 1 and 8 rows."""
    from core.engine.exact import time_modes
    ms = time_modes(kernels, PLAIN_STEP_SHAPES)
    return PrecisionChoice(dtype="fp32", device="cpu", exact=True,
                           torch_fp32_tree_ms=round(_time_products(torch.float32, rows=8), 2),
                           torch_bf16_tree_ms=round(_time_products(torch.bfloat16, rows=8), 2),
                           fp32_ms=round(ms["fp32"][1], 2), fp32_tree_ms=round(ms["fp32"][8], 2),
                           bf16_ms=round(ms["bf16"][1], 2), bf16_tree_ms=round(ms["bf16"][8], 2),
                           gguf_ms=round(ms["gguf"][1], 2), gguf_tree_ms=round(ms["gguf"][8], 2),
                           gguf_q8_ms=round(ms["gguf-q8"][1], 2), gguf_q8_tree_ms=round(ms["gguf-q8"][8], 2))


def fast_bf16() -> bool:
    """Whether bf16 is the fast precision here (by measurement: `precision_choice`). Where it is not,
    bf16 on a CPU without bf16 instructions runs several times slower than fp32."""
    return precision_choice().dtype == "bf16"


def fast_bf16_batched() -> bool:
    """Whether torch's bf16 runs many-row products clearly faster here (drafters' layers, batched
    feature extraction and training): its measured 8-row products >= BF16_MIN_SPEEDUP x fp32's (torch's
    own, also where the exact kernels decided the lab's precision). It can hold where `fast_bf16` does
    not: on a Xeon with AMX a plain step's products measured 0.92x fp32 (memory bound), an 8-row
    tree's 1.90x, and a batch of 16 answers' features 1.55x."""
    choice = precision_choice()
    return choice.device == "cuda" or choice.torch_tree_speedup >= BF16_MIN_SPEEDUP


def default_precision() -> str:
    """The precision a first run should use on this machine: fp32 (exact) unless bf16 measures clearly faster."""
    return precision_choice().dtype


def _exact_fp32_ms(kernels) -> float:
    """The fp32 plain-step products of `_measure_exact_modes` again (the busy-machine check)."""
    from core.engine.exact import time_modes
    return time_modes(kernels, PLAIN_STEP_SHAPES, rows=(1,), modes=("fp32",))["fp32"][1]
