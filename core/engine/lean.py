"""A lean forward for the Llama family: fused projections, a static KV cache, GQA without copies.

transformers' forward is general and readable, and on a CPU most of a decoding step goes to
what surrounds the matrix products: seven separate projections per layer, a cache that
re-concatenates every layer's keys and values each step, grouped K/V heads repeated three times
for a masked (tree) verify. This module runs the same maths on the same weights (read from a
loaded transformers model, whose q/k/v and gate/up weights become views of the fused copies:
same values, one copy in memory) in fewer, larger operations:

- q/k/v in one product and gate/up in one (`FusedLayer`), rms-norm in one fused op;
- a preallocated cache `[layers, batch, kv_heads, capacity, head_dim]` written in place
  (`StaticCache` for one sequence, `SlotCache` for batched generation), committed by one
  gather over all layers;
- the grouped query heads folded onto their K/V head (`[kv_heads, group * n, d]`), so attention
  reads each cached key once and a tree mask is one boolean matrix;
- each weight multiplied by the kernel that measured fastest on this machine for that number of
  rows (`Matmul`: on a CPU without fast bf16 the GEMV of `mkldnn` reads weights 2x faster than
  the default path; several rows prefer `W @ x.T`).

Exactness: in fp32 the results equal transformers' forward up to float rounding (the tests bound
the difference and check greedy equality token for token); RoPE tables come from the model's own
rotary module, so every RoPE variant the model supports rotates identically.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core.machine import cpu_name, measured_quietly, median_ms
from core.limits import MAX_TREE_ROWS

log = logging.getLogger(__name__)

# families whose decoder layer is exactly: rms-norm -> attention (rope, GQA) -> residual -> rms-norm
# -> SiLU-gated MLP -> residual (qwen2 adds q/k/v biases, which FusedLayer carries)
LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# row-count buckets a kernel choice is measured for (a tree of 3 rows uses the choice for <= 4),
# each timed at the rows of BUCKET_TIMING_ROWS. Why so fine: the best kernel moves with the row
# count: on an Intel Xeon with AMX (fp32), one bucket for 2-8 rows timed at 8 ran a 2-row verify's
# products by the 8-row winners in 39.7 ms where `linear` took 24.2 (one row: 20.1), a 2-row forward
# 1.63x a one-row one; timed per bucket, 1.03x.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 10**9)
BUCKET_TIMING_ROWS = dict(zip(ROW_BUCKETS, (1, 2, 4, 8, 16, 32, 64)))
REFERENCE_BUCKET = 8  # the bucket whose gate/up timing checks that a choice was measured quietly
KERNEL_REPEATS = 3  # timed runs per kernel and bucket (median): with 2, choices flipped between runs
# cache rows beyond the context a tree verify may add: the largest tree the decoder accepts, with
# every lookup chain and datastore branch grafted in full
TREE_ROWS_MARGIN = MAX_TREE_ROWS


def lean_unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot run on the lean forward (None if it can)."""
    config = model.config
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} (lean forward: {', '.join(sorted(LEAN_MODEL_TYPES))})"
    from transformers.cache_utils import get_layer_types_and_kwargs
    if set(get_layer_types_and_kwargs(config)[0]) != {"full_attention"}:
        return "windowed or chunked attention layers"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "an MLP other than SiLU-gated without bias"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return "no decoder at `.model` with `layers` and `rotary_emb`"
    attention = inner.layers[0].self_attn
    if getattr(attention, "q_norm", None) is not None or getattr(attention, "k_norm", None) is not None:
        return "per-head q/k norms"
    if bool(getattr(attention.o_proj, "bias", None) is not None):
        return "a bias on the output projection"
    return None


