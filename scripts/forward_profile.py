"""Where a forward's time goes: ms per plain step and per tree verify of 2-64 nodes, and the
operations that take it (torch.profiler, self CPU time), in each precision, on this CPU.

    python scripts/forward_profile.py --dtype fp32 bf16 --sizes 1 2 4 8 16 32 64 --context 100

Prints one line per (precision, size) with the median wall ms of a verify (forward + the
logits acceptance reads), then for the plain step and the largest tree the operator groups
(matrix products, attention, norms/elementwise, copies and casts) with their share.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from core.kvcache import truncate
from core.model import ModelConfig, load_base_model
from core.tree import CandidateTree, chain_tree
from core.verify import verify_tree

GROUPS = {
    "matmul": ("addmm", "mm", "matmul", "linear", "bmm", "mkldnn", "_mkl"),
    "attention": ("scaled_dot_product", "softmax", "_efficient_attention", "flash"),
    "norm/elementwise": ("mul", "add", "rsqrt", "pow", "mean", "silu", "neg", "cat", "div", "sub"),
    "copies/casts": ("copy_", "to", "_to_copy", "contiguous", "clone", "index", "slice", "expand", "view", "reshape"),
}


def _group(name: str) -> str:
    short = name.removeprefix("aten::")
    for group, keys in GROUPS.items():
        if any(short == k or short.startswith(k) for k in keys):
            return group
    return "other"


def _verify_once(base, cache, context: int, size: int) -> None:
    tree = chain_tree(size - 1) if size > 1 else CandidateTree(paths=[])
    buffers = tree.buffers()
    tokens = torch.arange(2000, 2000 + size) % base.model.config.vocab_size
    out = verify_tree(base, cache, tokens, buffers.attn_mask, buffers.position_ids)
    out.logits(list(range(0, size, 3)))
    truncate(cache, context)


@torch.inference_mode()
def measure(dtype: str, sizes: list[int], context: int, repeats: int) -> None:
    base = load_base_model(ModelConfig(dtype=dtype, device="cpu"))
    cache = DynamicCache()
    prompt = torch.arange(1000, 1000 + context) % base.model.config.vocab_size
    base.model.model(input_ids=prompt[None], past_key_values=cache, use_cache=True)
    for size in sizes:
        _verify_once(base, cache, context, size)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _verify_once(base, cache, context, size)
            times.append(1000 * (time.perf_counter() - start))
        print(f"{dtype} {size:3d} tokens over {context} cached: {statistics.median(times):7.2f} ms")
    for size in (sizes[0], sizes[-1]):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                _verify_once(base, cache, context, size)
        groups: dict[str, float] = defaultdict(float)
        for event in prof.key_averages():
            groups[_group(event.key)] += event.self_cpu_time_total / 1000 / repeats
        total = sum(groups.values())
        shares = ", ".join(f"{g} {ms:.1f} ms ({ms / total:.0%})" for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]))
        print(f"  {dtype} {size} tokens, self CPU time by group: {shares}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"CPU: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for dtype in args.dtype:
        measure(dtype, args.sizes, args.context, args.repeats)


if __name__ == "__main__":
    main()
