"""Pieces the drafter families' modules share."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import safetensors.torch
import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """x / RMS(x) * weight, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]. One op, not six: drafting calls a norm a dozen times a step."""
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def save_weights(folder: Path, file: str, tensors: dict[str, torch.Tensor], config: object,
                 family: str | None = None) -> None:
    """A family's on-disk format: `file` (safetensors) beside `config.json` (the config dataclass's
    fields, after `"family": family` when the family names itself)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({name: t.contiguous() for name, t in tensors.items()}, folder / file)
    fields = ({"family": family} if family else {}) | asdict(config)
    (folder / "config.json").write_text(json.dumps(fields, indent=2) + "\n")


def read_weights(folder: Path, file: str, family: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """`config.json`'s fields and the tensors of `file` saved by `save_weights`; ValueError when the
    config does not name `family`."""
    folder = Path(folder)
    fields = json.loads((folder / "config.json").read_text())
    if family and fields.pop("family", None) != family:
        raise ValueError(f"{folder} does not hold {family} weights (its config.json says no \"family\": \"{family}\")")
    return fields, safetensors.torch.load_file(folder / file)


def take_draft_vocab(state: dict[str, torch.Tensor], size: int, folder: Path) -> torch.Tensor:
    """The draft vocabulary popped from loaded tensors, checked against the config's size."""
    draft_vocab = state.pop("draft_vocab", torch.zeros(0, dtype=torch.long))
    if len(draft_vocab) != size:
        raise ValueError(f"{folder}: config says {size} draft tokens, weights hold {len(draft_vocab)}")
    return draft_vocab
