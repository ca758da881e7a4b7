"""What a forward of n rows costs on the exact engine, per precision: the README's cost table.

For each precision: the weight bytes a step reads and the time to stream them once (from this
machine's measured read bandwidth), a plain step (one row, forward + logits) and a verify of
1-64 rows over a 100-token cache (forward + logits of every row), median of 11 after 3 warm-up
calls, and a prefill of 200, 700 and 1,400 prompt tokens (forward + the last row's logits, best of
3, in prompt tokens a second). Run it alone.

    PYTHONPATH=. .venv/bin/python scripts/exact_costs.py [--precisions gguf-q8 gguf fp32 bf16]
        [--int8-paths avx2 avx512-vnni] [--out FILE.json]

`--int8-paths` measures gguf-q8 once per named 8-bit implementation (forced; `auto` is the default choice)
in the same run, after the precisions.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from core.engine.lean import median_ms
from core.machine import cpu_name, cpu_summary
from core.model import ModelConfig, load_base_model

ROWS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (200, 700, 1400)
CONTEXT = 100
REPEATS = 11


def read_bandwidth_gb_s() -> float:
    """GB/s of summing a 512 MB fp32 tensor (more than any cache holds)."""
    data = torch.ones(128 * 2**20)
    return data.numel() * 4 / 1e9 / (median_ms(lambda: data.sum(), 5) / 1e3)


def costs(precision: str, bandwidth: float, int8_path: str = "auto") -> dict:
    base = load_base_model(ModelConfig(dtype=precision))
    engine = base.engine
    if int8_path != "auto":
        engine.kernels.set_int8_path(int8_path)
    prompt = torch.arange(1000, 1000 + CONTEXT)
    cache = engine.new_cache()
    engine.forward(prompt, torch.arange(CONTEXT), cache)
    tokens = torch.arange(2000, 2000 + max(ROWS))

    def verify(rows: int) -> None:
        hidden = engine.forward(tokens[:rows], torch.arange(CONTEXT, CONTEXT + rows), cache)
        engine.project(hidden)
        cache.crop(CONTEXT)

    for rows in ROWS:  # warm: the first calls of a size pay for allocations and cold caches
        for _ in range(3):
            verify(rows)
    by_rows = {rows: round(median_ms(lambda: verify(rows), REPEATS), 2) for rows in ROWS}
    prefill = {count: round(prefill_tokens_per_s(engine, count)) for count in PREFILL_TOKENS}
    weight_bytes = getattr(engine, "weight_bytes", 0)
    if int8_path != "auto":
        engine.kernels.set_int8_path("auto")
    return {"precision": precision, "int8_path": int8_path, "engine": base.engine_name,
            "detail": engine.describe() if hasattr(engine, "describe") else base.engine_name,
            "weight_mb": round(weight_bytes / 1e6, 1), "weight_read_ms": round(weight_bytes / 1e9 / bandwidth * 1e3, 2),
            "ms_by_rows": by_rows, "x_plain": {rows: round(ms / by_rows[1], 2) for rows, ms in by_rows.items()},
            "prefill_tokens_per_s": prefill}


def prefill_tokens_per_s(engine, count: int, repeats: int = 3) -> float:
    """Prompt tokens a second of a `count`-token prefill (forward + the last row's logits), best of `repeats`."""
    ids = torch.randint(100, 40000, (count,), generator=torch.Generator().manual_seed(count))
    best = float("inf")
    for _ in range(repeats):
        cache = engine.new_cache()
        started = time.perf_counter()
        engine.project(engine.forward(ids, torch.arange(count), cache)[-1:])
        best = min(best, time.perf_counter() - started)
    return count / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["gguf-q8", "gguf", "fp32", "bf16"])
    parser.add_argument("--int8-paths", nargs="*", default=[])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    bandwidth = read_bandwidth_gb_s()
    modes = [costs(p, bandwidth) for p in args.precisions]
    modes += [costs("gguf-q8", bandwidth, path) for path in args.int8_paths]
    result = {"cpu": cpu_name(), "cpu_summary": cpu_summary(), "threads": torch.get_num_threads(),
              "read_gb_s": round(bandwidth, 1), "context": CONTEXT, "modes": modes}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
