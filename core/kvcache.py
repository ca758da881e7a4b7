"""KV-cache surgery on transformers' DynamicCache: keep the accepted path, drop the rest."""
from __future__ import annotations

import torch
from transformers import DynamicCache


def cache_length(cache: DynamicCache) -> int:
    """Tokens held in the cache."""
    return int(cache.get_seq_length())


def keep_accepted(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Keep the first `prefix_len` positions plus tree positions `keep` (node indices, ascending).

    After a verify the cache holds prefix + every tree node; afterwards it holds exactly the
    prefix and the accepted path, in order, so it equals the cache of plain decoding.
    """
    for layer in cache.layers:
        index = torch.cat([torch.arange(prefix_len, device=layer.keys.device), prefix_len + keep.to(layer.keys.device)])
        layer.keys = layer.keys.index_select(-2, index)  # [1, kv_heads, prefix+accepted, dim]
        layer.values = layer.values.index_select(-2, index)


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every position from `length` on (undo a verify that is not committed)."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
