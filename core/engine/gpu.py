"""The exact engine on a CUDA GPU: the lean forward's maths through row-invariant Triton kernels.

The CPU's exact engine (core.engine.exact) makes every tree row bitwise the one-token step's with
C++ kernels; here the same guarantee comes from `core.engine.triton_kernels`: products with tiles
fixed per weight and no split of the reduction, norms one row per program, and attention in which
each query reduces exactly the keys it sees, in position order, over blocks aligned to position 0.
Library GEMMs (cuBLAS) choose their kernel and split-K by the row count, so a 16-row verify and a
one-token step sum in different orders; these kernels never do.

Modes: `fp32` (the model's fp32 weights) and `bf16` (its bf16 weights, widened in registers);
activations, the KV cache and every sum are fp32 in both, as on the CPU.

Launch cost: a step of the shipped model is some 500 small kernels. Each forward of up to
`GRAPH_BUCKETS[-1]` rows is therefore replayed from a CUDA graph captured for its row bucket (rows
padded to the bucket: padding rows change no real row, the kernels being row-invariant) and its
cache; anything else runs the same kernels eagerly.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from core import settings
from core.engine.lean import TREE_ROWS_MARGIN, LeanLlama, OnLeanForward, StaticCache

log = logging.getLogger(__name__)

MODES = ("fp32", "bf16")
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_CACHES = 4  # caches (sessions) whose graphs are kept; older ones are dropped with their graphs
ANCESTOR_WIDTH = 96  # deepest tree a graph takes (root-to-node rows); deeper trees run eagerly


def triton_unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run here (None when they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def gpu_unsupported_reason(lean: LeanLlama, mode: str) -> str | None:
    """Why the GPU kernels cannot run this model in `mode` (None if they can)."""
    if mode not in MODES:
        return f"precision {mode} (the GPU kernels take {', '.join(MODES)})"
    if lean.head_dim & (lean.head_dim - 1) or lean.num_heads % lean.kv_heads:
        return "head layout (a power-of-two head dim, whole groups)"
    if lean.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the GPU kernels run on a CUDA device (or the Triton interpreter)"
    return triton_unavailable_reason()


@dataclass
class GpuLayer:
    """One decoder layer's weights as the kernels read them (projections [out, in], contiguous)."""

    attn_norm: torch.Tensor  # [H] fp32
    qkv: torch.Tensor  # [(heads + 2 kv) d, H]
    qkv_bias: torch.Tensor | None
    out: torch.Tensor  # [H, heads d]
    mlp_norm: torch.Tensor  # [H] fp32
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class RowPlan:
    """Where each of n new rows sits and what it sees (int32 tensors on the device).

    `last[i]`: the last position row i sees (its own); positions from `tree_from[i]` on are read
    from `ancestors[i, p - tree_from[i]]` (cache slots), earlier ones from their own slot;
    `slots[i]`: where row i's keys and values are written."""

    last: torch.Tensor  # [n]
    tree_from: torch.Tensor  # [n]
    ancestors: torch.Tensor  # [n, A]
    slots: torch.Tensor  # [n] int64

    @classmethod
    def build(cls, n: int, past: int, tree_mask: torch.Tensor | None, device: torch.device) -> "RowPlan":
        own = past + torch.arange(n)  # [n]
        if tree_mask is None:  # causal: every position a row sees sits at its own slot
            last, tree_from, ancestors = own, own + 1, torch.zeros(n, 1, dtype=torch.long)
        else:
            mask = tree_mask.to(torch.bool).cpu()  # [n, n]
            counts = mask.sum(dim=1)  # [n] ancestors, the row itself included
            last, tree_from = past + counts - 1, torch.full((n,), past)
            # each row's ancestors in index order (parents come before children: depth order);
            # the columns past a row's own count are never read
            index = torch.arange(n).expand(n, n)  # [n, n]
            ordered = torch.where(mask, index, n).sort(dim=1).values[:, : int(counts.max())]  # [n, A]
            ancestors = past + ordered
        to = dict(device=device, dtype=torch.int32)
        return cls(last=last.to(**to), tree_from=tree_from.to(**to), ancestors=ancestors.to(**to),
                   slots=own.to(device))


@dataclass
class CacheGraphs:
    """The graphs captured over one cache, by (row bucket, taps)."""

    cache: StaticCache
    graphs: dict[tuple[int, tuple[int, ...]], "_Graph"] = field(default_factory=dict)


