"""KV commit: `keep_accepted` moves only the accepted tree positions and equals a whole-cache gather.

The reference below is the former implementation (an index_select of prefix + accepted over the
whole cache in every layer, O(context)); the O(accepted) commit must leave identical caches.
Timing is not tested here: scripts/kv_commit_timing.py measures both.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from core.kvcache import cache_length, keep_accepted, truncate

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 8


def reference_keep(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """The old commit: gather prefix + accepted positions of the whole cache."""
    for layer in cache.layers:
        index = torch.cat([torch.arange(prefix_len), prefix_len + keep])  # [prefix+accepted]
        layer.keys = layer.keys.index_select(-2, index)  # [1, kv_heads, prefix+accepted, dim]
        layer.values = layer.values.index_select(-2, index)


def random_cache(length: int, dtype: torch.dtype, seed: int) -> DynamicCache:
    """A cache of LAYERS layers holding `length` random positions."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for index in range(LAYERS):
        keys = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator).to(dtype)  # [1, h, length, d]
        values = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator).to(dtype)
        cache.update(keys, values, index)
    return cache


def snapshot(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def assert_same(cache: DynamicCache, expected: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (keys, values) in zip(cache.layers, expected, strict=True):
        assert layer.keys.shape == keys.shape and layer.values.shape == values.shape
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


# (prefix_len, tree nodes incl. root, accepted node indices)
CASES = [
    (10, 8, [0]),  # nothing but the root
    (10, 8, [0, 1, 2, 3]),  # the first nodes: nothing moves
    (10, 8, [0, 2, 7]),  # skips nodes
    (37, 64, [0, 5, 17, 40, 63]),  # deep skips in a 64-node tree
    (37, 64, [0, 1, 30]),  # a prefix that stays, then a jump
    (0, 6, [0, 3, 4]),  # no committed context yet
    (12, 9, [2, 5, 8]),  # a path that does not start at the root
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix_len, nodes, kept", CASES)
def test_commit_equals_whole_cache_gather(prefix_len: int, nodes: int, kept: list[int], dtype: torch.dtype):
    ours, theirs = random_cache(prefix_len + nodes, dtype, seed=nodes), random_cache(prefix_len + nodes, dtype, seed=nodes)
    keep = torch.tensor(kept)
    reference_keep(theirs, prefix_len, keep)
    keep_accepted(ours, prefix_len, keep)
    assert cache_length(ours) == prefix_len + len(kept)
    assert_same(ours, snapshot(theirs))


def test_random_paths_over_many_commits():
    """Commit, grow (as the next verify does), commit again: always equal to the gather."""
    generator = torch.Generator().manual_seed(1)
    ours, theirs = random_cache(20, torch.float32, seed=2), random_cache(20, torch.float32, seed=2)
    for step in range(25):
        nodes = int(torch.randint(1, 40, (), generator=generator))
        tree = torch.randn(LAYERS, 2, 1, KV_HEADS, nodes, HEAD_DIM, generator=generator)  # new tree positions
        prefix = cache_length(ours)
        for cache in (ours, theirs):
            for index in range(LAYERS):
                cache.update(tree[index, 0], tree[index, 1], index)
        count = int(torch.randint(1, nodes + 1, (), generator=generator))
        keep = torch.randperm(nodes, generator=generator)[:count].sort().values  # [count] ascending
        reference_keep(theirs, prefix, keep)
        keep_accepted(ours, prefix, keep)
        assert_same(ours, snapshot(theirs))


def test_inference_mode_cache_committed_outside_inference_mode():
    """A cache filled by a forward under inference mode holds inference tensors; the in-place
    commit must still work when called outside that mode."""
    with torch.inference_mode():
        ours = random_cache(30, torch.float32, seed=3)
    theirs = random_cache(30, torch.float32, seed=3)
    keep = torch.tensor([0, 4, 9])
    keep_accepted(ours, 20, keep)
    reference_keep(theirs, 20, keep)
    assert_same(ours, snapshot(theirs))


def test_truncate_drops_the_tail():
    cache = random_cache(30, torch.float32, seed=4)
    expected = [(keys[..., :18, :], values[..., :18, :]) for keys, values in snapshot(cache)]
    truncate(cache, 18)
    assert cache_length(cache) == 18
    assert_same(cache, expected)


def test_plain_step_mask_changes_the_kernel_not_the_result():
    """transformers' forward: a one-token step with the all-zero float mask (`plain_step_bias`, bf16
    on CPU) gives what the unmasked step gives."""
    from tests.tiny import tiny_base

    base = tiny_base("llama", max_positions=256, engine="hf")
    prompt = torch.arange(40) % 256
    outputs = []
    for bias in (None, torch.zeros(1, 1, 1, 41)):
        cache = DynamicCache()
        with torch.inference_mode():
            base.model.model(input_ids=prompt[None], past_key_values=cache, use_cache=True)
            hidden = base.model.model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[40]]),
                                      attention_mask=bias, past_key_values=cache, use_cache=True).last_hidden_state
            outputs.append(hidden[0, 0])
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)
