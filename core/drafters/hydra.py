"""Hydra heads: draft heads that see the path they extend (after Ankner et al., 2024).

Medusa's head k guesses the token k+1 places ahead from the hidden state alone, so a deep
path multiplies guesses that never saw each other. Hydra's head k also reads the embeddings
of the k tokens before its guess on the path (the root token, the base model's own next
token, and the guesses at depths 1..k-1), so its guess is conditioned on that path:

    head k:  x = h + Mix_k([h; e(root); e(t_1); ...; e(t_{k-1})])     Mix_k zero-initialised
             x = ResBlock^L(x)                                           (x + SiLU(Linear(x)))
             logits = lm_head_draft(x)                                   the base's frozen lm_head,
                                                                         draft-vocabulary rows
A fresh head is exactly a Medusa head at identity; training teaches it to use the path.

The tree is grown by expansion (as EAGLE-2 grows and reranks its tree): depth by depth, one
batched head call over the frontier (the `beam` best nodes of the depth by joint score),
`width` children per frontier node scored parent score x conditional probability; the tree
is the `budget` best nodes of everything grown, which is prefix-closed because a child never
scores above its parent. The result is a `core.tree.CandidateTree` with a token table whose
column at depth d is a node's index among that depth's kept nodes (not a rank: Hydra's
children depend on their parent), so grafting, verification, acceptance and the KV commit
are the ones every tree uses.

Optional (Hydra++, `HydraConfig.prefix_layer`): a prefix-attention layer, one causal decoder
layer (attention without positional encoding, then a gated MLP, each zero-initialised on its
output so a fresh layer is the identity) over the base model's hidden states of the answer so
far, from the one that predicted its first token; its output at the last position replaces `h`
above, so every head sees more than the last hidden state. At decode time the drafter keeps the
layer's keys and values (`core.drafters.layers.KVRows`) and extends them with each step's accepted
positions: a rejected node never enters, so nothing is rolled back.

On-disk format (`assets/hydra/`): `config.json` (HydraConfig) and `heads.safetensors` with
`heads.{k}.mix.weight/bias`, `heads.{k}.blocks.{l}.linear.weight/bias`, `draft_vocab`
(the token ids the heads rank, most frequent first) and, with the prefix layer,
`prefix.{attn_norm,mlp_norm}.weight`, `prefix.{qkv,out,gate_up,down}.weight`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Sequence

import torch
from torch import nn

from core.drafters.interface import Chain, DraftContext, Proposal, check_heads, drafting_embedding, heads_for_drafting
from core.drafters.layers import (KVRows, RMSNorm, appended, linears_on_kernels, native_products, read_weights,
                                  save_weights, take_draft_vocab)
from core.drafters.medusa import DraftProjection, ResBlock, checked_depth_vocab, draft_rows, ranked
from core.model import REPO_ROOT, BaseModel
from core.drafters.grown import GrownNode, GrownTree, Growth, expand
from core.strategy import DEFAULT_BEAM
from core.tree import CandidateTree


DEFAULT_HYDRA_DIR = REPO_ROOT / "assets" / "hydra"
HYDRA_BEAM = DEFAULT_BEAM  # nodes expanded per depth (DecodeConfig.beam's default)


@dataclass(frozen=True)
class HydraConfig:
    """Shape of a set of Hydra heads."""

    num_heads: int = 4
    num_layers: int = 1
    hidden_size: int = 576
    vocab_size: int = 49152
    draft_vocab_size: int = 16384
    base_model: str = "SmolLM2-135M-Instruct"
    depth_vocab: tuple[int, ...] = ()  # rows of the draft vocabulary head d ranks (a prefix); (): all
    prefix_layer: bool = False  # Hydra++'s prefix attention over the answer's hidden states
    prefix_heads: int = 9  # its attention heads (hidden_size must divide by it)
    prefix_mlp: int = 1536  # its MLP's inner width

    def __post_init__(self) -> None:
        object.__setattr__(self, "depth_vocab", checked_depth_vocab(self.depth_vocab, self.num_heads,
                                                                    self.draft_vocab_size))


class HydraHead(nn.Module):
    """One head: the hidden state and `path_length` path-token embeddings -> a state to project."""

    def __init__(self, hidden_size: int, path_length: int, num_layers: int) -> None:
        super().__init__()
        self.mix = nn.Linear((path_length + 1) * hidden_size, hidden_size)
        nn.init.zeros_(self.mix.weight)
        nn.init.zeros_(self.mix.bias)
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])

    def forward(self, hidden: torch.Tensor, path_embeds: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], path_embeds [..., k, H] -> [..., H]."""
        mixed = torch.cat([hidden, path_embeds.flatten(-2)], dim=-1)  # [..., (k+1)H]
        return self.blocks(hidden + self.mix(mixed))


