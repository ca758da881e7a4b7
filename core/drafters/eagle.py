"""An EAGLE-style drafter: one decoder layer that drafts at the feature level (after Li et al.,
EAGLE 2024, EAGLE-2 2024 and EAGLE-3 2025).

Where Medusa's and Hydra's heads read the last hidden state, the draft layer reads a fusion of
three of the base model's states at every position of the answer so far: the residual stream
entering layer 2 (low), entering the middle layer (mid), and the final normed hidden state (high):

    g_t   = Fuse([low_t; mid_t; high_t])                             the base model's view of t
    s_t   = DecoderLayer(g_t, reading [norm(e(x_{t+1})); norm(g_t)] | the keys and values before t)
    logits of token t+2 = lm_head_draft(norm(s_t))                    the base's frozen lm_head rows

EAGLE-3's layer: queries, keys and values read the token's embedding beside the state, and the state
is the residual stream. It drafts beyond the first token by feeding its own output state back in
place of the features the base model has not computed yet: depth d+1 reads (s of its parent, e(its own
token)) at position t+d and attends to the answer's cached keys plus its ancestors' draft keys.
It predicts tokens directly (EAGLE-3 dropped EAGLE-1's feature regression), and it is trained
with "training-time test": fed its own states for several steps (`offline.train_eagle`), so
drafting for itself is what it learned.

The tree is grown as EAGLE-2 grows it: depth by depth, the `beam` best nodes by joint draft
probability expanded by one batched layer call, then the `budget` best nodes of everything grown
(`core.drafters.grown`); growth stops early where no deeper node could enter that cut. Below depth 2 a
node's children are ranked over the 2,048 most frequent draft tokens only: a quarter of the deep
projections' cost (a 16- or 64-node propose about a fifth cheaper on a 2-core EPYC) for the same
tokens per step (30 held-out MT-Bench answers: 1.98 / 2.10 / 2.23 at 16 / 32 /
64 nodes against 1.97 / 2.10 / 2.23 with all 8,192 rows; 1,024 rows lost .02 at 32 nodes).

The layer's keys and values over the accepted positions are kept per session
(`core.drafters.layers.KVRows`, a new one per extension: a fork shares the old); a rejected draft
node never enters it, so nothing is rolled back.

On-disk format (`assets/eagle/`): `config.json` (EagleConfig, "family": "eagle") and
`layer.safetensors` (the module's state dict, `draft_vocab` among it).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from core.drafters.grown import GrownNode, GrownTree, Growth, deeper_could_enter, expand
from core.drafters.interface import drafting_embedding, heads_for_drafting
from core.drafters.layers import (KVRows, RMSNorm, appended, linears_on_kernels, native_products, read_weights,
                                  save_weights)
from core.drafters.medusa import DraftProjection, draft_rows, ranked
from core.model import REPO_ROOT

if TYPE_CHECKING:
    from core.drafters.interface import DraftContext
    from core.model import BaseModel

DEFAULT_EAGLE_DIR = REPO_ROOT / "assets" / "eagle"
EAGLE_BEAM = 8  # nodes expanded per depth
EAGLE_DEPTH = 6  # the deepest draft
EAGLE_FULL_DEPTHS = 2  # depths whose guesses rank the whole draft vocabulary ...
EAGLE_DEEP_ROWS = 2048  # ... deeper ones its most frequent rows only (module docstring)


def eagle_taps(num_layers: int) -> tuple[int, int]:
    """The residual streams the draft layer reads besides the final hidden state: those entering
    layer 2 (low; the last layer of a smaller model) and the middle layer (mid), as EAGLE-3 picks them."""
    return min(2, num_layers - 1), num_layers // 2


@dataclass(frozen=True)
class EagleConfig:
    """Shape of a draft layer (a decoder layer shaped like the base model's)."""

    hidden_size: int = 576
    num_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1536
    vocab_size: int = 49152
    draft_vocab_size: int = 8192
    taps: tuple[int, ...] = (2, 15)
    rope_theta: float = 100000.0
    eps: float = 1e-5
    base_model: str = "SmolLM2-135M-Instruct"

    def __post_init__(self) -> None:
        object.__setattr__(self, "taps", tuple(self.taps))
        if self.num_heads % self.kv_heads:
            raise ValueError(f"{self.num_heads} attention heads do not share {self.kv_heads} key/value heads evenly")


class EagleLayer(nn.Module):
    """The draft layer (module docstring). Decoding: `extend` then `draft`; training: `ttt_states`."""

    family = "eagle"  # the family these weights draft for (core.families)
    projects_once = False  # each depth multiplies its own rows of the draft projection
    max_depth = EAGLE_DEPTH  # the deepest draft it grows

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.fuse = nn.Linear(3 * h, h, bias=False)
        self.embed_norm, self.attn_norm, self.mlp_norm, self.out_norm = (RMSNorm(h, config.eps) for _ in range(4))
        # queries, keys and values read [norm(token embedding); norm(state)]: 2H wide, as EAGLE-3's layer
        self.q = nn.Linear(2 * h, config.num_heads * d, bias=False)
        self.kv = nn.Linear(2 * h, 2 * config.kv_heads * d, bias=False)
        self.o = nn.Linear(config.num_heads * d, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * config.intermediate, bias=False)
        self.down = nn.Linear(config.intermediate, h, bias=False)
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        inv = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
        self.register_buffer("inv_freq", inv, persistent=False)

    # -- pieces -----------------------------------------------------------------------------------
    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., 3H] (low | mid | high) -> g [..., H]."""
        return self.fuse(features)

    def _rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., 1, n, d] of positions [..., n] (the two-halves convention), computed once
        for the queries and the keys."""
        angles = positions[..., None].float() * self.inv_freq  # [..., n, d/2]
        angles = torch.cat([angles, angles], dim=-1)[..., None, :, :]  # [..., 1, n, d]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _qkv(self, states: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """states [..., n, H] (g, or a parent's output) and the embeddings of the tokens read with them
        [..., n, H] -> q [..., heads, n, d], k and v [..., kv_heads, n, d] (q, k rotated)."""
        c = self.config
        h = torch.cat([self.embed_norm(token_embeds.to(states.dtype)), self.attn_norm(states)], dim=-1)  # [..., n, 2H]
        q = self.q(h).unflatten(-1, (c.num_heads, c.head_dim)).transpose(-3, -2)
        k, v = (part.unflatten(-1, (c.kv_heads, c.head_dim)).transpose(-3, -2)
                for part in self.kv(h).chunk(2, dim=-1))
        cos, sin = self._rotation(positions, q.dtype)
        return _rotated(q, cos, sin), _rotated(k, cos, sin), v

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x [..., n, H] plus the attention output [..., heads, n, d], then the MLP."""
        x = x + self.o(attended.transpose(-3, -2).flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def draft_states(self, states: torch.Tensor) -> torch.Tensor:
        """What the draft projection reads: the normed output state."""
        return self.out_norm(states)

    def _grouped(self, kv: torch.Tensor) -> torch.Tensor:
        """[..., kv_heads, n, d] -> [..., heads, n, d] (each key/value head serves its group; training)."""
        return kv.repeat_interleave(self.config.num_heads // self.config.kv_heads, dim=-3)

    # -- decoding -----------------------------------------------------------------------------------
    def extend(self, cache: KVRows | None, features: torch.Tensor, next_embeds: torch.Tensor, *,
               last_only: bool = False) -> tuple[torch.Tensor, KVRows]:
        """Accepted positions (features [n, 3H], embeddings of the tokens after them [n, H]) after
        `cache` -> (their output states [n, H], the longer cache). `last_only`: the last position's
        state alone ([1, H]; every position's keys and values still enter the cache), what drafting reads."""
        start = cache.length if cache is not None else 0
        x = self.fused(features)  # [n, H]
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        q, k, v = self._qkv(x, next_embeds, positions)
        cache = appended(cache, k, v)  # [kvh, total, d]
        if last_only:  # the last row sees every position
            visible = torch.ones(1, cache.length, dtype=torch.bool, device=x.device)
            return self._finish(x[-1:], _grouped_attention(q[:, -1:], cache.keys, cache.values, visible)), cache
        new, total = x.shape[0], cache.length
        allowed = torch.ones(new, total, dtype=torch.bool, device=x.device).tril(total - new)  # [n, total]
        return self._finish(x, _grouped_attention(q, cache.keys, cache.values, allowed)), cache

    def draft(self, cache: KVRows, parent_states: torch.Tensor, token_embeds: torch.Tensor,
              depth: int, draft_keys: tuple[torch.Tensor, torch.Tensor] | None, ancestors: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One depth of draft nodes: parent states [B, H], their tokens' embeddings [B, H], at
        position cache.length - 1 + depth; each sees the cache, the draft keys (k, v [kvh, M, d])
        `ancestors` [B, M] marks, and itself. Returns (states [B, H], keys, values [kvh, B, d])."""
        x = parent_states  # [B, H]
        positions = torch.full((x.shape[0],), cache.length - 1 + depth, device=x.device)
        q, k, v = self._qkv(x, token_embeds, positions)  # [h, B, d], [kvh, B, d]
        batch = x.shape[0]
        # beyond the cache (which every row sees whole) each row sees its marked ancestors, then
        # itself (its own key only): the draft keys are few, the cache is not copied
        draft_k = k if draft_keys is None else torch.cat([draft_keys[0], k], dim=1)  # [kvh, M + B, d]
        draft_v = v if draft_keys is None else torch.cat([draft_keys[1], v], dim=1)
        visible = torch.cat([ancestors, torch.eye(batch, dtype=torch.bool, device=x.device)], dim=1)  # [B, M + B]
        attended = _two_part_attention(q, cache, (draft_k, draft_v), visible)
        return self._finish(x, attended), k, v

    # -- training -------------------------------------------------------------------------------------
    def ttt_states(self, features: torch.Tensor, lengths: torch.Tensor, steps: int,
                   read_tokens: Callable[[int, torch.Tensor | None], torch.Tensor]) -> list[torch.Tensor]:
        """Training-time test over answers: features [B, T, 3H] (row t: the base model's states that
        predicted answer[t]), lengths [B]. Step 1 reads the features at t with the embedding of answer[t]
        and predicts answer[t+1]; step j reads step j-1's output at t with the embedding
        `read_tokens(j, that output)` [B, T, H] gives (answer[t+j-1] given the path, or step j-1's
        own guess), at position t+j-1, and sees step 1's keys up to t plus its own chain's keys of
        steps 2..j: what drafting depth j sees. Returns each step's output states [B, T, H]."""
        batch, length, _ = features.shape
        positions = torch.arange(length, device=features.device).expand(batch, length)  # [B, T]
        keys_ok = positions < lengths[:, None]  # [B, T]
        causal = torch.ones(length, length, dtype=torch.bool, device=features.device).tril()  # [T, T]
        allowed = causal & keys_ok[:, None, None, :]  # [B, 1, T, T]
        states = self.fused(features)  # [B, T, H]
        outputs, chain_k, chain_v = [], [], []
        base_k = base_v = None
        for step in range(1, steps + 1):
            x = states  # [B, T, H]
            q, k, v = self._qkv(x, read_tokens(step, outputs[-1] if outputs else None), positions + step - 1)
            if step == 1:
                base_k, base_v = self._grouped(k), self._grouped(v)
                attended = F.scaled_dot_product_attention(q, base_k, base_v, attn_mask=allowed)
            else:
                chain_k.append(self._grouped(k))
                chain_v.append(self._grouped(v))
                attended = _chain_attention(q, base_k, base_v, chain_k, chain_v, allowed)
            states = self._finish(x, attended)
            outputs.append(states)
        return outputs

    # -- files ------------------------------------------------------------------------------------------
    def draft_projection(self, lm_head: nn.Module) -> DraftProjection:
        """The lm_head rows the layer ranks at each depth: all of its draft vocabulary for the first
        EAGLE_FULL_DEPTHS, its EAGLE_DEEP_ROWS most frequent tokens below."""
        rows = len(self.draft_vocab)
        deep = min(rows, EAGLE_DEEP_ROWS)
        per_depth = (rows,) * EAGLE_FULL_DEPTHS + (deep,) * (EAGLE_DEPTH - EAGLE_FULL_DEPTHS)
        return draft_rows(lm_head, self.draft_vocab, per_depth)

    def save(self, folder: Path) -> None:
        """`layer.safetensors` + `config.json`."""
        save_weights(folder, "layer.safetensors", self.state_dict(), self.config, self.family)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, n, d] rotated by `EagleLayer._rotation`'s cos and sin."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention of q [heads, n, d] over k, v [kv_heads, total, d] where visible [n, total] allows;
    query head h reads key/value head h // (heads / kv_heads). Written out for decoding's few rows:
    SDPA's general path (a boolean mask, grouped heads) costs several times these few products."""
    heads, rows, dim = q.shape
    kv_heads, total = k.shape[0], k.shape[1]
    grouped = (q * dim ** -0.5).reshape(kv_heads, heads // kv_heads * rows, dim)  # [kvh, g * n, d]
    scores = (grouped @ k.transpose(-1, -2)).view(kv_heads, heads // kv_heads, rows, total)  # [kvh, g, n, total]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return (weights.view(kv_heads, -1, total) @ v).view(heads, rows, dim)  # [heads, n, d]


def _two_part_attention(q: torch.Tensor, cache: KVRows, draft: tuple[torch.Tensor, torch.Tensor],
                        visible: torch.Tensor) -> torch.Tensor:
    """`_grouped_attention` of q [heads, n, d] over the whole cache, then the draft keys and values
    (k, v [kv_heads, M, d]) where visible [n, M] allows: the scores of both parts side by side, so the
    cache is read where it lies."""
    heads, rows, dim = q.shape
    kv_heads = cache.keys.shape[0]
    grouped = (q * dim ** -0.5).reshape(kv_heads, heads // kv_heads * rows, dim)  # [kvh, g * n, d]
    past = grouped @ cache.keys.transpose(-1, -2)  # [kvh, g * n, total]
    drafted = (grouped @ draft[0].transpose(-1, -2)).view(kv_heads, -1, rows, visible.shape[1])  # [kvh, g, n, M]
    drafted = drafted.masked_fill(~visible, float("-inf")).view(kv_heads, heads // kv_heads * rows, -1)
    weights = torch.cat([past, drafted], dim=-1).softmax(dim=-1)  # [kvh, g * n, total + M]
    attended = weights[..., :cache.length] @ cache.values + weights[..., cache.length:] @ draft[1]
    return attended.view(heads, rows, dim)  # [heads, n, d]


def _chain_attention(q: torch.Tensor, base_k: torch.Tensor, base_v: torch.Tensor, chain_k: list[torch.Tensor],
                     chain_v: list[torch.Tensor], allowed: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, h, T, d] over step 1's keys (causal, `allowed` [B, 1, T, T]) and, at each
    row, the same row's keys of the chain's later steps (each [B, h, T, d])."""
    scale = q.shape[-1] ** -0.5
    scores = (q @ base_k.transpose(-1, -2)) * scale  # [B, h, T, T]
    scores = scores.masked_fill(~allowed, float("-inf"))
    diagonal = torch.stack([(q * k).sum(-1) * scale for k in chain_k], dim=-1)  # [B, h, T, j-1]
    weights = torch.softmax(torch.cat([scores, diagonal], dim=-1), dim=-1)
    length = base_k.shape[-2]
    out = weights[..., :length] @ base_v  # [B, h, T, d]
    for i, v in enumerate(chain_v):
        out = out + weights[..., length + i, None] * v
    return out


def init_from_base(layer: EagleLayer, base_model: nn.Module) -> None:
    """Start the decoder part from the base model's last layer (its query, key, value and MLP input
    maps on the state's half, the token's half at zero) and the output norm from the base's final
    norm; the fusion starts by passing the high feature alone and the layer's output maps at zero,
    so a fresh layer predicts what the base model did at t: a sane first loss."""
    last = base_model.model.layers[-1]
    attn, mlp = last.self_attn, last.mlp
    size = layer.config.hidden_size
    with torch.no_grad():
        layer.fuse.weight.zero_()
        layer.fuse.weight[:, 2 * size:].copy_(torch.eye(size))
        layer.q.weight.zero_()
        layer.q.weight[:, size:].copy_(attn.q_proj.weight)
        layer.kv.weight.zero_()
        layer.kv.weight[:, size:].copy_(torch.cat([attn.k_proj.weight, attn.v_proj.weight]))
        layer.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        # the outputs of attention and MLP start at zero: a fresh layer passes its input through
        # (the base's last layer adds ~20x the input's RMS to a normed state: noise at step one)
        layer.o.weight.zero_()
        layer.down.weight.zero_()
        layer.attn_norm.weight.copy_(last.input_layernorm.weight)
        layer.mlp_norm.weight.copy_(last.post_attention_layernorm.weight)
        layer.out_norm.weight.copy_(base_model.model.norm.weight)


def load_eagle(folder: Path = DEFAULT_EAGLE_DIR, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> EagleLayer:
    """A draft layer saved by `EagleLayer.save`."""
    fields, state = read_weights(folder, "layer.safetensors", EagleLayer.family)
    layer = EagleLayer(EagleConfig(**fields))
    layer.load_state_dict(state)
    return layer.to(device=device, dtype=dtype).eval().requires_grad_(False)


def default_eagle(*, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> EagleLayer | None:
    """The shipped draft layer, or None when none is shipped."""
    if not (DEFAULT_EAGLE_DIR / "layer.safetensors").exists():
        return None
    return load_eagle(DEFAULT_EAGLE_DIR, dtype=dtype, device=device)


def shipped_eagle(base: BaseModel) -> tuple[EagleLayer | None, str]:
    """The shipped draft layer in `base`'s dtype and device, with a line for the header: the family table's loader."""
    layer = default_eagle(dtype=base.dtype, device=base.device)
    return layer, ("an EAGLE draft layer from assets/eagle" if layer is not None else "")


@dataclass(frozen=True)
class NativeEagle:
    """A draft layer whose products all run on the exact engine's kernels, so that each depth is one
    native call (`eagle_depth`: the layer over the frontier rows, the projection of its normed output
    and each row's top guesses) instead of some forty torch operators on a few rows; fp32."""

    kernels: ModuleType
    layer: EagleLayer
    weights: tuple[object, ...]  # fuse, q, kv, o, gate_up, down (`eagle_depth` reads all but fuse)
    projections: tuple[object, ...]  # per depth 1..EAGLE_DEPTH: the rows it ranks

    @classmethod
    def of(cls, layer: EagleLayer, projection: DraftProjection) -> "NativeEagle | None":
        """The kernel weights of `layer` (a drafting copy from `linears_on_kernels`) and `projection`,
        or None where they cannot draft natively (`core.drafters.layers.native_products`)."""
        linears = [layer.fuse, layer.q, layer.kv, layer.o, layer.gate_up, layer.down]
        rows = [projection.products.get(projection.rows_at(d)) for d in range(1, EAGLE_DEPTH + 1)]
        products = native_products(linears + rows, [layer.config.head_dim, layer.config.hidden_size])
        if products is None:
            return None
        weights = [product.weight for product in products]
        return cls(kernels=products[0].kernels, layer=layer, weights=tuple(weights[:len(linears)]),
                   projections=tuple(weights[len(linears):]))

    def extend(self, cache: KVRows | None, features: torch.Tensor, next_embeds: torch.Tensor
               ) -> tuple[torch.Tensor, KVRows]:
        """`EagleLayer.extend(..., last_only=True)` as one native call: the last position's state [1, H]
        and the longer cache (its keys and values written where they are kept)."""
        layer, config = self.layer, self.layer.config
        cache = cache or KVRows.empty(config.kv_heads, config.head_dim)
        store = cache.room_for(features.shape[0])
        positions = torch.arange(cache.length, cache.length + features.shape[0])
        cos, sin = layer._rotation(positions, torch.float32)  # [1, n, d] each
        norms = [layer.embed_norm.weight, layer.attn_norm.weight, layer.mlp_norm.weight]
        last = self.kernels.eagle_extend(features, next_embeds, cos[0], sin[0], store.keys, store.values,
                                         cache.length, norms, list(self.weights), config.num_heads, config.eps)  # [H]
        return last[None].to(features.dtype), cache.written(store, features.shape[0])

    def depth(self, cache: KVRows, parents: torch.Tensor, embeds: torch.Tensor, depth: int,
              draft: tuple[torch.Tensor, torch.Tensor] | None, ancestors: torch.Tensor, width: int
              ) -> tuple[torch.Tensor, ...]:
        """`EagleLayer.draft` at `depth` (parents, embeds [B, H]; draft keys and values [kvh, M, d] that
        `ancestors` [B, M] marks), then the top `width` of the projection for depth + 1: (states [B, H],
        keys, values [kvh, B, d], probabilities [B, width], projection rows [B, width])."""
        layer, config = self.layer, self.layer.config
        cos, sin = layer._rotation(torch.tensor([cache.length - 1 + depth]), torch.float32)  # [1, 1, d] each
        none = cache.keys.new_zeros(cache.keys.shape[0], 0, cache.keys.shape[2])  # [kvh, 0, d]
        draft_k, draft_v = draft if draft is not None else (none, none)
        norms = [layer.embed_norm.weight, layer.attn_norm.weight, layer.mlp_norm.weight, layer.out_norm.weight]
        return self.kernels.eagle_depth(
            parents, embeds, cos.flatten(), sin.flatten(), cache.keys.float(), cache.values.float(), draft_k,
            draft_v, ancestors, norms, list(self.weights[1:]), self.projections[depth], config.num_heads, width,
            config.eps)  # projections[depth]: the rows depth + 1 ranks

    def root(self, state: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The root's children as one native call: the top `width` of depth 1's projection of the normed
        state [H] (`draft_states`): (probabilities [1, width], projection rows [1, width])."""
        return self.kernels.normed_guesses(state[None], self.layer.out_norm.weight, self.projections[0], width,
                                           self.layer.config.eps)


@torch.inference_mode()
def grow_eagle_nodes(layer: EagleLayer, embed: nn.Embedding, projection: DraftProjection, cache: KVRows,
                     root_state: torch.Tensor, *, budget: int, width: int, beam: int, depth: int,
                     native: NativeEagle | None = None) -> Growth:
    """EAGLE-2's expansion: the root's children from `root_state` [H] (the layer's output at the last
    accepted position, which read the root token), then depth by depth the `beam` best nodes by
    joint probability expanded by one batched `draft` call (`width` children of the root, `min(width,
    beam)` of every other node), until `depth` or until no deeper node could enter the `budget` best
    (`deeper_could_enter`)."""
    dtype = root_state.dtype
    if native is not None:
        probs, rows = native.root(root_state, width)  # [1, width] each
        ids = projection.vocabulary_ids(rows)
    else:
        root_logits = projection.logits(layer.draft_states(root_state[None]), 1)  # [1, rows at depth 1]
        probs, ids = ranked(root_logits, width, projection)  # [1, width]
    level = expand([GrownNode(path=(), tokens=(), score=1.0)], probs.tolist(), ids.tolist(), budget=budget)
    growth = Growth(nodes=list(level), greedy_probs=[probs[0]], greedy_ids=[ids[0]])
    parent_state = {(): root_state}
    draft_k = draft_v = None
    index_of: dict[tuple[int, ...], int] = {}  # a node's row among the draft keys
    for level_depth in range(1, depth):
        frontier = sorted(level, key=lambda n: -n.score)[: min(beam, budget)]
        if not deeper_could_enter(frontier, growth.nodes, budget):
            break
        states = torch.stack([parent_state[n.path[:-1]] for n in frontier])  # [B, H]
        embeds = embed(torch.tensor([n.tokens[-1] for n in frontier], device=root_state.device)).to(dtype)  # [B, H]
        known = 0 if draft_k is None else draft_k.shape[1]
        ancestors = torch.zeros(len(frontier), known, dtype=torch.bool, device=root_state.device)
        for row, node in enumerate(frontier):
            for d in range(1, len(node.path)):
                ancestors[row, index_of[node.path[:d]]] = True
        drafted = None if draft_k is None else (draft_k, draft_v)
        if native is not None:
            out, k, v, probs, rows = native.depth(cache, states, embeds, level_depth, drafted, ancestors,
                                                  min(width, beam))  # [B, H], [kvh, B, d] x 2, [B, children] x 2
            ids = projection.vocabulary_ids(rows)
        else:
            out, k, v = layer.draft(cache, states, embeds, level_depth, drafted, ancestors)
            probs, ids = ranked(projection.logits(layer.draft_states(out), level_depth + 1), min(width, beam),
                                projection)  # [B, children]
        for row, node in enumerate(frontier):
            index_of[node.path] = known + row
            parent_state[node.path] = out[row]
        draft_k = k if draft_k is None else torch.cat([draft_k, k], dim=1)
        draft_v = v if draft_v is None else torch.cat([draft_v, v], dim=1)
        level = expand(frontier, probs.tolist(), ids.tolist(), budget=budget)
        growth.nodes += level
        top = max(range(len(frontier)), key=lambda r: frontier[r].score)
        growth.greedy_probs.append(probs[top])
        growth.greedy_ids.append(ids[top])
    return growth


def grow_eagle_tree(layer: EagleLayer, embed: nn.Embedding, projection: DraftProjection, cache: KVRows,
                    root_state: torch.Tensor, *, budget: int, width: int, beam: int, depth: int,
                    native: NativeEagle | None = None) -> GrownTree:
    """EAGLE-2's tree: `grow_eagle_nodes`, then the `budget` best nodes of all (the rerank)."""
    return grow_eagle_nodes(layer, embed, projection, cache, root_state, budget=budget, width=width, beam=beam,
                            depth=depth, native=native).best(budget, kind="eagle")


class EagleDrafter:
    """The draft layer behind the drafter interface: keeps its cache over the accepted positions
    (extended each step with the features the verify forward tapped) and grows EAGLE-2's tree."""

    name = "eagle"
    reads_history = True  # the answer's features (`DraftContext.features`)

    def __init__(self, layer: EagleLayer, base: BaseModel, *, width: int, beam: int, depth: int, budget: int) -> None:
        drafting, self.projection, self.dtype = heads_for_drafting(layer, base, products_on_kernels=True)
        self.layer = linears_on_kernels(drafting, base)
        self.native = NativeEagle.of(self.layer, self.projection)
        self.embed = drafting_embedding(base, self.dtype)
        self.taps = layer.config.taps
        self.width, self.beam, self.depth, self.budget = width, beam, min(depth, EAGLE_DEPTH), budget
        self.cache: KVRows | None = None  # immutable: copy.copy of the drafter forks it safely
        self.seen_chunks = 0
        self.seen_rows = 0
        self.last_state: torch.Tensor | None = None

    @classmethod
    def for_session(cls, layer: object, base: BaseModel, config, fixed: object = None) -> "EagleDrafter":
        """The drafter of an eagle session (config: a `core.decoder.DecodeConfig`; a grown tree reads no
        fixed tree)."""
        if not isinstance(layer, EagleLayer):
            raise ValueError(f"strategy {config.strategy!r} needs an EAGLE draft layer")
        return cls(layer, base, width=config.top_m, beam=config.beam, depth=config.depth, budget=config.budget)

    def propose(self, context: DraftContext) -> GrownTree:
        """The grown tree of `budget` nodes (or `context.max_nodes` when fewer)."""
        budget = self.budget if context.max_nodes is None else max(1, min(self.budget, context.max_nodes))
        state = self._state(context)
        return grow_eagle_tree(self.layer, self.embed, self.projection, self.cache, state, budget=budget,
                               width=self.width, beam=self.beam, depth=min(self.depth, budget), native=self.native)

    @torch.inference_mode()
    def _state(self, context: DraftContext) -> torch.Tensor:
        """[H] the layer's output at the last accepted position (it read the root token)."""
        chunks = context.features
        if not chunks:
            raise ValueError("the EAGLE drafter needs the answer's tapped features (DraftContext.features)")
        if self.seen_chunks > len(chunks):  # a shorter history than the one cached: start over
            self.cache, self.seen_chunks, self.seen_rows = None, 0, 0
        if self.seen_chunks < len(chunks):
            fresh = torch.cat([c.to(self.dtype) for c in chunks[self.seen_chunks:]])  # [n, 3H]
            rows = self.seen_rows + fresh.shape[0]
            # history row i is followed by token i of the answer's last `rows` tokens (the root last)
            following = torch.tensor(list(context.tokens[len(context.tokens) - rows + self.seen_rows:]),
                                     device=fresh.device)  # [n]
            extend = self.native.extend if self.native is not None else partial(self.layer.extend, last_only=True)
            last, self.cache = extend(self.cache, fresh, self.embed(following))  # [1, H]
            self.seen_chunks, self.seen_rows, self.last_state = len(chunks), rows, last[0]
        return self.last_state

    def observe(self, proposed: object, verified_depths: Sequence[int], accepted_tokens: Sequence[int]) -> None:
        """The layer is frozen; its calibration lives in the adaptive budget."""
