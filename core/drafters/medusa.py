"""Medusa heads: K small residual blocks on the base model's last hidden state.

Head k (1-based) reads the hidden state at position t and guesses token t+k+1 (the base
model itself guesses t+1). Each head is `L x (x + SiLU(Linear(x)))` followed by a vocabulary
projection: its own Linear, or the base model's frozen `lm_head` (shared; the default for
small heads, and what keeps the shipped weights tiny).

The module layout matches Medusa's: `heads` is a ModuleList of Sequential(ResBlock..., [Linear]),
so the official `medusa_lm_head.pt` state dict (keys `0.0.linear.weight`, `0.1.weight`, ...)
loads into it directly.

Draft vocabulary (after FR-Spec, Zhao et al. 2025): shared-lm_head heads may carry a list of the
most frequent answer tokens; proposals are then projected onto those rows of the lm_head only
(16k of 49k rows: a third of the weight read, which dominates a head step on CPU). Verification
still uses the full vocabulary, so decoding stays exact; a guess outside the list is just a miss.
Any head may rank fewer of those rows (`depth_vocab`, a prefix of the list per head): its
guesses are rarely right outside the most frequent tokens, and a step's projection reads its rows
cold from memory. The shipped heads rank 4,096 rows at depths 1-2 and 2,048 below: on MT-Bench and
the second set the same tokens a step at 3-7 nodes as 16,384 at depth 1 (0.5-1 % fewer at 15-64),
for about 0.3 ms less drafting a step on a 2-core Zen 5 (docs/RESULTS.md).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable, Collection, Sequence

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from core.drafters.interface import Chain, DraftContext, HeadProposal, check_heads, heads_for_drafting
from core.drafters.layers import (BuiltOnce, drafter_product, native_products, read_weights, save_weights,
                                  take_draft_vocab)
from core.engine import Matmul, fastest, median_ms, time_kernels
from core.model import REPO_ROOT, BaseModel, linear_rows
from core.strategy import MAX_TOP_M
from core.tree import CandidateTree

DEFAULT_HEADS_DIR = REPO_ROOT / "assets" / "heads"
# row bucket -> rows timed for it when choosing the draft projection's kernel (see with_measured_kernels)
DRAFT_ROW_BUCKETS = {1: 1, 2: 2, 4: 4, 8: 8, 16: 9}
MIN_DEPTH_VOCAB = MAX_TOP_M  # the fewest rows a head may rank: every head can fill the widest top-m


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of Medusa heads."""

    num_heads: int = 4
    num_layers: int = 1
    hidden_size: int = 576
    vocab_size: int = 49152
    own_lm_head: bool = False  # False: project with the base model's (frozen) lm_head
    base_model: str = "SmolLM2-135M-Instruct"
    draft_vocab_size: int = 0  # 0: heads rank the whole vocabulary
    depth_vocab: tuple[int, ...] = ()  # rows of the draft vocabulary head d ranks (a prefix); (): all

    def __post_init__(self) -> None:
        object.__setattr__(self, "depth_vocab", checked_depth_vocab(self.depth_vocab, self.num_heads,
                                                                    self.draft_vocab_size))


def checked_depth_vocab(depth_vocab, num_heads: int, draft_vocab_size: int) -> tuple[int, ...]:
    """`depth_vocab` as a tuple, or ValueError: one size per head, each within the draft vocabulary
    (a prefix of a frequency-sorted list: without a draft vocabulary there is nothing to cut)."""
    sizes = tuple(int(n) for n in depth_vocab)
    if not sizes:
        return sizes
    if not draft_vocab_size:
        raise ValueError("depth_vocab needs a draft vocabulary (draft_vocab_size > 0)")
    if len(sizes) != num_heads or not all(MIN_DEPTH_VOCAB <= n <= draft_vocab_size for n in sizes):
        raise ValueError(f"depth_vocab {list(sizes)}: one size in {MIN_DEPTH_VOCAB}..{draft_vocab_size} per head"
                         f" ({num_heads} heads)")
    return sizes


