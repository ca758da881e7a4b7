"""Micro-benchmark of the KV commit: whole-cache gather (before) vs O(accepted) copy (core.kvcache).

A cache shaped like SmolLM2-135M's (30 layers, 3 kv heads, head dim 64) holds `context`
committed positions plus a 64-node verified tree; the commit keeps a 4-node accepted path
that skips nodes. Prints the median milliseconds per commit.

    PYTHONPATH=. .venv/bin/python scripts/kv_commit_timing.py [--contexts 100 1500] [--repeats 50]
"""
from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from core.kvcache import keep_accepted
from core.machine import median_ms

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
TREE_NODES = 64
ACCEPTED = [0, 3, 11, 30]  # node indices, root first
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gather_commit(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """The former commit: index_select prefix + accepted over the whole cache, every layer."""
    for layer in cache.layers:
        index = torch.cat([torch.arange(prefix_len, device=layer.keys.device), prefix_len + keep])
        layer.keys = layer.keys.index_select(-2, index)  # [1, kv_heads, prefix+accepted, dim]
        layer.values = layer.values.index_select(-2, index)


def full_states(context: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values [1, kv_heads, context + tree, dim] right after a verify."""
    shape = (1, KV_HEADS, context + TREE_NODES, HEAD_DIM)
    return [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]


def time_commit(commit, context: int, dtype: torch.dtype, repeats: int) -> float:
    """Median ms of `commit(cache, context, keep)` on a freshly filled cache each time."""
    states = full_states(context, dtype)
    keep = torch.tensor(ACCEPTED)
    cache = DynamicCache()
    for index, (keys, values) in enumerate(states):
        cache.update(keys, values, index)
    def restore() -> None:  # the commit edits the cache in place
        for layer, (keys, values) in zip(cache.layers, states):
            layer.keys, layer.values = keys, values

    return median_ms(lambda: commit(cache, context, keep), repeats, setup=restore)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1500])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{LAYERS} layers x {KV_HEADS} kv heads x dim {HEAD_DIM}, {TREE_NODES}-node tree, keep {ACCEPTED}; "
          f"median of {args.repeats}, {torch.get_num_threads()} threads")
    print(f"{'dtype':>5} {'context':>8} {'before ms':>10} {'after ms':>9} {'speed-up':>9}")
    for name, dtype in DTYPES.items():
        for context in args.contexts:
            before = time_commit(gather_commit, context, dtype, args.repeats)
            after = time_commit(keep_accepted, context, dtype, args.repeats)
            print(f"{name:>5} {context:>8} {before:>10.3f} {after:>9.3f} {before / after:>8.1f}x")


if __name__ == "__main__":
    main()
