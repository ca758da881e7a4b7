"""Where a forward's time goes: ms per plain step, per tree verify of 2-64 nodes and per batched
generation step, against the time to read the weights once, and the operations that take it
(torch.profiler, self CPU time), in each precision and on each forward (lean / transformers').

    python scripts/forward_profile.py --dtype fp32 bf16 --engine lean hf --context 100

For the plain step and the largest tree it prints the operator groups (matrix products,
attention, norms/elementwise, copies and casts) with their share, then one markdown table.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from core.kvcache import truncate
from core.machine import cpu_name, median_ms
from core.model import ModelConfig, load_base_model
from core.tree import CandidateTree, chain_tree
from core.verify import forward_tokens, verify_tree

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
    out.logits(list(range(0, size, 3)) if size > 1 else [0])
    truncate(cache, context)


def weight_read_ms(base, repeats: int) -> float:
    """Median ms to stream every weight a forward reads once (a sum over each tensor): the memory floor."""
    tensors = [p for name, p in base.model.named_parameters() if "embed_tokens" not in name]
    tensors.append(base.lm_head.weight)  # tied: read again as the projection
    return median_ms(lambda: [tensor.sum() for tensor in tensors], repeats)


def batched_step_ms(base, slots: int, context: int, repeats: int) -> float | None:
    """One continuous-batching step (slots rows at `context` cached tokens each) with the teacher's
    logits, as the data generator runs it; None on transformers' forward (no slot cache there)."""
    if base.engine is None:
        return None
    cache = base.engine.new_slots(slots, context + repeats + 4)
    ids = torch.arange(slots) + 100

    def step() -> None:
        base.engine.project(base.engine.forward_slots(ids, cache))

    cache.lengths = [context] * slots
    return median_ms(step, repeats)


@torch.inference_mode()
def measure(dtype: str, engine: str, sizes: list[int], context: int, repeats: int, groups: bool) -> dict:
    base = load_base_model(ModelConfig(dtype=dtype, device="cpu", engine=engine))
    cache = base.new_cache(context + max(sizes) + 1)
    prompt = torch.arange(1000, 1000 + context) % base.model.config.vocab_size
    forward_tokens(base, cache, prompt, torch.arange(context))
    row = {"dtype": dtype, "engine": base.engine_name, "weights_ms": weight_read_ms(base, repeats),
           "ms": {size: median_ms(lambda: _verify_once(base, cache, context, size), repeats) for size in sizes},
           "batch48_ms": batched_step_ms(base, 48, context, repeats)}
    if groups:
        for size in (sizes[0], sizes[-1]):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    _verify_once(base, cache, context, size)
            by_group: dict[str, float] = defaultdict(float)
            for event in prof.key_averages():
                by_group[_group(event.key)] += event.self_cpu_time_total / 1000 / repeats
            total = sum(by_group.values())
            shares = ", ".join(f"{g} {ms:.1f} ms ({ms / total:.0%})"
                               for g, ms in sorted(by_group.items(), key=lambda kv: -kv[1]))
            print(f"  {dtype} {base.engine_name} {size} tokens, self CPU time by group: {shares}")
    return row


def print_table(rows: list[dict], sizes: list[int], context: int) -> None:
    """A markdown table: per precision and forward, ms per verify of n tokens, x the weight read."""
    print("\n| precision | forward | weight read ms | " + " | ".join(f"n={n}" for n in sizes)
          + " | n=1 / weight read | batch-48 step ms (tokens/s) |")
    print("|" + "---|" * (len(sizes) + 5))
    for row in rows:
        plain = row["ms"][sizes[0]]
        cells = " | ".join(f"{row['ms'][n]:.1f} ({row['ms'][n] / plain:.2f}x)" for n in sizes)
        batch = row["batch48_ms"]
        batch_cell = f"{batch:.0f} ({48 * 1000 / batch:.0f})" if batch else "-"
        print(f"| {row['dtype']} | {row['engine']} | {row['weights_ms']:.1f} | {cells} | "
              f"{plain / row['weights_ms']:.2f}x | {batch_cell} |")
    print(f"\n(ms per forward over {context} cached tokens, median; in brackets: x a plain step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--engine", nargs="+", default=["lean", "hf"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-groups", action="store_true", help="skip the per-operation profile")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    rows = [measure(dtype, engine, args.sizes, args.context, args.repeats, not args.no_groups)
            for dtype in args.dtype for engine in args.engine]
    print_table(rows, args.sizes, args.context)


if __name__ == "__main__":
    main()
