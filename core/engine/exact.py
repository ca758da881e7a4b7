"""The exact engine: the lean forward's maths through row-invariant C++ kernels.

Every row of an n-row forward (a tree verify, a chain, a prefill) is computed by the same
instructions in the same order as a one-token step at that position (kernels/exact.cpp), so a
tree row's hidden state and logits equal the plain step's bit for bit, and greedy speculative
decoding emits plain greedy decoding's tokens by construction, not by a safe distance from ties.

Modes (the weights the products read; activations, cache and accumulation are fp32 in all):
- `fp32`: the model's fp32 weights;
- `bf16`: the model's bf16 weights (each exact in fp32);
- `gguf`: the GGUF's own Q4_1 / Q8_0 blocks, dequantised in the kernel exactly as gguf does (the
  values the fp32 model was loaded with), so a gguf forward equals the fp32 one bit for bit while
  reading 5.6x fewer weight bytes.
- `gguf-q8`: the same blocks multiplied by 8-bit activations, llama.cpp's arithmetic: each product's
  input row is rounded to 8 bits per block of 32 (on its own, so rows stay independent) and the
  blocks' dot products are exact integers. Not the fp32 model's numbers (about 0.5 % off per
  product, as llama.cpp's), but every row is still bitwise its plain step in this mode, so greedy
  speculative output equals plain greedy output in gguf-q8 too; where integer dots are cheaper
  than widening every weight to fp32 (a one-token step on a CPU without AVX512) it is the fastest.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from core.engine.lean import TREE_ROWS_MARGIN, LeanLlama, OnLeanForward, StaticCache

log = logging.getLogger(__name__)

GGUF_Q8 = "gguf-q8"  # the GGUF's blocks times 8-bit inputs (llama.cpp's arithmetic)
MODES = ("fp32", "bf16", "gguf", GGUF_Q8)
GGUF_MODES = ("gguf", GGUF_Q8)  # the modes that read the GGUF's blocks
F32, BF16, Q8_0, Q4_1 = 0, 1, 2, 3  # weight formats of kernels/exact.cpp
GGUF_FORMATS = {"Q8_0": Q8_0, "Q4_1": Q4_1}
LANES = 16  # the kernels' vector width: every product width must be a multiple
QBLOCK = 32  # numbers per quantised block (Q8_0, Q4_1)


def exact_unsupported_reason(lean: LeanLlama) -> str | None:
    """Why the exact kernels cannot run this model (None if they can): widths must fill whole
    16-float vectors, and the grouped heads must divide evenly."""
    intermediate = lean.layers[0].down.weight.shape[1]
    widths = {"hidden size": lean.hidden_size, "head dim": lean.head_dim, "intermediate size": intermediate}
    for name, width in widths.items():
        if width % LANES:
            return f"{name} {width} is not a multiple of {LANES}"
    if lean.head_dim > 512 or lean.num_heads % lean.kv_heads:
        return "head layout"
    if lean.device.type != "cpu":
        return "the kernels run on a CPU"
    return None


@dataclass(frozen=True)
class GgufBlocks:
    """The GGUF's raw weight rows, by tensor name: (format, bytes [rows, row_bytes] uint8)."""

    tensors: dict[str, tuple[int, np.ndarray]]

    @classmethod
    def read(cls, path: Path) -> "GgufBlocks":
        import gguf
        reader = gguf.GGUFReader(path)
        return cls({t.name: (GGUF_FORMATS[t.tensor_type.name], np.asarray(t.data))
                    for t in reader.tensors if t.tensor_type.name in GGUF_FORMATS})

    def rows_for(self, name: str, weight: torch.Tensor) -> tuple[int, np.ndarray] | None:
        """The raw rows of `name` in the order of `weight` [out, in] (transformers permutes some
        rows on load), or None unless every row dequantises bit for bit to `weight`'s row."""
        if name not in self.tensors:
            return None
        fmt, raw = self.tensors[name]
        import gguf
        qtype = {Q8_0: gguf.GGMLQuantizationType.Q8_0, Q4_1: gguf.GGMLQuantizationType.Q4_1}[fmt]
        values = np.ascontiguousarray(gguf.dequantize(raw, qtype), dtype=np.float32)  # [out, in]
        target = weight.detach().float().contiguous().numpy()
        if values.shape != target.shape:
            return None
        where = {values[i].tobytes(): i for i in range(values.shape[0])}
        order = [where.get(target[i].tobytes()) for i in range(target.shape[0])]
        if any(i is None for i in order):
            return None
        return fmt, np.ascontiguousarray(raw[order])


