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
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from core.model import REPO_ROOT, linear_rows

DEFAULT_HEADS_DIR = REPO_ROOT / "assets" / "heads"


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


@dataclass(frozen=True)
class DraftProjection:
    """The vocabulary the heads rank: rows of the shared lm_head (token_ids None: all of them)."""

    weight: torch.Tensor  # [V', H]
    token_ids: torch.Tensor | None  # [V'] vocabulary id of each row, or None for the identity


def draft_rows(lm_head: nn.Module, draft_vocab: torch.Tensor) -> DraftProjection:
    """The lm_head rows of `draft_vocab` [V'] (empty: the whole vocabulary), for any shared-lm_head heads."""
    if len(draft_vocab) == 0:
        return DraftProjection(weight=lm_head.weight, token_ids=None)
    ids = draft_vocab.to(lm_head.weight.device)
    return DraftProjection(weight=lm_head.weight[ids].contiguous(), token_ids=ids)  # [V', H]


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
        return draft_rows(lm_head, self.draft_vocab)

    def propose(self, hidden: torch.Tensor, width: int, projection: DraftProjection | None = None,
                depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-`width` probabilities and token ids of the first `depth` heads at `hidden` [..., H]:
        ([D, ..., width], [D, ..., width]). Shared-lm_head heads need `projection`."""
        blocks = self.heads[: depth or len(self.heads)]
        if self.config.own_lm_head:
            logits = torch.stack([head(hidden) for head in blocks])  # [D, ..., V]
            token_ids = None
        else:
            if projection is None:
                raise ValueError("these heads share the base model's lm_head: pass draft_projection(lm_head)")
            states = torch.stack([head(hidden) for head in blocks])  # [D, ..., H]
            logits = linear_rows(states, projection.weight)  # [D, ..., V'] one matmul for all heads
            token_ids = projection.token_ids
        top = torch.topk(torch.softmax(logits.float(), dim=-1), min(width, logits.shape[-1]), dim=-1)
        ids = top.indices if token_ids is None else token_ids[top.indices]  # [D, ..., width]
        return top.values, ids

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
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in self.heads.state_dict().items()}
        if self.config.draft_vocab_size:
            tensors["draft_vocab"] = self.draft_vocab.contiguous()
        safetensors.torch.save_file(tensors, folder / "heads.safetensors")
        (folder / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")


def load_heads(folder: Path = DEFAULT_HEADS_DIR, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> MedusaHeads:
    """Heads saved in the project format."""
    folder = Path(folder)
    config = HeadsConfig(**json.loads((folder / "config.json").read_text()))
    heads = MedusaHeads(config)
    state = safetensors.torch.load_file(folder / "heads.safetensors")
    draft_vocab = state.pop("draft_vocab", torch.zeros(0, dtype=torch.long))
    if len(draft_vocab) != config.draft_vocab_size:
        raise ValueError(f"{folder}: config says {config.draft_vocab_size} draft tokens, weights hold {len(draft_vocab)}")
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