class Matmul:
    """`x @ weight.T (+ bias)` by the kernel chosen for the row count (see `choose_kernels`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.contiguous()  # [out, in]
        self.bias = bias
        self.packed: torch.Tensor | None = None  # mkldnn layout of `weight`, made when chosen
        self.kernels: dict[int, str] = {}  # row bucket -> kernel name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kernel = self.kernels.get(_bucket(rows), "linear")
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        if kernel == "mkldnn":
            out = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self.packed, self.bias).to_dense()
        elif kernel == "wxt":
            # transposed back into a row-major copy: attention's fast kernel needs contiguous heads
            out = torch.mm(self.weight, flat.T).T.contiguous()  # [rows, out]
            out = out + self.bias if self.bias is not None else out
        else:
            out = F.linear(flat, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.weight.shape[0])

    def pack(self) -> None:
        if self.packed is None:
            self.packed = self.weight.to_mkldnn()

    def use_kernels(self, kernels: dict[int, str]) -> None:
        """Take `kernels` (row bucket -> kernel name); the mkldnn copy is kept only where one uses it.
        A split GEMV (an older cached choice; see the note below) runs as linear."""
        self.kernels.update({bucket: "linear" if name == "split" else name for bucket, name in kernels.items()})
        if "mkldnn" in self.kernels.values():
            self.pack()
        else:
            self.packed = None


# No kernel runs on a worker thread. A split GEMV (half of a one-row product on a worker thread) is
# faster alone (13-14 GB/s against the library GEMV's 8 on an AVX2 CPU) but opens a second OpenMP
# team, and every later forward of the process runs ~1.8x slower (libgomp stops spinning once it
# holds more threads than cores): on an Intel Xeon with AMX, torch 2.13, one fp32 `torch.mv` on a
# worker thread took a plain step's products from 15.2 to 20.0 ms for the rest of the process.


def _bucket(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if rows <= b)


@dataclass
class FusedLayer:
    """One decoder layer's weights, fused where the maths allows."""

    attn_norm: torch.Tensor  # [H]
    qkv: Matmul  # [(heads + 2 kv_heads) * d, H]
    out: Matmul  # [H, heads * d]
    mlp_norm: torch.Tensor  # [H]
    gate_up: Matmul  # [2 I, H]
    down: Matmul  # [H, I]