class _Graph:
    """One captured forward: static inputs for `rows` rows (a bucket) over one cache and tap set."""

    def __init__(self, engine: "GpuExactLlama", rows: int, cache: StaticCache, taps: tuple[int, ...],
                 pool: object) -> None:
        device = engine.device
        self.rows = rows
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.plan = RowPlan(last=torch.zeros(rows, dtype=torch.int32, device=device),
                            tree_from=torch.ones(rows, dtype=torch.int32, device=device),
                            ancestors=torch.zeros(rows, ANCESTOR_WIDTH, dtype=torch.int32, device=device),
                            slots=torch.zeros(rows, dtype=torch.long, device=device))
        # the warm-up run (it compiles every kernel) writes its rows at the end of the cache, past
        # any position in use (the caller checked that past + rows fits); replays write where `run` says
        self.plan.slots.copy_(torch.arange(cache.capacity - rows, cache.capacity))
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            engine._layers(self.ids, self.positions, cache, self.plan, taps)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another session's thread working on the GPU meanwhile does not break the capture
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.hidden, self.tapped = engine._layers(self.ids, self.positions, cache, self.plan, taps)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, plan: RowPlan, past: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = int(ids.shape[0])
        self.ids.zero_()
        self.ids[:n] = ids
        self.positions.zero_()
        self.positions[:n] = positions
        # padding rows see position 0 only and write their keys past the real rows (never read)
        self.plan.last.zero_()
        self.plan.last[:n] = plan.last
        self.plan.tree_from.fill_(1)
        self.plan.tree_from[:n] = plan.tree_from
        self.plan.ancestors[:n, : plan.ancestors.shape[1]] = plan.ancestors
        self.plan.slots.copy_(torch.arange(past, past + self.rows))
        self.graph.replay()
        tapped = self.tapped[:, :n].clone() if self.tapped is not None else None
        return self.hidden[:n].clone(), tapped