class PrefixLayer(nn.Module):
    """One causal decoder layer over hidden states (module docstring): x + Attn(norm x), then + MLP."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_size: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden size {hidden_size} does not divide into {num_heads} heads")
        self.num_heads = num_heads
        self.attn_norm, self.mlp_norm = RMSNorm(hidden_size), RMSNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.gate_up = nn.Linear(hidden_size, 2 * mlp_size, bias=False)
        self.down = nn.Linear(mlp_size, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)  # a fresh layer is the identity
        nn.init.zeros_(self.down.weight)

    def _queries_keys_values(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [..., T, H] -> q, k, v, each [..., heads, T, d]."""
        return tuple(part.unflatten(-1, (self.num_heads, -1)).transpose(-3, -2)
                     for part in self.qkv(self.attn_norm(hidden)).chunk(3, dim=-1))

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.out(attended.transpose(-3, -2).flatten(-2))  # [..., T, H]
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)

    def forward(self, hidden: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Training / evaluation: hidden [B, T, H] (rows right-padded to `lengths`) -> [B, T, H];
        position t attends to positions <= t of its own row."""
        q, k, v = self._queries_keys_values(hidden)  # [B, h, T, d] each
        steps = hidden.shape[-2]
        allowed = torch.ones(steps, steps, dtype=torch.bool, device=hidden.device).tril()  # [T, T]
        if lengths is not None:  # padding is never a key (its own rows are discarded)
            keys = torch.arange(steps, device=hidden.device) < lengths.to(hidden.device)[:, None]  # [B, T]
            allowed = allowed & keys[:, None, None, :]  # [B, 1, T, T]
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # [B, h, T, d]
        return self._finish(hidden, attended)

    def native_extend(self, cache: KVRows | None, hidden: torch.Tensor) -> tuple[torch.Tensor, KVRows]:
        """`extend(cache, hidden, last_only=True)` as one native call (the layer's products on the exact
        engine's kernels: `NativeHeads`): the last position's output [1, H] and the longer cache."""
        heads = self.num_heads
        cache = cache or KVRows.empty(heads, hidden.shape[-1] // heads)
        store = cache.room_for(hidden.shape[0])
        qkv, out, gate_up, down = native_products([self.qkv, self.out, self.gate_up, self.down])
        last = qkv.kernels.prefix_step(hidden, store.keys, store.values, cache.length, self.attn_norm.weight,
                                       qkv.weight, out.weight, self.mlp_norm.weight, gate_up.weight, down.weight,
                                       self.attn_norm.eps)  # [H]
        return last[None].to(hidden.dtype), cache.written(store, hidden.shape[0])

    def extend(self, cache: KVRows | None, hidden: torch.Tensor, *, last_only: bool = False
               ) -> tuple[torch.Tensor, KVRows]:
        """Decoding: new positions hidden [n, H] after `cache` -> (their outputs [n, H], the longer cache).
        `last_only`: the last position's output alone ([1, H]; the others' keys and values still enter
        the cache): what drafting reads, for one row's attention and MLP instead of n."""
        q, k, v = (part.float() for part in self._queries_keys_values(hidden))  # [h, n, d] each
        # the cache and the attention in fp32 whatever the drafting precision: bf16 products of a shape
        # that changes every step (the cache grows) cost a new oneDNN kernel each, ~0.3 ms
        cache = appended(cache, k, v)  # [h, total, d]
        if last_only:
            last = q[:, -1:]  # [h, 1, d]: sees every position, so no mask
            scores = (last @ cache.keys.transpose(-1, -2)) * last.shape[-1] ** -0.5  # [h, 1, total]
            attended = torch.softmax(scores, dim=-1) @ cache.values  # [h, 1, d]
            return self._finish(hidden[-1:], attended.to(hidden.dtype)), cache  # [1, H]
        new, total = hidden.shape[0], cache.length
        allowed = torch.ones(new, total, dtype=torch.bool, device=hidden.device).tril(total - new)  # [n, total]
        attended = nn.functional.scaled_dot_product_attention(q, cache.keys, cache.values, attn_mask=allowed)
        return self._finish(hidden, attended.to(hidden.dtype)), cache  # [n, H]


class HydraHeads(nn.Module):
    """K Hydra heads; head k (1-based) reads k path tokens. Projection: the frozen lm_head."""

    family = "hydra"  # the family these weights draft for (core.families)
    projects_once = False  # each depth multiplies its own rows of the draft projection

    @property
    def max_depth(self) -> int:
        """The deepest tree the heads grow: one depth per head."""
        return self.config.num_heads

    def __init__(self, config: HydraConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(HydraHead(config.hidden_size, k, config.num_layers)
                                   for k in range(1, config.num_heads + 1))
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.prefix = (PrefixLayer(config.hidden_size, config.prefix_heads, config.prefix_mlp)
                       if config.prefix_layer else None)

    def context_states(self, hidden: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """What the heads read at each answer position: the prefix layer's output over the hidden
        states [..., T, H] of the answer so far, or the hidden states themselves without one."""
        if self.prefix is None:
            return hidden
        if hidden.dim() == 2:
            return self.prefix(hidden[None])[0]
        return self.prefix(hidden, lengths)

    def draft_projection(self, lm_head: nn.Module) -> DraftProjection:
        """The lm_head rows the heads rank (build once per session, not per step)."""
        return draft_rows(lm_head, self.draft_vocab, self.config.depth_vocab)

    def head_state(self, depth: int, hidden: torch.Tensor, path_embeds: torch.Tensor) -> torch.Tensor:
        """Head `depth` (1-based) on hidden [..., H] and the path's embeddings [..., depth, H]."""
        return self.heads[depth - 1](hidden, path_embeds)

    def save(self, folder: Path) -> None:
        """`heads.safetensors` + `config.json` (see the module docstring)."""
        tensors = {f"heads.{k}": v for k, v in self.heads.state_dict().items()}
        if self.prefix is not None:
            tensors.update({f"prefix.{k}": v for k, v in self.prefix.state_dict().items()})
        tensors["draft_vocab"] = self.draft_vocab
        save_weights(folder, "heads.safetensors", tensors, self.config, self.family)


def load_hydra_heads(folder: Path = DEFAULT_HYDRA_DIR, *, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> HydraHeads:
    """Hydra heads saved by `HydraHeads.save`."""
    fields, state = read_weights(folder, "heads.safetensors", HydraHeads.family)
    config = HydraConfig(**fields)
    heads = HydraHeads(config)
    draft_vocab = take_draft_vocab(state, config.draft_vocab_size, folder)
    prefix = {key.removeprefix("prefix."): state.pop(key) for key in [k for k in state if k.startswith("prefix.")]}
    if (heads.prefix is not None) != bool(prefix):
        raise ValueError(f"{folder}: config says prefix_layer={config.prefix_layer}, weights "
                         f"{'hold' if prefix else 'lack'} a prefix layer")
    heads.heads.load_state_dict({key.removeprefix("heads."): value for key, value in state.items()})
    if heads.prefix is not None:
        heads.prefix.load_state_dict(prefix)
    heads.draft_vocab.copy_(draft_vocab)
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def default_hydra_heads(*, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> HydraHeads | None:
    """The shipped Hydra heads, or None when none are shipped."""
    if not (DEFAULT_HYDRA_DIR / "heads.safetensors").exists():
        return None
    return load_hydra_heads(DEFAULT_HYDRA_DIR, dtype=dtype, device=device)


@dataclass(frozen=True)
class NativeHeads:
    """Hydra heads whose products all run on the exact engine's kernels, so that each depth is one
    native call (`draft_head`: the mix, the ResBlocks, the projection and the top guesses) and so is
    the prefix layer's step (`PrefixLayer.native_extend`), not dozens of torch operators on a few
    rows. Per head its kernel weights, per depth the projection's. Activations in fp32."""

    kernels: ModuleType
    mixes: tuple[object, ...]
    blocks: tuple[tuple[object, ...], ...]
    projections: tuple[object, ...]

    @classmethod
    def of(cls, heads: HydraHeads, projection: DraftProjection) -> "NativeHeads | None":
        """The kernel weights of `heads` (a drafting copy from `linears_on_kernels`) and `projection`,
        or None where they cannot draft natively (`core.drafters.layers.native_products`)."""
        widths = [heads.config.hidden_size] + ([] if heads.prefix is None
                                               else [heads.config.hidden_size // heads.prefix.num_heads])
        per_head = [native_products([head.mix, *(block.linear for block in head.blocks)], widths)
                    for head in heads.heads]
        prefix = ([] if heads.prefix is None  # its step is native too (`PrefixLayer.native_extend`)
                  else native_products([heads.prefix.qkv, heads.prefix.out, heads.prefix.gate_up, heads.prefix.down]))
        projections = native_products([projection.products.get(projection.rows_at(d))
                                       for d in range(1, heads.config.num_heads + 1)])
        if prefix is None or projections is None or any(head is None for head in per_head):
            return None
        return cls(kernels=projections[0].kernels, mixes=tuple(head[0].weight for head in per_head),
                   blocks=tuple(tuple(p.weight for p in head[1:]) for head in per_head),
                   projections=tuple(p.weight for p in projections))

    def children(self, depth: int, hidden: torch.Tensor, path_embeds: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head `depth`'s top-`width` (probabilities, projection rows) [B, width] after hidden [H] and
        each row's path embeddings [B, depth, H]."""
        return self.kernels.draft_head(hidden, path_embeds.flatten(1), self.mixes[depth - 1],
                                       list(self.blocks[depth - 1]), self.projections[depth - 1], width)


def _children(heads: HydraHeads, embed: nn.Embedding, projection: DraftProjection, hidden: torch.Tensor,
              paths: torch.Tensor, width: int, native: NativeHeads | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Head `paths.shape[1]`'s top-`width` (probabilities, ids) after each path [B, d] (root first)."""
    depth = paths.shape[1]
    if native is not None:
        probs, rows = native.children(depth, hidden, embed(paths), width)  # [B, width] each
        return probs, projection.vocabulary_ids(rows)
    states = heads.head_state(depth, hidden.expand(len(paths), -1), embed(paths))  # [B, H]
    probs, ids = ranked(projection.logits(states, depth), width, projection)  # [B, width] each
    return probs.cpu(), ids.cpu()


@torch.inference_mode()
def grow_tree(heads: HydraHeads, embed: nn.Embedding, projection: DraftProjection, hidden: torch.Tensor,
              root_token: int, *, budget: int, width: int, beam: int, depth: int,
              native: NativeHeads | None = None) -> GrownTree:
    """The `budget` best nodes of a tree grown depth by depth from `root_token` (module docstring).

    hidden: [H] the base model's hidden state that predicted the root. One batched head call
    per depth over at most `beam` frontier nodes: `width` children of the root, min(width, beam)
    of each deeper node (`native`: each call one native call)."""
    depth = min(depth, heads.config.num_heads)
    device = hidden.device
    grown: list[GrownNode] = []
    greedy = GrownNode(path=(), tokens=(), score=1.0)  # the chain of each depth's top guess (heads table)
    frontier = [greedy]
    greedy_probs, greedy_ids = [], []
    for level in range(1, depth + 1):
        paths = torch.tensor([(root_token,) + node.tokens for node in frontier], device=device)  # [B, level]
        # the root's children: `width` of them; deeper, no node needs more children than the
        # next frontier can hold
        children = width if level == 1 else min(width, beam)
        probs, ids = _children(heads, embed, projection, hidden[None].to(embed.weight.dtype),  # the drafting dtype
                               paths, children, native)  # [B, children] each
        row = frontier.index(greedy)
        greedy_probs.append(probs[row])
        greedy_ids.append(ids[row])
        level_nodes = expand(frontier, probs.tolist(), ids.tolist(), budget=budget)  # frontier order
        greedy = level_nodes[row * min(probs.shape[1], budget)]  # the greedy parent's best child
        grown += level_nodes
        # the best-first cut keeps at most `budget` nodes, so no deeper frontier is needed; the
        # greedy chain is always expanded, so the heads table shows one path's conditionals
        frontier = sorted(level_nodes, key=lambda n: -n.score)[: min(beam, budget)]
        if greedy not in frontier:
            frontier.append(greedy)
    return Growth(nodes=grown, greedy_probs=greedy_probs, greedy_ids=greedy_ids).best(budget, kind="hydra")


def shipped_hydra_heads(base: BaseModel) -> tuple[HydraHeads | None, str]:
    """The shipped Hydra heads in `base`'s dtype and device, with a line for the header: the family table's loader."""
    heads = default_hydra_heads(dtype=base.dtype, device=base.device)
    return heads, (f"Hydra heads from assets/hydra ({heads.config.num_heads} heads)" if heads is not None else "")


class HydraDrafter:
    """Hydra heads: each guess reads the path before it; the tree is grown depth by depth."""

    name = "hydra"

    def __init__(self, heads: HydraHeads, base: BaseModel, *, width: int, beam: int, depth: int, budget: int) -> None:
        drafting, self.projection, self.dtype = heads_for_drafting(heads, base)
        self.heads = linears_on_kernels(drafting, base)  # on the exact engine, products through its kernels
        self.native = NativeHeads.of(self.heads, self.projection)
        self.embed = drafting_embedding(base, self.dtype)
        self.width, self.beam, self.depth, self.budget = width, beam, depth, budget
        # the prefix layer's cache over context.history[:seen] (copy.copy of the drafter forks it:
        # a cache is never changed in place)
        self.prefix_cache: KVRows | None = None
        self.seen = 0
        self.last_state: torch.Tensor | None = None

    @classmethod
    def for_session(cls, heads: object, base: BaseModel, config, fixed: CandidateTree | None = None
                    ) -> "HydraDrafter":
        """The drafter of a hydra session (config: a `core.decoder.DecodeConfig`; a grown tree reads no
        fixed tree)."""
        check_heads(heads, HydraHeads, "Hydra heads", config)
        return cls(heads, base, width=config.top_m, beam=config.beam, depth=config.depth, budget=config.budget)

    @property
    def reads_history(self) -> bool:
        """True when proposing needs DraftContext.history (heads with a prefix layer)."""
        return self.heads.prefix is not None

    def propose(self, context: DraftContext) -> GrownTree:
        """The grown tree of `budget` nodes, or of `context.max_nodes` when fewer: the same nodes as
        the full growth's best `max_nodes` up to exact score ties (a node's ancestors score at least
        as high, so none lies deeper than `max_nodes` or outside the best `max_nodes` of its depth),
        for fewer head calls."""
        budget = self.budget if context.max_nodes is None else max(1, min(self.budget, context.max_nodes))
        return grow_tree(self.heads, self.embed, self.projection, self._state(context), int(context.tokens[-1]),
                         budget=budget, width=self.width, beam=self.beam, depth=min(self.depth, budget),
                         native=self.native)

    @torch.inference_mode()
    def _state(self, context: DraftContext) -> torch.Tensor:
        """[H] what the heads read: the hidden state, or the prefix layer's output after it."""
        if self.heads.prefix is None:
            return context.hidden
        if not context.history:
            raise ValueError("Hydra heads with a prefix layer need the answer's hidden states (DraftContext.history)")
        if self.seen > len(context.history):  # a shorter history than the one cached: start over
            self.prefix_cache, self.seen = None, 0
        if self.seen < len(context.history):
            fresh = torch.cat([chunk.to(self.dtype) for chunk in context.history[self.seen:]])  # [n, H]
            extend = (self.heads.prefix.native_extend if self.native is not None
                      else partial(self.heads.prefix.extend, last_only=True))
            last, self.prefix_cache = extend(self.prefix_cache, fresh)  # [1, H]
            self.seen, self.last_state = len(context.history), last[0]
        return self.last_state

    def observe(self, proposed: Proposal | list[Chain], verified_depths: Sequence[int],
                accepted_tokens: Sequence[int]) -> None:
        """The heads are frozen; their calibration lives in the adaptive budget (`core.budget.controller`)."""
