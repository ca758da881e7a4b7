"""One base-model forward over a whole candidate tree, with tree attention.

The mask, position ids and cache are passed explicitly; nothing is stored on the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from core.model import BaseModel


@dataclass(frozen=True)
class VerifyOutput:
    hidden: torch.Tensor  # [n+1, H] last (normed) hidden state of every node
    logits: torch.Tensor  # [n+1, V] float32 next-token logits of every node


def tree_attention_bias(tree_mask: torch.Tensor, past_len: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """Additive 4D mask [1, 1, n+1, past+n+1]: 0 where a node may attend, dtype-min elsewhere.

    Every node sees the whole committed context and, inside the tree, itself and its
    ancestors. A float mask, because a bool 4D mask is silently misread by `eager` attention.
    """
    size = tree_mask.shape[0]
    bias = torch.zeros(size, past_len + size, dtype=dtype, device=device)  # [n+1, past+n+1]
    bias[:, past_len:].masked_fill_(~tree_mask.to(device), torch.finfo(dtype).min)
    return bias[None, None]


def forward_tokens(base: BaseModel, cache: DynamicCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   attention_bias: torch.Tensor | None) -> VerifyOutput:
    """Run `input_ids` [n] at `position_ids` [n] on top of `cache` (which grows by n)."""
    out = base.model.model(
        input_ids=input_ids[None].to(base.device),  # [1, n]
        position_ids=position_ids[None].to(base.device),  # [1, n]
        attention_mask=attention_bias,
        past_key_values=cache,
        use_cache=True,
    )
    hidden = out.last_hidden_state[0]  # [n, H]
    return VerifyOutput(hidden=hidden, logits=base.lm_head(hidden).float())  # [n, V]


def verify_tree(base: BaseModel, cache: DynamicCache, node_tokens: torch.Tensor, tree_mask: torch.Tensor,
                depths: torch.Tensor) -> VerifyOutput:
    """Verify all tree nodes in one forward: positions are context length + depth."""
    past_len = int(cache.get_seq_length())
    bias = tree_attention_bias(tree_mask, past_len, base.dtype, base.device)
    return forward_tokens(base, cache, node_tokens, past_len + depths, bias)