class GpuExactLlama(OnLeanForward):
    """The exact forward on a CUDA device; the interface of `ExactLlama` (`forward`, `forward_tapped`,
    `project`, `new_cache`, `draft_product`, `kernel_product`, `mode`, `describe`). Batched
    generation stays on the lean forward."""

    def __init__(self, lean: LeanLlama, mode: str, graphs: bool | None = None) -> None:
        reason = gpu_unsupported_reason(lean, mode)
        if reason:
            raise ValueError(f"the GPU kernels do not cover this model: {reason}")
        from core.engine import triton_kernels
        self.kernels = triton_kernels
        self.lean, self.mode = lean, mode
        self.dtype, self.device = lean.dtype, lean.device
        self.max_positions, self.hidden_size = lean.max_positions, lean.hidden_size
        self.num_heads, self.kv_heads, self.head_dim = lean.num_heads, lean.kv_heads, lean.head_dim
        weight_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        self.layers = [GpuLayer(
            attn_norm=layer.attn_norm.float().contiguous(), mlp_norm=layer.mlp_norm.float().contiguous(),
            qkv=layer.qkv.weight.to(weight_dtype).contiguous(),
            qkv_bias=layer.qkv.bias.float().contiguous() if layer.qkv.bias is not None else None,
            out=layer.out.weight.to(weight_dtype).contiguous(),
            gate_up=layer.gate_up.weight.to(weight_dtype).contiguous(),
            down=layer.down.weight.to(weight_dtype).contiguous()) for layer in lean.layers]
        self.embed = lean.embed.to(weight_dtype)  # [V, H]
        self.lm_head = lean.lm_head.weight.to(weight_dtype).contiguous()  # [V, H]
        self.lm_head_bias = lean.lm_head.bias.float() if lean.lm_head.bias is not None else None
        self.final_norm = lean.final_norm.float().contiguous()
        self.cos, self.sin = lean.cos.float().contiguous(), lean.sin.float().contiguous()  # [P, d]
        self.weight_bytes = sum(t.numel() * t.element_size() for layer in self.layers
                                for t in (layer.qkv, layer.out, layer.gate_up, layer.down)) + \
            self.lm_head.numel() * self.lm_head.element_size()
        wanted = settings.SETTINGS.cuda_graphs if graphs is None else graphs  # off: every forward eager
        self.graphs_enabled = wanted and self.device.type == "cuda"
        self._graphs: OrderedDict[int, CacheGraphs] = OrderedDict()  # by the cache's storage, newest last
        self._pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None
        self._lock = threading.Lock()

    # -- caches ---------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> StaticCache:
        """An fp32 cache at its full size from the start: a captured graph holds its address, so it
        never grows (about 13 MB per 1,000 positions for the shipped model)."""
        limit = self.max_positions + TREE_ROWS_MARGIN
        lean = self.lean
        return StaticCache(len(lean.layers), lean.kv_heads, lean.head_dim, dtype=torch.float32, device=self.device,
                           limit=limit, capacity=limit if self.device.type == "cuda" else max(capacity, 1))

    # -- the forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_tapped(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticCache,
                       tree_mask: torch.Tensor | None = None, taps: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the residual stream entering each layer of `taps` ([T, n, H], None when none)."""
        if cache.keys.dtype != torch.float32:
            raise TypeError("the exact forward writes an fp32 StaticCache (GpuExactLlama.new_cache)")
        n = int(input_ids.shape[0])
        past = cache.get_seq_length()
        cache.reserve(n)
        plan = RowPlan.build(n, past, tree_mask, self.device)
        ids, positions = input_ids.to(self.device), position_ids.to(self.device)
        with self._lock:  # one forward at a time: sessions' threads share the graphs' memory pool
            graph = self._graph_for(n, past, cache, taps, plan)
            if graph is not None:
                hidden, tapped = graph.run(ids, positions, plan, past)
            else:
                hidden, tapped = self._layers(ids, positions, cache, plan, taps)
        cache.advance(n)
        return hidden.to(self.dtype), (tapped.to(self.dtype) if tapped is not None else None)

    def _graph_for(self, n: int, past: int, cache: StaticCache, taps: tuple[int, ...],
                   plan: RowPlan) -> _Graph | None:
        """The captured graph for n rows on `cache` (captured on first use), or None to run eagerly."""
        if not self.graphs_enabled or n > GRAPH_BUCKETS[-1] or plan.ancestors.shape[1] > ANCESTOR_WIDTH:
            return None
        rows = next(b for b in GRAPH_BUCKETS if n <= b)
        if past + rows > cache.capacity:
            return None
        key = id(cache.keys)
        held = self._graphs.get(key)
        if held is None or held.cache is not cache:
            held = self._graphs[key] = CacheGraphs(cache)
            while len(self._graphs) > GRAPH_CACHES:  # drop the oldest cache's graphs (and the cache itself)
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        if (rows, taps) not in held.graphs:
            held.graphs[(rows, taps)] = _Graph(self, rows, cache, taps, self._pool)
        return held.graphs[(rows, taps)]

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, plan: RowPlan,
                taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final normed hidden [n, H] fp32 and the tapped residuals [T, n, H] (None without taps)."""
        k = self.kernels
        n = int(ids.shape[0])
        heads, d = self.num_heads, self.head_dim
        x = F.embedding(ids, self.embed).float()  # [n, H]
        tapped: dict[int, torch.Tensor] = {}
        # nine kernels a layer, each row-invariant: norm, q/k/v, RoPE + cache write, attention,
        # output product + residual, norm, gate/up, SiLU-gate, down product + residual
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped[index] = x
            qkv = k.matmul(k.rms_norm(x, layer.attn_norm, self.lean.eps), layer.qkv, layer.qkv_bias)  # [n, (h+2kv)d]
            keys, values = cache.keys[index, 0], cache.values[index, 0]  # [kvh, cap, d]
            q = k.rope_and_store(qkv, self.cos, self.sin, positions, plan.slots, keys, values, heads)  # [n, heads d]
            attended = torch.empty(n, heads * d, dtype=torch.float32, device=x.device)
            k.tree_attention(q, keys, values, plan.last, plan.tree_from, plan.ancestors, self.lean.scale, attended)
            x = k.matmul(attended, layer.out, residual=x)
            gate_up = k.matmul(k.rms_norm(x, layer.mlp_norm, self.lean.eps), layer.gate_up)  # [n, 2I]
            x = k.matmul(k.silu_mul(gate_up), layer.down, residual=x)
        hidden = k.rms_norm(x, self.final_norm, self.lean.eps)  # [n, H]
        return hidden, (torch.stack([tapped[t] for t in taps]) if taps else None)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden [..., H]: [..., V] fp32, by the same row-invariant product."""
        flat = hidden.reshape(-1, hidden.shape[-1]).to(device=self.device, dtype=torch.float32).contiguous()
        with self._lock:  # never beside another thread's graph capture
            logits = self.kernels.matmul(flat, self.lm_head, self.lm_head_bias)  # [rows, V]
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])

    # -- drafters' products ---------------------------------------------------------------------
    def draft_product(self, weight: torch.Tensor, token_ids: torch.Tensor | None, *,
                      eight_bit: bool = False) -> "TorchProduct":
        """A drafter's vocabulary projection (rows of the lm_head): drafts only propose, so the library's
        bf16 product serves (tensor cores), not the exact kernels (`eight_bit` is the CPU kernels' choice)."""
        return TorchProduct(weight)

    def kernel_product(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       eight_bit: bool = False) -> "TorchProduct":
        """A drafter's own layer's product (weight [out, in], bias [out]) in bf16 through the library
        (`eight_bit` is the CPU kernels' choice; tensor cores read bf16 here)."""
        return TorchProduct(weight, bias)

    def describe(self) -> str:
        """One line for the page and the benchmark: the mode and what its products read."""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "Triton interpreter"
        graphs = ", CUDA graphs per row bucket" if self.graphs_enabled else ""
        return f"exact kernels (Triton on {name}{graphs}), {self.mode}: {self.weight_bytes / 1e6:.0f} MB of weights a step"


class TorchProduct:
    """`x @ weight.T` by the library in bf16 (any leading shape; returned in x's precision)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach().bfloat16().contiguous()  # [out, in]
        self.bias = None if bias is None else bias.detach().to(device=self.weight.device, dtype=torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(device=self.weight.device, dtype=torch.bfloat16), self.weight, self.bias).to(x.dtype)
