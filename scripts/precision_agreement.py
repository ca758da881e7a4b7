"""How close each precision's greedy answers are to the fp32 model's, token for token.

Plain greedy decoding of the benchmark's prompts (MT-Bench every 8th question, the second evaluation
set every 6th: 21 prompts) in fp32 and in each mode; per mode: the prompts whose answer equals fp32's, the mean
tokens before the first divergence, and the share of positions that agree. A mode may name its cache's
keys and values: `gguf-q8/kv32` keeps them fp32 (the gguf modes' default is fp16).

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python scripts/precision_agreement.py \\
        [--modes gguf-q8 gguf-q8/kv32] [--tokens 128] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from core.decoder import DecodeConfig, PageViews, decode
from core.machine import cpu_name
from core.model import REPO_ROOT, ModelConfig, load_base_model
from offline.bench import read_prompts

SETS = ((REPO_ROOT / "assets/data/mt_bench.jsonl", 8), (REPO_ROOT / "assets/data/spec_mix.jsonl", 6))  # (set, stride)


def prompts() -> list[str]:
    """The benchmark's held-out-style prompts (`core.bench --stride 8` and `--stride 6`)."""
    return [prompt.text for path, stride in SETS for prompt in read_prompts(path, None, stride)]


def load(mode: str):
    """The base model in `mode` (`name/kv32`: its cache's keys and values in fp32)."""
    precision, _, cache = mode.partition("/")
    base = load_base_model(ModelConfig(dtype=precision))
    if cache:
        if cache != "kv32":
            raise ValueError(f"unknown cache option {cache!r}: use kv32")
        from core.engine.exact import ExactLlama
        from core.paths import gguf_location
        folder, name = gguf_location()
        engine = base.engine
        base.__dict__["engine"] = ExactLlama(engine.lean, engine.kernels, engine.mode, folder / name,
                                             kv_dtype=torch.float32)
    return base


def answers(mode: str, texts: list[str], tokens: int) -> list[list[int]]:
    base = load(mode)
    config = DecodeConfig(spec="ar", max_new_tokens=tokens)
    return [decode(base, None, text, config, page=PageViews(texts=False)).output_ids
            for text in tqdm(texts, desc=mode, unit="prompt")]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["gguf-q8", "gguf-q8/kv32"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    texts = prompts()
    reference = answers("fp32", texts, args.tokens)
    result = {"cpu": cpu_name(), "prompts": len(texts), "tokens": args.tokens, "modes": {}}
    for mode in args.modes:
        outputs = answers(mode, texts, args.tokens)
        prefix = [first_divergence(out, ref) for out, ref in zip(outputs, reference)]
        agree = [sum(x == y for x, y in zip(out, ref)) / max(len(ref), 1) for out, ref in zip(outputs, reference)]
        result["modes"][mode] = {"identical": sum(out == ref for out, ref in zip(outputs, reference)),
                                 "mean_tokens_before_divergence": round(statistics.fmean(prefix), 1),
                                 "positions_agreeing": round(statistics.fmean(agree), 3),
                                 "first_divergence": prefix}
        print(f"{mode}: {result['modes'][mode]['identical']}/{len(texts)} answers identical to fp32's, "
              f"{result['modes'][mode]['mean_tokens_before_divergence']} tokens before the first divergence, "
              f"{result['modes'][mode]['positions_agreeing']:.1%} of positions agree", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