class KernelProduct:
    """`x @ weight.T` through the exact kernels for one kernel weight (any leading shape, returned in
    x's precision)."""

    def __init__(self, kernels: ModuleType, weight: object) -> None:
        self.kernels, self.weight = kernels, weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.matmul(x.reshape(-1, x.shape[-1]), self.weight)  # [rows, out]
        return out.reshape(*x.shape[:-1], self.weight.out).to(x.dtype)


class ExactSlots:
    """Batched generation's cache on the exact engine: keys/values [slots, layers, 1, kv_heads, capacity, d]
    (`ExactLlama.kv_dtype`), one sequence a slot at its own length (`lengths`); the lean `SlotCache`'s interface."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, slots: int, capacity: int,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (slots, layers, 1, kv_heads, capacity, head_dim)
        with torch.inference_mode():
            self.keys = torch.zeros(shape, dtype=dtype)  # [B, L, 1, kvh, cap, d]
            self.values = torch.zeros(shape, dtype=dtype)
        self.lengths = [0] * slots

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[4])

    def slot(self, index: int) -> "ExactSlotView":
        """One slot as the one-sequence cache the exact forward writes (for its prefill)."""
        return ExactSlotView(self, index)


class ExactSlotView:
    """Slot `index` of an `ExactSlots`: keys/values [L, 1, kvh, cap, d] (a contiguous view) at its length."""

    def __init__(self, slots: ExactSlots, index: int) -> None:
        self.slots, self.index = slots, index
        self.keys, self.values = slots.keys[index], slots.values[index]

    def get_seq_length(self) -> int:
        return self.slots.lengths[self.index]

    def reserve(self, rows: int) -> None:
        if self.get_seq_length() + rows > self.slots.capacity:
            raise ValueError(f"a slot holds {self.slots.capacity} positions")

    def advance(self, rows: int) -> None:
        self.slots.lengths[self.index] += rows


class ExactLlama(OnLeanForward):
    """The exact forward of a model the lean forward covers; the same interface as `LeanLlama`
    (`forward`, `project`, `new_cache`, batched generation's slots), plus `mode`."""

    def __init__(self, lean: LeanLlama, kernels: ModuleType, mode: str, gguf_path: Path | None = None, *,
                 blocks: GgufBlocks | None = None, kv_dtype: torch.dtype | None = None) -> None:
        """`gguf_path` (or its `blocks`, already read) is required in the gguf modes. `kv_dtype`: the
        cache's keys and values, by default fp16 in the gguf modes (llama.cpp's default cache type: half
        the bytes a long context's attention reads) and fp32 otherwise. Every path (plain step, tree
        rows, prefill, slots) stores and reads the same numbers, so a tree row stays bitwise the plain step."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        reason = exact_unsupported_reason(lean)
        if reason:
            raise ValueError(f"the exact kernels do not cover this model: {reason}")
        self.lean, self.kernels, self.mode = lean, kernels, mode
        self.kv_dtype = kv_dtype or (torch.float16 if mode in GGUF_MODES else torch.float32)
        if self.kv_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"the cache holds fp16 or fp32 keys and values, not {self.kv_dtype}")
        self.dtype, self.device = lean.dtype, lean.device
        self.max_positions, self.hidden_size = lean.max_positions, lean.hidden_size
        if mode in GGUF_MODES and blocks is None:
            if gguf_path is None:
                raise ValueError(f"mode {mode} reads a GGUF's blocks: give its path")
            blocks = GgufBlocks.read(gguf_path)
        blocks = blocks if mode in GGUF_MODES else None
        self.int8_activations = mode == GGUF_Q8
        self.weight_bytes = 0
        self.quantized_fallbacks: list[str] = []  # gguf mode: weights read as fp32 (their blocks did not match)
        self.raw_rows: dict[str, tuple[int, np.ndarray]] = {}  # gguf mode: a one-part weight's blocks, model row order
        self.model = self._build(blocks)

    # -- construction ---------------------------------------------------------------------------
    def _weight(self, weight: torch.Tensor, bias: torch.Tensor | None, gguf_parts: list[str],
                blocks: "GgufBlocks | None") -> object:
        """A kernel weight [out, in] in this mode's format; in gguf mode the fused parts' raw rows
        (all of one format), else the fp32 values (the same numbers)."""
        out, width = weight.shape
        if blocks is not None:
            parts, start = [], 0
            for name in gguf_parts:
                rows = self._part_rows(name, gguf_parts, weight)
                parts.append(blocks.rows_for(name, weight[start:start + rows]) if rows else None)
                start += rows
            if parts and all(p is not None for p in parts) and len({p[0] for p in parts}) == 1:
                if len(parts) == 1:
                    self.raw_rows[gguf_parts[0]] = parts[0]
                raw = torch.from_numpy(np.concatenate([p[1] for p in parts]))  # [out, row_bytes]
                self.weight_bytes += raw.numel()
                return self.kernels.Weight(parts[0][0], raw, out, width, bias,
                                           int8_activations=self.int8_activations)
            self.quantized_fallbacks.append("+".join(gguf_parts))
        data = weight.detach().float() if weight.dtype not in (torch.float32, torch.bfloat16) else weight.detach()
        data = data.contiguous()
        self.weight_bytes += data.numel() * data.element_size()
        return self.kernels.Weight(BF16 if data.dtype == torch.bfloat16 else F32, data, out, width, bias)

    def _part_rows(self, name: str, names: list[str], fused: torch.Tensor) -> int:
        """Rows of one part of a fused weight: q/k/v by head counts, gate/up halves, else all."""
        lean = self.lean
        kind = name.rsplit(".", 2)[-2]
        if kind == "attn_q":
            return lean.num_heads * lean.head_dim
        if kind in ("attn_k", "attn_v"):
            return lean.kv_heads * lean.head_dim
        if kind in ("ffn_gate", "ffn_up"):
            return fused.shape[0] // 2
        return fused.shape[0] if len(names) == 1 else 0

    def _build(self, blocks: "GgufBlocks | None") -> object:
        lean, k = self.lean, self.kernels
        layers = []
        for i, layer in enumerate(lean.layers):
            block = f"blk.{i}."
            layers.append(k.Layer(
                attn_norm=layer.attn_norm.float().contiguous(), mlp_norm=layer.mlp_norm.float().contiguous(),
                qkv=self._weight(layer.qkv.weight, layer.qkv.bias,
                                 [block + p + ".weight" for p in ("attn_q", "attn_k", "attn_v")], blocks),
                out=self._weight(layer.out.weight, None, [block + "attn_output.weight"], blocks),
                gate_up=self._weight(layer.gate_up.weight, None,
                                     [block + "ffn_gate.weight", block + "ffn_up.weight"], blocks),
                down=self._weight(layer.down.weight, None, [block + "ffn_down.weight"], blocks)))
        embed = self._weight(lean.embed, None, ["token_embd.weight"], blocks)
        head = lean.lm_head.weight
        tied = head.data_ptr() == lean.embed.data_ptr()
        lm_head = embed if tied and lean.lm_head.bias is None else self._weight(
            head, lean.lm_head.bias, ["output.weight"], blocks)
        config = k.Config(hidden=lean.hidden_size, heads=lean.num_heads, kv_heads=lean.kv_heads,
                          head_dim=lean.head_dim, intermediate=lean.layers[0].down.weight.shape[1],
                          eps=lean.eps, scale=lean.scale)
        cos, sin = lean.cos.float().contiguous(), lean.sin.float().contiguous()
        return k.Model(config=config, layers=layers, embed=embed, final_norm=lean.final_norm.float().contiguous(),
                       lm_head=lm_head, cos=cos, sin=sin)

    # -- the lean forward's interface -----------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> StaticCache:
        lean = self.lean
        return StaticCache(len(lean.layers), lean.kv_heads, lean.head_dim, dtype=self.kv_dtype, device=self.device,
                           limit=self.max_positions + TREE_ROWS_MARGIN, capacity=capacity)

    @torch.inference_mode()
    def forward_tapped(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticCache,
                       tree_mask: torch.Tensor | None = None, taps: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the residual stream entering each layer of `taps` ([T, n, H], None when
        no taps): the features an EAGLE-style drafter reads. Copying them changes no number."""
        if cache.keys.dtype != self.kv_dtype:
            raise TypeError(f"the exact forward in mode {self.mode} writes a {self.kv_dtype} cache (ExactLlama.new_cache)")
        n = int(input_ids.shape[0])
        past = cache.get_seq_length()
        cache.reserve(n)
        mask = torch.empty(0, dtype=torch.bool) if tree_mask is None else tree_mask.to(torch.bool).cpu()
        tapped = torch.empty(len(taps), n, self.hidden_size) if taps else torch.empty(0)  # [T, n, H]
        hidden = self.model.forward(input_ids.cpu(), position_ids.cpu(), cache.keys, cache.values, past, mask,
                                    list(taps), tapped)
        cache.advance(n)
        return hidden.to(self.dtype), (tapped.to(self.dtype) if taps else None)  # [n, H], [T, n, H]

    # -- batched generation: each slot's row is its own sequence's plain step, bit for bit -----------
    def new_slots(self, slots: int, capacity: int) -> ExactSlots:
        lean = self.lean
        return ExactSlots(len(lean.layers), lean.kv_heads, lean.head_dim, slots=slots,
                          capacity=min(capacity, self.max_positions), dtype=self.kv_dtype)

    def forward_slots(self, input_ids: torch.Tensor, cache: ExactSlots) -> torch.Tensor:
        """One batched decoding step: token input_ids[b] appended to slot b at its own length: hidden [B, H]."""
        return self.forward_slots_tapped(input_ids, cache)[0]

    @torch.inference_mode()
    def forward_slots_tapped(self, input_ids: torch.Tensor, cache: ExactSlots, taps: tuple[int, ...] = ()
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_slots`, plus the residual stream entering each layer of `taps` ([T, B, H], None when none)."""
        if not isinstance(cache, ExactSlots):
            raise TypeError("the exact forward's slots are an ExactSlots (ExactLlama.new_slots)")
        n = int(input_ids.shape[0])
        tapped = torch.empty(len(taps), n, self.hidden_size) if taps else torch.empty(0)  # [T, B, H]
        hidden = self.model.forward_slots(input_ids.cpu(), cache.keys, cache.values, torch.tensor(cache.lengths),
                                          list(taps), tapped)  # [B, H]
        cache.lengths = [length + 1 for length in cache.lengths]
        return hidden.to(self.dtype), (tapped.to(self.dtype) if taps else None)

    def prefill_slot(self, input_ids: torch.Tensor, view: ExactSlotView, taps: tuple[int, ...] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt input_ids [n] into one slot (causal, from position 0): hidden [n, H], tapped [T, n, H]."""
        return self.forward_tapped(input_ids, torch.arange(int(input_ids.shape[0])), view, taps=taps)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden [..., H]: [..., V] fp32, by the same row-invariant product."""
        logits = self.model.project(hidden.reshape(-1, hidden.shape[-1]))  # [rows, V]
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])

    def draft_product(self, weight: torch.Tensor, token_ids: torch.Tensor | None, *,
                      eight_bit: bool = False) -> "KernelProduct":
        """`x @ weight.T` through the kernels for a drafter's vocabulary projection (rows of the lm_head:
        `token_ids`, or the first rows when None). Drafts only propose, so bytes matter here, not
        exactness: in a gguf mode the GGUF's own rows of the lm_head (Q8_0: a quarter of fp32's bytes),
        else `kernel_product`'s. `eight_bit`: 8-bit inputs times those blocks (or Q8_0 rows of `weight`)."""
        rows, width = weight.shape
        ids = token_ids[:rows] if token_ids is not None else torch.arange(rows)
        blocks = self._lm_head_blocks(weight, ids)
        if blocks is not None:
            fmt, raw = blocks
            int8 = self.int8_activations or (eight_bit and self.vector_int8)
            return KernelProduct(self.kernels, self.kernels.Weight(fmt, torch.from_numpy(raw[ids.numpy()]), rows, width,
                                                                   int8_activations=int8))
        return self.kernel_product(weight.bfloat16(), eight_bit=eight_bit)

    def _lm_head_blocks(self, weight: torch.Tensor, ids: torch.Tensor) -> tuple[int, np.ndarray] | None:
        """The GGUF's blocks of the lm_head (the tied embedding's, or its own `output.weight`), when
        `weight` holds the lm_head's rows `ids` (compared in the drafting precision the caller cast them
        to); else None."""
        head = self.lean.lm_head.weight
        tied = head.data_ptr() == self.lean.embed.data_ptr()
        raw = self.raw_rows.get("token_embd.weight" if tied else "output.weight")
        if raw is None or not torch.equal(weight[:4], head[ids[:4]].to(weight.dtype)):
            return None
        return raw

    @property
    def vector_int8(self) -> bool:
        """Whether this CPU has a vector 8-bit product (AVX2 or AVX512-VNNI), not the scalar one alone."""
        return len(self.kernels.int8_paths()) > 1

    def kernel_product(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       eight_bit: bool = False) -> "KernelProduct":
        """`x @ weight.T (+ bias)` through the kernels for a drafter's own layer (weight [out, in], fp32 or
        bf16; the bias added in fp32 before the result takes x's precision). `eight_bit`: the weight as
        Q8_0 blocks times 8-bit inputs (`q8_0_rows`; a quarter of fp32's bytes, half of bf16's), where
        its width is whole blocks and the CPU has a vector 8-bit product: drafts only propose, the
        verify decides every token."""
        bias = None if bias is None else bias.detach().float().contiguous()
        if eight_bit and weight.shape[1] % QBLOCK == 0 and self.vector_int8:
            return KernelProduct(self.kernels, self.kernels.Weight(Q8_0, q8_0_rows(weight), weight.shape[0],
                                                                   weight.shape[1], bias, int8_activations=True))
        data = weight.detach().contiguous()
        fmt = BF16 if data.dtype == torch.bfloat16 else F32
        data = data if fmt == BF16 else data.float().contiguous()
        return KernelProduct(self.kernels, self.kernels.Weight(fmt, data, data.shape[0], data.shape[1], bias))

    def describe(self) -> str:
        """One line for the page and the benchmark: the mode and what its products read."""
        read = f"{self.weight_bytes / 1e6:.0f} MB of weights a step"
        fallback = f"; fp32 for {len(self.quantized_fallbacks)} weights" if self.quantized_fallbacks else ""
        int8 = f", 8-bit products {self.kernels.int8_path().removeprefix('auto: ')}" if self.mode == "gguf-q8" else ""
        return f"exact kernels ({self.kernels.ISA}{int8}), {self.mode}: {read}{fallback}"


def q8_0_rows(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] (in a multiple of 32) as GGUF Q8_0 rows [out, in / 32 * 34] uint8, as ggml
    rounds them: per block of 32 numbers an fp16 scale d = max |x| / 127, then the 32 int8 x * (1 / d)
    rounded half away from zero."""
    out, width = weight.shape
    values = weight.detach().float().reshape(out, width // QBLOCK, QBLOCK)  # [out, blocks, 32]
    scale = values.abs().amax(dim=-1, keepdim=True) / 127  # [out, blocks, 1]
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    scaled = values * inverse
    quants = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)  # [out, blocks, 32]
    scale_bytes = scale.half().view(torch.uint8)  # [out, blocks, 2]
    return torch.cat([scale_bytes, quants.view(torch.uint8)], dim=-1).reshape(out, -1).contiguous()


def random_weight(kernels: ModuleType, fmt: int, out: int, width: int, generator: torch.Generator,
                  int8_activations: bool = False) -> object:
    """A kernel weight of random values in format `fmt` (for timing): fp32 / bf16 values, or
    GGUF-style blocks with random nibbles / bytes and a small fp16 scale (and minimum), read with
    8-bit activations when `int8_activations`."""
    values = torch.randn(out, width, generator=generator)
    if fmt == F32:
        return kernels.Weight(F32, values, out, width)
    if fmt == BF16:
        return kernels.Weight(BF16, values.bfloat16(), out, width)
    blocks = out * width // QBLOCK
    scale = torch.full((blocks, 1), 0.01, dtype=torch.float16).view(torch.uint8)  # [blocks, 2]
    if fmt == Q8_0:
        quants = torch.randint(-127, 128, (blocks, 32), generator=generator, dtype=torch.int8).view(torch.uint8)
        raw = torch.cat([scale, quants], dim=1)  # [blocks, 34]
    else:
        nibbles = torch.randint(0, 256, (blocks, 16), generator=generator, dtype=torch.int16).to(torch.uint8)
        raw = torch.cat([scale, scale, nibbles], dim=1)  # [blocks, 20]
    return kernels.Weight(fmt, raw.reshape(out, -1).contiguous(), out, width, int8_activations=int8_activations)


def time_modes(kernels: ModuleType, shapes: tuple[tuple[int, int], ...], rows: tuple[int, ...] = (1, 8),
               layers: int = 8, repeats: int = 5, modes: tuple[str, ...] = MODES) -> dict[str, dict[int, float]]:
    """Median ms of `layers` layers of products of `shapes` through the exact kernels, per mode and
    row count (more weights than a CPU cache holds, so they stream from memory as in a forward)."""
    from core.engine.lean import median_ms
    generator = torch.Generator().manual_seed(0)
    formats = {"fp32": F32, "bf16": BF16, "gguf": Q4_1, GGUF_Q8: Q4_1}
    report: dict[str, dict[int, float]] = {}
    for mode in modes:
        fmt = formats[mode]
        weights = [random_weight(kernels, fmt, out, width, generator, int8_activations=mode == GGUF_Q8)
                   for _ in range(layers) for out, width in shapes]
        report[mode] = {}
        for count in rows:
            inputs = {width: torch.randn(count, width, generator=generator) for _, width in shapes}
            report[mode][count] = median_ms(
                lambda: [kernels.matmul(inputs[w.in_features], w) for w in weights], repeats)
    return report