class StaticCache:
    """A preallocated KV cache for one sequence: `keys`/`values` [layers, 1, kv_heads, capacity, d].

    Rows are written in place by the forward; `keep` moves the accepted tree rows next to the
    prefix with one gather over every layer; capacity grows by doubling (rarely) up to `limit`.
    The same interface as transformers' cache where the decoder uses it (`get_seq_length`, `crop`).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device,
                 limit: int, capacity: int = 256) -> None:
        self.limit = limit
        self.length = 0
        shape = (layers, 1, kv_heads, min(capacity, limit), head_dim)
        with torch.inference_mode():
            self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, kvh, cap, d]
            self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, rows: int) -> None:
        """Make room for `rows` more positions (copies the cache only when it must grow)."""
        need = self.length + rows
        if need <= self.capacity:
            return
        if need > self.limit:
            raise ValueError(f"the cache would hold {need} positions; the model's context is {self.limit}")
        grown = min(max(need, 2 * self.capacity), self.limit)
        with torch.inference_mode():
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:3], grown, old.shape[4])
                new[:, :, :, : self.length] = old[:, :, :, : self.length]
                setattr(self, name, new)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new rows keys/values [1, kvh, n, d] after the cached ones; return all to attend
        over [1, kvh, length + n, d] (the length itself advances in `advance`)."""
        n = keys.shape[2]
        end = self.length + n
        self.keys[layer, :, :, self.length:end] = keys
        self.values[layer, :, :, self.length:end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Store the new rows, then attend the folded query over every cached row."""
        all_keys, all_values = self.write(layer, keys, values)
        return F.scaled_dot_product_attention(query, all_keys, all_values, attn_mask=mask, scale=scale)

    def advance(self, rows: int) -> None:
        self.length += rows

    def crop(self, length: int) -> None:
        """Forget every position from `length` on."""
        self.length = min(self.length, length)

    def keep(self, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep the first `prefix_len` positions plus positions prefix_len + keep[i] (ascending),
        moved to prefix_len + i: one gather and one copy for all layers."""
        nodes = keep.tolist()
        count = len(nodes)
        # nodes already in place (the root, and a path of first children) need no copy: often all of them
        moved_from = next((i for i, node in enumerate(nodes) if node != i), count)
        if moved_from < count:
            source = torch.tensor(nodes[moved_from:], device=self.keys.device) + prefix_len  # [moved]
            with torch.inference_mode():
                for states in (self.keys, self.values):
                    moved = states.index_select(3, source)  # [L, 1, kvh, moved, d]
                    states[:, :, :, prefix_len + moved_from:prefix_len + count] = moved
        self.length = prefix_len + count


class SlotCache:
    """A preallocated KV cache for a batch of independent sequences ("slots") of their own lengths,
    for continuous batching: keys/values [layers, slots, kv_heads, capacity, d], `lengths` [slots]."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, slots: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (layers, slots, kv_heads, capacity, head_dim)
        with torch.inference_mode():
            self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, kvh, cap, d]
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots

    def slot(self, index: int) -> "SlotView":
        """One slot as a single-sequence cache (for its prefill)."""
        return SlotView(self, index)


class SlotView:
    """One slot of a SlotCache, written like a StaticCache (a prefill of that slot alone)."""

    def __init__(self, cache: SlotCache, index: int) -> None:
        self.cache, self.index = cache, index

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.cache.lengths[self.index]
        end = start + keys.shape[2]
        slot = slice(self.index, self.index + 1)
        self.cache.keys[layer, slot, :, start:end] = keys
        self.cache.values[layer, slot, :, start:end] = values
        return self.cache.keys[layer, slot, :, :end], self.cache.values[layer, slot, :, :end]

    def get_seq_length(self) -> int:
        return self.cache.lengths[self.index]

    attend = StaticCache.attend

    def advance(self, rows: int) -> None:
        self.cache.lengths[self.index] += rows


class SlotStep:
    """The KV writer of one batched decoding step: one new token per slot, at that slot's length.

    Attention reads each slot's keys up to a width: one width for the whole batch would make every
    slot pay for the longest (over 600 cached rows against a mean near 300 in chat data, and the
    cache read is as large as the weights' at 48 slots). So the slots are cut into contiguous groups
    (views, no copies), each attending up to its own longest slot.
    """

    GROUPS = 4

    def __init__(self, cache: SlotCache) -> None:
        self.cache = cache
        device = cache.keys.device
        slots = len(cache.lengths)
        self.rows = torch.arange(slots, device=device)  # [B]
        self.at = torch.tensor(cache.lengths, device=device)  # [B]
        size = -(-slots // self.GROUPS)
        self.groups = []  # (first slot, end slot, width, bool mask [g, 1, 1, width])
        for start in range(0, slots, size):
            end = min(start + size, slots)
            width = max(cache.lengths[start:end]) + 1
            positions = torch.arange(width, device=device)  # [width]
            mask = (positions[None] <= self.at[start:end, None])[:, None, None]  # [g, 1, 1, width]
            self.groups.append((start, end, width, mask))

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """query [B, kvh, group, d]; keys/values [B, kvh, 1, d]: the new row of each slot."""
        cache_keys, cache_values = self.cache.keys[layer], self.cache.values[layer]  # [B, kvh, cap, d]
        cache_keys[self.rows, :, self.at] = keys[:, :, 0]  # [B, kvh, d]
        cache_values[self.rows, :, self.at] = values[:, :, 0]
        parts = [F.scaled_dot_product_attention(query[start:end], cache_keys[start:end, :, :width],
                                                cache_values[start:end, :, :width], attn_mask=group_mask,
                                                scale=scale)
                 for start, end, width, group_mask in self.groups]
        return torch.cat(parts) if len(parts) > 1 else parts[0]  # [B, kvh, group, d]

    def advance(self) -> None:
        self.cache.lengths = [n + 1 for n in self.cache.lengths]


class LeanLlama:
    """The lean forward of a loaded Llama-family model (weights shared, fused copies where fused).

    `forward(ids, positions, cache, tree_mask)` returns the last hidden states (after the final
    norm); `project(hidden)` the logits. Nothing is stored between calls but the weights.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = lean_unsupported_reason(model)
        if reason:
            raise ValueError(f"the lean forward does not cover {reason}")
        config = model.config
        inner = model.model
        attention = inner.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scale = float(attention.scaling)
        self.hidden_size = config.hidden_size
        self.eps = float(config.rms_norm_eps)
        self.max_positions = int(getattr(config, "max_position_embeddings", 2048))
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.final_norm = inner.norm.weight  # [H]
        head = model.get_output_embeddings()
        self.lm_head = Matmul(head.weight, getattr(head, "bias", None))
        self.layers = [self._fuse(layer) for layer in inner.layers]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.cos, self.sin = self._rope_tables(inner.rotary_emb)  # [P, d] each
        self.kernel_report: dict[str, dict[int, dict[str, float]]] = {}  # role -> bucket -> kernel -> ms

    @staticmethod
    def _fuse(layer: nn.Module) -> FusedLayer:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        qkv_bias = None
        if projections[0].bias is not None:
            qkv_bias = torch.cat([p.bias for p in projections])  # [(heads + 2 kv) * d]
        qkv = torch.cat([p.weight.detach() for p in projections])  # [(heads + 2 kv) * d, H]
        gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])  # [2 I, H]
        # the model's own projections become views of the fused weights: same values, one copy in memory
        _share_rows(projections, qkv)
        _share_rows((mlp.gate_proj, mlp.up_proj), gate_up)
        return FusedLayer(
            attn_norm=layer.input_layernorm.weight,
            qkv=Matmul(qkv, qkv_bias),
            out=Matmul(attention.o_proj.weight, None),
            mlp_norm=layer.post_attention_layernorm.weight,
            gate_up=Matmul(gate_up, None),
            down=Matmul(mlp.down_proj.weight, None),
        )

    def _rope_tables(self, rotary: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of every position, from the model's own rotary module (any RoPE type it has)."""
        positions = torch.arange(self.max_positions, device=self.device)[None]  # [1, P]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = rotary(probe, positions)  # [1, P, d]
        return cos[0].clone(), sin[0].clone()

    # -- caches ---------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> StaticCache:
        # a tree verify near the context limit holds more rows than positions (siblings share one)
        return StaticCache(len(self.layers), self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device,
                           limit=self.max_positions + TREE_ROWS_MARGIN, capacity=capacity)

    def new_slots(self, slots: int, capacity: int) -> SlotCache:
        return SlotCache(len(self.layers), self.kv_heads, self.head_dim, slots=slots,
                         capacity=min(capacity, self.max_positions), dtype=self.dtype, device=self.device)

    # -- the forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticCache | SlotView,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [n, H] of input_ids [n] at position_ids [n] on top of a one-sequence cache,
        which then holds them too. Attention: every cached position, and among the new tokens
        `tree_mask` (bool [n, n], row i true on what token i sees) or causal order when None."""
        return self.forward_tapped(input_ids, position_ids, cache, tree_mask)[0]

    @torch.inference_mode()
    def forward_tapped(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticCache | SlotView,
                       tree_mask: torch.Tensor | None = None, taps: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the residual stream entering each layer of `taps` ([T, n, H], None when none)."""
        n = int(input_ids.shape[0])
        past = cache.get_seq_length()
        if isinstance(cache, StaticCache):
            cache.reserve(n)
        mask = self.attention_mask(n, past, tree_mask)
        tapped: dict[int, torch.Tensor] = {}
        hidden = self._layers(input_ids[None].to(self.device), position_ids[None].to(self.device), cache, mask,
                              taps, tapped)
        cache.advance(n)
        return hidden[0], (torch.stack([tapped[t][0] for t in taps]) if taps else None)  # [n, H], [T, n, H]

    def attention_mask(self, n: int, past: int, tree_mask: torch.Tensor | None) -> torch.Tensor | None:
        """What n new tokens after `past` cached ones see, as `_layers` takes it: every cached position,
        and among the new ones `tree_mask` (bool [n, n]) or causal order; None for one token."""
        if n == 1:
            return None
        inner = tree_mask.to(self.device) if tree_mask is not None else torch.ones(
            n, n, dtype=torch.bool, device=self.device).tril_()  # [n, n]
        visible = torch.ones(n, past + n, dtype=torch.bool, device=self.device)  # [n, past+n]
        visible[:, past:] = inner
        group = self.num_heads // self.kv_heads
        return visible.repeat(group, 1)[None, None]  # [1, 1, group*n, past+n] rows follow the folded query

    @torch.inference_mode()
    def forward_slots(self, input_ids: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """One batched decoding step: token input_ids[b] appended to slot b at its own length.
        Returns hidden [B, H]."""
        return self.forward_slots_tapped(input_ids, cache)[0]

    @torch.inference_mode()
    def forward_slots_tapped(self, input_ids: torch.Tensor, cache: SlotCache, taps: tuple[int, ...] = ()
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_slots`, plus the residual stream entering each layer of `taps` ([T, B, H], None
        when none): what an EAGLE-style drafter trains on, captured while generating."""
        step = SlotStep(cache)  # brings its own per-group masks
        tapped: dict[int, torch.Tensor] = {}
        hidden = self._layers(input_ids[:, None].to(self.device), step.at[:, None], step, None, taps, tapped)
        step.advance()
        return hidden[:, 0], (torch.stack([tapped[t][:, 0] for t in taps]) if taps else None)  # [B, H], [T, B, H]

    def prefill_slot(self, input_ids: torch.Tensor, view: SlotView, taps: tuple[int, ...] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt input_ids [n] into one slot of batched generation (causal, from position 0):
        hidden [n, H] and the tapped residual streams [T, n, H] (None when no taps)."""
        return self.forward_tapped(input_ids, torch.arange(int(input_ids.shape[0])), view, taps=taps)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden [..., H]: [..., V] in the model's precision."""
        return self.lm_head(hidden)

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, kv, mask: torch.Tensor | None,
                taps: tuple[int, ...] = (), tapped: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Final normed hidden [B, n, H]; `tapped[i]`: the residual entering layer i, for each i in `taps`."""
        x = F.embedding(ids, self.embed)  # [B, n, H]
        cos = self.cos[positions][:, :, None]  # [B, n, 1, d]
        sin = self.sin[positions][:, :, None]
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped[index] = x
            x = x + self._attention(index, layer, self._norm(x, layer.attn_norm),
                                    cos, sin, kv, mask)
            h = self._norm(x, layer.mlp_norm)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)  # [B, n, I] each
            x = x + layer.down(F.silu(gate) * up)
        return self._norm(x, self.final_norm)  # [B, n, H]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMS norm as transformers rounds it: normalised in fp32, cast back, then scaled (in fp32
        all of that is one fused op)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
        return weight * F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(x.dtype)

    def _attention(self, index: int, layer: FusedLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv, mask: torch.Tensor | None) -> torch.Tensor:
        batch, n, _ = h.shape
        d, heads, kv_heads = self.head_dim, self.num_heads, self.kv_heads
        group = heads // kv_heads
        q, k, v = layer.qkv(h).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q = _rotate(q.view(batch, n, heads, d), cos, sin)  # [B, n, heads, d]
        k = _rotate(k.view(batch, n, kv_heads, d), cos, sin)  # [B, n, kvh, d]
        v = v.view(batch, n, kv_heads, d)
        # query head h reads K/V head h // group: fold each group onto its K/V head, no copies of K/V
        folded = q.view(batch, n, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * n, d)
        attended = kv.attend(index, folded, k.transpose(1, 2), v.transpose(1, 2), mask, self.scale)
        attended = attended.view(batch, kv_heads, group, n, d).permute(0, 3, 1, 2, 4).reshape(batch, n, heads * d)
        return layer.out(attended)

    # -- kernel choice --------------------------------------------------------------------------
    def kernel_key(self) -> str:
        """What a kernel choice depends on: the machine, torch, threads, precision and the shapes."""
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else cpu_name()
        shapes = [tuple(m.weight.shape) for m in self.matmuls()[:4]] + [tuple(self.lm_head.weight.shape)]
        text = json.dumps(["per-role kernels", device, torch.__version__, torch.get_num_threads(), str(self.dtype), len(self.layers),
                           shapes])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def load_or_choose_kernels(self, folder: Path) -> None:
        """Apply the kernel choice cached for this machine in `folder`, or measure it (a few
        seconds for the shipped model) and cache it if it was measured quietly (a reference
        timing before and after agrees with the same timing inside the choice: a choice made beside
        a running job would cache mkldnn where it is slow).
        An unwritable folder only costs a re-measure."""
        path = folder / f"{self.kernel_key()}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            kernels = {role: {int(bucket): kernel for bucket, kernel in chosen.items()}
                       for role, chosen in saved.get("kernels", {}).items()}
            if set(kernels) == set(self.roles()) and all(set(k) == set(ROW_BUCKETS) for k in kernels.values()):
                for role, chosen in kernels.items():
                    self.apply_kernels(chosen, role)
                self.kernel_report = saved.get("ms", {})
                return
        before = self._reference_ms()
        report = self.choose_kernels()
        after = self._reference_ms()
        chosen = {role: fastest(by_bucket) for role, by_bucket in report.items()}
        if not measured_quietly(before, after, report["gate_up"][REFERENCE_BUCKET]["linear"]):
            log.warning("kernel choice measured on a busy machine: used for this run, not cached")
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"kernels": chosen, "ms": report}, indent=1))
        except OSError as error:
            log.warning("could not cache the kernel choice in %s: %s", folder, error)

    def _reference_ms(self) -> float:
        """One piece of the kernel timing, repeated around it: gate/up products of 8 rows by `linear`."""
        return _time_kernel(self.roles()["gate_up"], "linear", REFERENCE_BUCKET,
                            BUCKET_TIMING_ROWS[REFERENCE_BUCKET], repeats=KERNEL_REPEATS)

    def roles(self) -> dict[str, list[Matmul]]:
        """The projections by role (each role's weights share a shape): q/k/v, output, gate/up,
        down, and the vocabulary projection."""
        return {"qkv": [layer.qkv for layer in self.layers], "out": [layer.out for layer in self.layers],
                "gate_up": [layer.gate_up for layer in self.layers], "down": [layer.down for layer in self.layers],
                "lm_head": [self.lm_head]}

    def apply_kernels(self, kernels: dict[int, str], role: str | None = None) -> None:
        """Use `kernels` (row bucket -> kernel name) for the projections of `role` (None: all); the
        mkldnn copy of a weight is kept only where some bucket uses it."""
        for m in self.roles()[role] if role else self.matmuls():
            m.use_kernels(kernels)

    def matmuls(self) -> list[Matmul]:
        return [m for layer in self.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down)] + [self.lm_head]

    def choose_kernels(self, repeats: int = KERNEL_REPEATS) -> dict[str, dict[int, dict[str, float]]]:
        """For each role and row bucket, time every available kernel over that role's projections
        in all layers (the weights come from memory, as in a forward) and keep the fastest: the
        best GEMV for a square weight is not the best for the vocabulary projection. Returns the
        measured ms per role, bucket and kernel (also kept in `kernel_report`)."""
        report = {role: time_kernels(matmuls, BUCKET_TIMING_ROWS, repeats)
                  for role, matmuls in self.roles().items()}
        for role, by_bucket in report.items():
            self.apply_kernels(fastest(by_bucket), role)
        self.kernel_report = report
        log.info("lean forward kernels: %s", {role: fastest(by_bucket) for role, by_bucket in report.items()})
        return report


class OnLeanForward:
    """What an exact engine leaves to the lean forward it wraps (`self.lean`) unless it has its own
    (the CPU engine does): batched generation's slots, and any forward over one of their slots. The
    engine supplies `forward_tapped`."""

    lean: LeanLlama

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticCache | SlotView,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [n, H] of input_ids [n] at position_ids [n] on top of `cache`, which then
        holds them too; among the new tokens `tree_mask` (bool [n, n]) or causal order. Computed in
        fp32, returned in the model's precision (what its heads read; a plain step rounds alike)."""
        if isinstance(cache, SlotView):  # a slot of the lean forward's batched generation
            return self.lean.forward(input_ids, position_ids, cache, tree_mask)
        return self.forward_tapped(input_ids, position_ids, cache, tree_mask)[0]

    def new_slots(self, slots: int, capacity: int) -> SlotCache:
        return self.lean.new_slots(slots, capacity)

    def forward_slots(self, input_ids: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """Batched generation (data generation) on the lean forward."""
        return self.lean.forward_slots(input_ids, cache)

    def forward_slots_tapped(self, input_ids: torch.Tensor, cache: SlotCache, taps: tuple[int, ...] = ()
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.lean.forward_slots_tapped(input_ids, cache, taps)

    def prefill_slot(self, input_ids: torch.Tensor, view: SlotView, taps: tuple[int, ...] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.lean.prefill_slot(input_ids, view, taps)


def time_kernels(matmuls: list[Matmul], rows_by_bucket: dict[int, int], repeats: int = KERNEL_REPEATS
                 ) -> dict[int, dict[str, float]]:
    """Median ms of every kernel available for `matmuls` (one weight shape, one precision) at each
    row bucket (timed with `rows_by_bucket[bucket]` rows); packs the weights when mkldnn is a candidate."""
    weight = matmuls[0].weight
    candidates = ["linear", "wxt"]
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and weight.dtype == torch.float32:
        candidates.append("mkldnn")
        for m in matmuls:
            m.pack()
    return {bucket: {kernel: _time_kernel(matmuls, kernel, bucket, rows, repeats) for kernel in candidates}
            for bucket, rows in rows_by_bucket.items()}


def fastest(times: dict[int, dict[str, float]]) -> dict[int, str]:
    """The fastest kernel per row bucket of a `time_kernels` report."""
    return {bucket: min(by_kernel, key=by_kernel.get) for bucket, by_kernel in times.items()}


def _time_kernel(matmuls: list[Matmul], kernel: str, bucket: int, rows: int, repeats: int) -> float:
    """Median ms of all `matmuls` on `rows` rows with `kernel` (exceptions count as infinitely slow)."""
    saved = [m.kernels.get(bucket) for m in matmuls]
    inputs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1], dtype=m.weight.dtype, device=m.weight.device)
              for m in matmuls}  # [rows, in] per input width

    def run_all() -> None:
        for m in matmuls:
            m(inputs[m.weight.shape[1]])

    try:
        for m in matmuls:
            m.kernels[bucket] = kernel
        return median_ms(run_all, repeats, matmuls[0].weight.device)
    except RuntimeError as error:
        log.warning("kernel %s failed for %d rows: %s", kernel, rows, error)
        return float("inf")
    finally:
        for m, old in zip(matmuls, saved):
            if old is None:
                m.kernels.pop(bucket, None)
            else:
                m.kernels[bucket] = old


def _share_rows(linears: tuple[nn.Linear, ...], fused: torch.Tensor) -> None:
    """Point each linear's weight at its block of rows of `fused` (a view: no second copy)."""
    start = 0
    with torch.no_grad():
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
            start += rows


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it: x * cos + rotate_half(x) * sin (x [B, n, heads, d])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
