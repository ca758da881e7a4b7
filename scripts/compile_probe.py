"""Does `torch.compile` pay for the lean forward on this machine? One measurement, not a feature.

    python scripts/compile_probe.py --dtype fp32 --context 100 --sizes 1 16

For a plain step (1 token) and a chain verify of n tokens over `context` cached tokens it times:
the lean forward as the lab runs it (each projection on the kernel measured fastest here), the
same forward with every projection on `F.linear` (what a compiled graph can trace: the split GEMV
runs on a worker thread), and that forward compiled by inductor (dynamic shapes, so a growing
context does not recompile at every step). It prints the compile time, the median ms of each and
the largest difference of the hidden states from the eager forward.
"""
from __future__ import annotations

import argparse
import time

import torch

from core.machine import cpu_name
from core.model import ModelConfig, load_base_model
from forward_profile import median_ms  # scripts/ is on the path when a script runs


def _step(layers, lean, cache, context: int, size: int) -> torch.Tensor:
    """One forward of `size` new tokens after `context` cached ones (a causal chain), then the
    cache cropped back, so every call measures the same work."""
    ids = (torch.arange(size) + 2000)[None]  # [1, n]
    positions = (torch.arange(size) + context)[None]  # [1, n]
    mask = lean.attention_mask(size, context, None)  # causal among the new tokens
    cache.reserve(size)
    hidden = layers(ids, positions, cache, mask)  # [1, n, H]
    cache.crop(context)
    return hidden


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtype}")
    base = load_base_model(ModelConfig(dtype=args.dtype, device="cpu", engine="lean"))
    lean = base.engine
    cache = lean.new_cache(args.context + max(args.sizes) + 8)
    lean.forward(torch.arange(args.context) + 1000, torch.arange(args.context), cache)  # a causal prefill

    chosen = {id(m): dict(m.kernels) for m in lean.matmuls()}
    results = {}
    for size in args.sizes:
        results[(size, "eager, chosen kernels")] = median_ms(
            lambda: _step(lean._layers, lean, cache, args.context, size), args.repeats)
    for matmul in lean.matmuls():
        matmul.kernels = {}  # every projection on F.linear
    for size in args.sizes:
        results[(size, "eager, F.linear")] = median_ms(
            lambda: _step(lean._layers, lean, cache, args.context, size), args.repeats)

    compiled = torch.compile(lean._layers, dynamic=True)
    for size in args.sizes:
        eager = _step(lean._layers, lean, cache, args.context, size)
        start = time.perf_counter()
        first = _step(compiled, lean, cache, args.context, size)
        compile_s = time.perf_counter() - start
        gap = (first - eager).abs().max().item()
        results[(size, "compiled, F.linear")] = median_ms(
            lambda: _step(compiled, lean, cache, args.context, size), args.repeats)
        print(f"n={size}: first compiled call {compile_s:.1f} s, max |hidden - eager| {gap:.2e}")
    for matmul in lean.matmuls():
        matmul.kernels = chosen[id(matmul)]

    print("\n| variant | " + " | ".join(f"n={n} ms" for n in args.sizes) + " |")
    print("|---|" + "---|" * len(args.sizes))
    for variant in ("eager, chosen kernels", "eager, F.linear", "compiled, F.linear"):
        cells = " | ".join(f"{results[(n, variant)]:.1f}" for n in args.sizes)
        print(f"| {variant} | {cells} |")


if __name__ == "__main__":
    main()