@dataclass(frozen=True)
class DraftProjection:
    """The vocabulary the heads rank: rows of the shared lm_head (token_ids None: all of them).
    Head d ranks the first `rows_at(d)` rows (the draft vocabulary is most frequent first)."""

    weight: torch.Tensor  # [V', H]
    token_ids: torch.Tensor | None  # [V'] vocabulary id of each row, or None for the identity
    depth_vocab: tuple[int, ...] = ()  # rows head d (1-based) ranks; (): all of them at every depth
    # row count -> its product by the kernel measured fastest here (`with_measured_kernels`)
    products: dict[int, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict, compare=False)

    def rows_at(self, depth: int) -> int:
        """How many rows head `depth` (1-based) ranks."""
        return self.depth_vocab[depth - 1] if self.depth_vocab else self.weight.shape[0]

    @property
    def uniform(self) -> bool:
        """Every head ranks the same rows (so all heads can share one product)."""
        return len(set(self.depth_vocab)) <= 1

    @property
    def widest_rows(self) -> int:
        """The most rows any head ranks (what one product shared by all heads must cover)."""
        return max(self.depth_vocab, default=self.weight.shape[0])

    def logits(self, states: torch.Tensor, depth: int) -> torch.Tensor:
        """Head `depth`'s logits over its rows: states [..., H] -> [..., rows_at(depth)]."""
        return self.rows_logits(states, self.rows_at(depth))

    def rows_logits(self, states: torch.Tensor, rows: int) -> torch.Tensor:
        """Logits over the first `rows` rows: states [..., H] -> [..., rows]."""
        product = self.products.get(rows)
        return product(states) if product is not None else linear_rows(states, self.weight[:rows])

    def vocabulary_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of row indices (any shape)."""
        return rows if self.token_ids is None else self.token_ids[rows]

    def to(self, dtype: torch.dtype) -> "DraftProjection":
        """The same rows in `dtype` (kernel choices are per precision, so none carry over)."""
        return DraftProjection(weight=self.weight.to(dtype), token_ids=self.token_ids, depth_vocab=self.depth_vocab)

    def with_products(self, make: Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]],
                      row_counts: Collection[int] = ()) -> "DraftProjection":
        """The same projection, each of `row_counts` (default: every depth's) multiplied by
        `make(weight rows, their token ids)` (the exact engine's kernels: `ExactLlama.draft_product`)."""
        counts = sorted(set(row_counts) or set(self.depth_vocab) or {self.weight.shape[0]})
        ids = self.token_ids
        return replace(self, products={rows: make(self.weight[:rows], None if ids is None else ids[:rows])
                                       for rows in counts})

    def with_measured_kernels(self, row_counts: Collection[int] = ()) -> "DraftProjection":
        """The same projection, each of `row_counts` (default: every depth's) multiplied by the
        kernel that measured fastest here for the row counts drafting uses (1: a root; 4: Medusa's
        heads; 9: a Hydra frontier). Why: on a 2-core CPU without AVX512 the best kernel for 9 rows
        of 16k differs from 4 rows' and from the base lm_head's; measuring takes well under a
        second, once per process. Row counts left out keep the plain product. A bf16 projection
        also tries int8 weights (`Int8Product`) and keeps them where they are clearly faster."""
        products = {}
        for rows in sorted(set(row_counts) or set(self.depth_vocab) or {self.weight.shape[0]}):
            product = Matmul(self.weight[:rows], None)  # a prefix of a contiguous weight: a view
            times = time_kernels([product], DRAFT_ROW_BUCKETS)
            product.use_kernels(fastest(times))
            products[rows] = faster_int8(product, sum(min(by_kernel.values()) for by_kernel in times.values()))
        return replace(self, products=products)


INT8_GAIN = 0.8  # int8 weights replace a draft product only below this share of its time


@dataclass(frozen=True)
class Int8Product:
    """`x @ weight.T` with the weight stored as int8 per row times a scale (weight-only
    quantisation, for drafts only: a draft only proposes, the base model's verify decides every
    token, so the output stays exact). Half the bytes of bf16 to stream per product; measured on
    a 2-core AMD EPYC with AVX512-BF16: 1 x 16,384 rows 0.21 ms against 0.69 in bf16."""

    quantized: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] in the inputs' dtype

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Int8Product":
        scales = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
        quantized = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
        return cls(quantized=quantized.contiguous(), scales=scales.to(weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [rows, in]
        out = torch.ops.aten._weight_int8pack_mm(flat, self.quantized, self.scales)  # [rows, out]
        return out.reshape(*x.shape[:-1], self.quantized.shape[0])


def int8_available(weight: torch.Tensor) -> bool:
    """Whether `Int8Product` can stand in for `weight`: bf16 on a CPU (its fast path) with the kernel."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and \
        hasattr(torch.ops.aten, "_weight_int8pack_mm")


def faster_int8(product: Matmul, measured_ms: float) -> Matmul | Int8Product:
    """`product`, or its int8 twin when that takes under INT8_GAIN of `measured_ms` (the sum of the
    product's best times over DRAFT_ROW_BUCKETS) on this machine."""
    if not int8_available(product.weight):
        return product
    twin = Int8Product.of(product.weight)
    inputs = [torch.randn(rows, product.weight.shape[1], dtype=product.weight.dtype)  # [rows, in]
              for rows in DRAFT_ROW_BUCKETS.values()]
    try:
        int8_ms = sum(median_ms(lambda x=x: twin(x), repeats=3) for x in inputs)
    except RuntimeError:  # a torch build without the kernel's CPU path
        return product
    return twin if int8_ms < INT8_GAIN * measured_ms else product


def draft_rows(lm_head: nn.Module, draft_vocab: torch.Tensor, depth_vocab: tuple[int, ...] = ()) -> DraftProjection:
    """The lm_head rows of `draft_vocab` [V'] (empty: the whole vocabulary), for any shared-lm_head heads."""
    if len(draft_vocab) == 0:
        return DraftProjection(weight=lm_head.weight, token_ids=None)
    ids = draft_vocab.to(lm_head.weight.device)
    return DraftProjection(weight=lm_head.weight[ids].contiguous(), token_ids=ids, depth_vocab=depth_vocab)  # [V', H]


def ranked(logits: torch.Tensor, width: int, projection: DraftProjection | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`width` probabilities and vocabulary ids of `logits` [..., V'] (softmax in fp32)."""
    top = torch.topk(torch.softmax(logits.float(), dim=-1), min(width, logits.shape[-1]), dim=-1)
    ids = top.indices if projection is None else projection.vocabulary_ids(top.indices)
    return top.values, ids


def ranked_prefixes(logits: torch.Tensor, rows: Sequence[int], width: int,
                    projection: DraftProjection) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked` for each head d over its own first `rows[d]` columns of logits [D, ..., V'], as one
    softmax and one top-k (the columns past a head's prefix count as -inf): ([D, ..., width] x 2)."""
    limits = torch.tensor(rows, device=logits.device).view(-1, *([1] * (logits.dim() - 1)))  # [D, 1...]
    outside = torch.arange(logits.shape[-1], device=logits.device) >= limits  # [D, 1..., V']
    return ranked(logits.float().masked_fill(outside, float("-inf")), width, projection)


Product = Callable[[torch.Tensor], torch.Tensor]  # x [..., in] -> x @ W.T + b [..., out]


def torch_product(weight: torch.Tensor, bias: torch.Tensor | None) -> Product:
    """`x @ weight.T + bias` by torch's linear."""
    return lambda x: F.linear(x, weight, bias)


@dataclass(frozen=True)
class ResidualProducts:
    """Medusa heads' ResBlock products for drafting (`MedusaHeads.residual_products`): the first
    blocks of heads 1..d stacked as one product per d, each head's later blocks one product each."""

    first: tuple[Product, ...]  # first[d - 1]: [..., H] -> [..., d*H], heads 1..d's first blocks' linears
    later: tuple[tuple[Product, ...], ...]  # per head: the linears of its blocks 2..L


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)). Zero-initialised (SiLU(0) = 0): a fresh head starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads. `forward(hidden, lm_head)` gives logits [K, ..., vocab]."""

    family = "dynamic"  # the family these weights draft for (core.families)
    projects_once = True  # every head's state through one product onto the widest draft rows

    @property
    def max_depth(self) -> int:
        """The deepest tree the heads guess: one depth per head."""
        return self.config.num_heads

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        blocks = []
        for _ in range(config.num_heads):
            layers: list[nn.Module] = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
            if config.own_lm_head:
                layers.append(nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            blocks.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(blocks)
        # most frequent answer tokens first; empty means the whole vocabulary
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def draft_projection(self, lm_head: nn.Module) -> DraftProjection:
        """The (sliced) lm_head weight the heads project onto; build once per session, not per step."""
        if self.config.own_lm_head:
            raise ValueError("heads with their own projection have no draft vocabulary")
        return draft_rows(lm_head, self.draft_vocab, self.config.depth_vocab)

    def residual_products(self, make: Callable[[torch.Tensor, torch.Tensor], Product] | None = None
                          ) -> "ResidualProducts | None":
        """Every head's ResBlock products for `propose`, each weight multiplied by `make(weight, bias)`
        (default: torch's linear; the exact engine's kernels: `ExactLlama.kernel_product`), the first
        blocks stacked into one product per depth prefix. None for heads without ResBlocks. Build it
        once per drafting session (the heads are frozen there)."""
        if self.config.num_layers == 0:
            return None
        make = make or torch_product
        linears = [[layer.linear for layer in block if isinstance(layer, ResBlock)] for block in self.heads]
        weight = torch.cat([head[0].weight for head in linears])  # [K*H, H]
        bias = torch.cat([head[0].bias for head in linears])  # [K*H]
        hidden = self.config.hidden_size
        return ResidualProducts(
            first=tuple(make(weight[: d * hidden], bias[: d * hidden]) for d in range(1, len(linears) + 1)),
            later=tuple(tuple(make(l.weight, l.bias) for l in head[1:]) for head in linears))

    def propose(self, hidden: torch.Tensor, width: int, projection: DraftProjection | None = None,
                depth: int | None = None, products: "ResidualProducts | None" = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-`width` probabilities and token ids of the first `depth` heads at `hidden` [..., H]:
        ([D, ..., width], [D, ..., width]). Shared-lm_head heads need `projection`; `products`
        (`residual_products()`) runs every head's first ResBlock as one product."""
        blocks = self.heads[: depth or len(self.heads)]
        if self.config.own_lm_head:
            return ranked(torch.stack([head(hidden) for head in blocks]), width, None)  # [D, ..., V]
        if projection is None:
            raise ValueError("these heads share the base model's lm_head: pass draft_projection(lm_head)")
        states = self._states(hidden, blocks, products)  # [D, ..., H]
        # one product for all heads (a few rows read the weight once; one per head would read it
        # D times), then each head ranks its own prefix of the rows
        logits = projection.rows_logits(states, projection.widest_rows)  # [D, ..., widest_rows]
        if projection.uniform:
            return ranked(logits, width, projection)  # [D, ..., width] each
        return ranked_prefixes(logits, [projection.rows_at(d + 1) for d in range(len(blocks))], width, projection)

    def _states(self, hidden: torch.Tensor, blocks: nn.ModuleList, products: "ResidualProducts | None") -> torch.Tensor:
        """The residual blocks of `blocks`: [..., H] -> [D, ..., H]. Every head's first block reads the same
        state, so with `products` they run as one product (a one-row product per head costs mostly its
        call: 4 heads' two blocks 0.30 -> 0.19 ms in bf16 on a 2-core Zen 5); each output is the same dot
        product either way."""
        if products is None:
            return torch.stack([head(hidden) for head in blocks])  # [D, ..., H]
        depth = len(blocks)
        first = products.first[depth - 1](hidden)  # [..., D*H]
        states = hidden + F.silu(first).unflatten(-1, (depth, -1)).movedim(-2, 0)  # [D, ..., H]
        if not products.later[0]:
            return states
        outs = []
        for state, layers in zip(states, products.later):
            for product in layers:
                state = state + F.silu(product(state))  # [..., H]
            outs.append(state)
        return torch.stack(outs)  # [D, ..., H]

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The residual blocks only: [..., H] -> [K, ..., H] (shared-lm_head heads)."""
        return torch.stack([head(hidden) for head in self.heads])  # [K, ..., H]

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits of every head for `hidden` [..., H]: [K, ..., vocab].

        With a shared lm_head all K projections run as one matmul.
        """
        if self.config.own_lm_head:
            return torch.stack([head(hidden) for head in self.heads])  # [K, ..., V]
        if lm_head is None:
            raise ValueError("these heads share the base model's lm_head: pass it")
        return lm_head(self.head_states(hidden))  # [K, ..., V]

    def save(self, folder: Path) -> None:
        """Project format: `heads.safetensors` + `config.json`."""
        tensors = dict(self.heads.state_dict())
        if self.config.draft_vocab_size:
            tensors["draft_vocab"] = self.draft_vocab
        save_weights(folder, "heads.safetensors", tensors, self.config)


def load_heads(folder: Path = DEFAULT_HEADS_DIR, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> MedusaHeads:
    """Heads saved in the project format."""
    fields, state = read_weights(folder, "heads.safetensors")
    config = HeadsConfig(**fields)
    heads = MedusaHeads(config)
    draft_vocab = take_draft_vocab(state, config.draft_vocab_size, folder)
    heads.heads.load_state_dict(state)
    heads.draft_vocab.copy_(draft_vocab)
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def load_official_medusa(path: Path, *, base_model: str = "", dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> MedusaHeads:
    """Heads from an official Medusa checkpoint.

    `medusa_lm_head.pt` (a ModuleList state dict, keys like `0.0.linear.weight`, `0.1.weight`)
    is read with `weights_only=True`; `medusa_lm_head.safetensors` with safetensors. Keys may
    carry a `medusa_head.` prefix. Without a final projection per head the heads share the
    base model's lm_head. The layout (K, L, own projection) is read off the keys.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        state = safetensors.torch.load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    parsed = {}
    for key, tensor in state.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"unexpected key {key!r} in {path.name}: not a Medusa head layout")
        parsed[(int(match[1]), int(match[2]), match[3])] = tensor
    num_heads = 1 + max(h for h, _, _ in parsed)
    resblocks = {layer for _, layer, name in parsed if name.startswith("linear")}
    num_layers = 1 + max(resblocks)
    own = any(name == "weight" for _, _, name in parsed)
    hidden = parsed[(0, 0, "linear.weight")].shape[1]
    vocab = parsed[(0, num_layers, "weight")].shape[0] if own else 0
    config = HeadsConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=hidden,
                         vocab_size=vocab, own_lm_head=own, base_model=base_model)
    heads = MedusaHeads(config)
    heads.heads.load_state_dict({f"{h}.{layer}.{name}": t for (h, layer, name), t in parsed.items()})
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def default_heads(hidden_size: int, vocab_size: int, *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> tuple[MedusaHeads, str]:
    """The shipped heads from assets/heads, or (if none are shipped) untrained identity heads.

    Returns the heads and a one-line description for the UI.
    """
    if (DEFAULT_HEADS_DIR / "heads.safetensors").exists():
        heads = load_heads(DEFAULT_HEADS_DIR, dtype=dtype, device=device)
        return heads, f"trained heads from assets/heads ({heads.config.num_heads} heads)"
    heads = MedusaHeads(HeadsConfig(hidden_size=hidden_size, vocab_size=vocab_size))
    heads = heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return heads, "UNTRAINED identity heads (assets/heads is missing): expect ~1 token per step"


def shipped_heads(base: BaseModel) -> tuple[MedusaHeads, str]:
    """`default_heads` for `base` (its sizes, dtype and device): the family table's loader."""
    config = base.model.config
    return default_heads(config.hidden_size, config.vocab_size, dtype=base.dtype, device=base.device)


_PRODUCTS = BuiltOnce()  # each drafting copy's ResBlock products per base model (quantising them takes ~10 ms)


def kernel_residual_products(heads: MedusaHeads, base: BaseModel) -> ResidualProducts | None:
    """`heads.residual_products` as a session drafts with them: on the exact engine through its kernels
    (`core.drafters.layers.drafter_product`: Q8_0 blocks; 4 heads' two blocks at one row, read cold as in a
    step, 0.30 ms with the kernels' bf16 weights, 0.19-0.21 as Q8_0, on a 2-core Zen 5), elsewhere torch's
    linear."""
    if not base.exact:
        return heads.residual_products()
    return _PRODUCTS.get(heads, id(base), lambda: heads.residual_products(partial(drafter_product, base)))


@dataclass(frozen=True)
class NativeMedusa:
    """Medusa heads whose ResBlocks and projection all run on the exact engine's kernels, proposed in
    one native call (`medusa_heads`: the blocks, one projection of every head's state, each head's
    top guesses among its own rows) instead of a dozen torch operators on a few rows; fp32."""

    products: ResidualProducts
    projection: DraftProjection

    @classmethod
    def of(cls, products: ResidualProducts | None, projection: DraftProjection | None) -> "NativeMedusa | None":
        """None unless the heads (shared-lm_head heads with ResBlocks) can draft natively
        (`core.drafters.layers.native_products`)."""
        if products is None or projection is None:
            return None
        every = [*products.first, *(p for head in products.later for p in head),
                 projection.products.get(projection.widest_rows)]
        if native_products(every, [projection.weight.shape[1]]) is None:
            return None
        return cls(products=products, projection=projection)

    def propose(self, hidden: torch.Tensor, width: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `depth` heads' top-`width` (probabilities, projection rows) [D, width] at hidden [H]."""
        first = self.products.first[depth - 1]
        return first.kernels.medusa_heads(
            hidden, first.weight, [[p.weight for p in head] for head in self.products.later[:depth]],
            self.projection.products[self.projection.widest_rows].weight,
            [self.projection.rows_at(d) for d in range(1, depth + 1)], width)


class HeadsDrafter:
    """Medusa heads: head k guesses token t+k+1 from the hidden state at t alone."""

    name = "heads"

    def __init__(self, heads: MedusaHeads, base: BaseModel, width: int, depth: int, fixed_depth: int = 0) -> None:
        self.heads, self.projection, self.dtype = heads_for_drafting(heads, base)
        self.products = kernel_residual_products(self.heads, base)
        self.native = NativeMedusa.of(self.products, self.projection)
        self.width = width
        self.depth = depth
        self.fixed_depth = fixed_depth  # the fixed tree's depth this drafter serves (every step needs it), else 0

    @classmethod
    def for_session(cls, heads: object, base: BaseModel, config, fixed: CandidateTree | None = None
                    ) -> "HeadsDrafter":
        """The drafter a fixed or dynamic session drafts with (config: a `core.decoder.DecodeConfig`;
        `fixed`: the fixed tree it decodes or the page draws beside, whose ranks it must cover)."""
        check_heads(heads, MedusaHeads, "Medusa heads", config)
        width = max(config.top_m, fixed.max_rank + 1 if fixed else 1)
        # `depth` bounds the dynamic tree; a fixed tree brings its own depth
        depth = max(config.depth, fixed.max_depth if fixed else 0)
        return cls(heads, base, width=width, depth=depth, fixed_depth=fixed.max_depth if fixed else 0)

    def propose(self, context: DraftContext) -> HeadProposal:
        """The first heads' top guesses: as many heads as the step's tree can reach (a tree of n nodes
        is at most n deep; a fixed tree needs all of its depths)."""
        hidden = context.hidden.to(self.dtype)  # [H]
        depth = self.depth
        if context.max_nodes is not None:
            depth = max(self.fixed_depth, min(depth, max(1, context.max_nodes)))
        if self.native is not None:
            probs, rows = self.native.propose(hidden, self.width, depth)  # [D, m] each
            return HeadProposal(probs=probs, token_ids=self.projection.vocabulary_ids(rows))
        probs, ids = self.heads.propose(hidden, self.width, self.projection, depth=depth,
                                        products=self.products)  # [D, m] each
        return HeadProposal(probs=probs, token_ids=ids)

    def observe(self, proposed: HeadProposal | list[Chain], verified_depths: Sequence[int],
                accepted_tokens: Sequence[int]) -> None:
        """The heads are frozen; their calibration lives in the adaptive budget (`core.budget.controller`)."""
