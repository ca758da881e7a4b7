"""KV-cache surgery: keep the accepted path, drop the rest.

Two kinds of cache: the lean forward's preallocated `core.engine.StaticCache` (rows moved in
place, one gather over all layers) and transformers' DynamicCache (for the families that run on
transformers' forward). The decoder calls these functions and never asks which it holds.
"""
from __future__ import annotations

from typing import Union

import torch
from transformers import DynamicCache

from core.engine import StaticCache

KVCache = Union[StaticCache, DynamicCache]


def cache_length(cache: KVCache) -> int:
    """Tokens held in the cache."""
    return int(cache.get_seq_length())


def keep_accepted(cache: KVCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Keep the first `prefix_len` positions plus tree positions `keep` (node indices, ascending).

    After a verify the cache holds prefix + every tree node; afterwards it holds exactly the
    prefix and the accepted path, in order, so it equals the cache of plain decoding. As in
    Medusa, only the accepted positions move: the i-th kept node is copied from position
    prefix_len + keep[i] to prefix_len + i and everything after the path is cropped, so a
    commit costs O(accepted) per layer whatever the context length.
    """
    if isinstance(cache, StaticCache):
        cache.keep(prefix_len, keep)
        return
    sources: dict[torch.device, torch.Tensor] = {}  # per device (a model may span several)
    # a cache filled under inference mode holds inference tensors, writable in place only in that mode
    with torch.inference_mode(_holds_inference_tensors(cache)):
        for layer in cache.layers:
            device = layer.keys.device
            if device not in sources:
                sources[device] = prefix_len + keep.to(device=device, dtype=torch.long)  # [accepted]
            layer.keys = _compact(layer.keys, prefix_len, sources[device])  # [1, kv_heads, prefix+accepted, dim]
            layer.values = _compact(layer.values, prefix_len, sources[device])


def _holds_inference_tensors(cache: DynamicCache) -> bool:
    return any(layer.keys is not None and layer.keys.is_inference() for layer in cache.layers[:1])


def _compact(states: torch.Tensor, prefix_len: int, source: torch.Tensor) -> torch.Tensor:
    """Move rows `source` of states [B, H, S, D] to prefix_len, prefix_len+1, ... in place; return
    the first prefix_len + len(source) rows (a view: the next cache update concatenates anyway).

    The gather reads every source row before the copy writes, so overlapping ranges are safe.
    """
    count = int(source.shape[0])
    moved = states.index_select(-2, source)  # [B, H, accepted, D]
    states.narrow(-2, prefix_len, count).copy_(moved)
    return states[..., : prefix_len + count, :]  # [B, H, prefix+accepted, D]


def truncate(cache: KVCache, length: int) -> None:
    """Drop every position from `length` on (undo a verify that is not committed)."""
    if isinstance(cache, StaticCache):
        cache.crop(length)
        return
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
