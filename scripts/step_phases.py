"""Where a step's time goes at a short and a long context (ms per step by phase).

    python scripts/step_phases.py --dtype bf16 --strategy dynamic:auto+lookup

Decodes one short prompt (~100 tokens with the chat template) and one long one (~1,500: the
longest article of the second evaluation set) and prints the mean ms per step of each phase.
Uses only the public decoding API, so it also runs on older checkouts (for before/after).
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from offline.bench import parse_strategy
from core.decoder import DecodeConfig, PageViews, decode
from core.families import family
from core.model import ModelConfig, load_base_model

PHASES = ("heads", "tree", "verify", "accept", "commit")
SHORT = "Explain in a few sentences why the sky is blue, and what changes at sunset."


def long_prompt(root: Path) -> str:
    """The longest prompt of assets/data/spec_mix.jsonl (a summarization article)."""
    rows = [json.loads(line) for line in (root / "assets/data/spec_mix.jsonl").read_text().splitlines() if line]
    return max(rows, key=lambda r: len(r["prompt"]))["prompt"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--strategy", default="dynamic:auto+lookup")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts-from", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    base = load_base_model(ModelConfig(dtype=args.dtype, device="cpu"))
    base_config = DecodeConfig(max_new_tokens=args.tokens)
    configs = {"ar": parse_strategy("ar", base_config), args.strategy: parse_strategy(args.strategy, base_config)}
    heads, _ = family(configs[args.strategy].strategy).load_weights(base)  # what the strategy drafts with
    decode(base, heads, SHORT, replace(configs[args.strategy], max_new_tokens=8), page=PageViews(texts=False))  # warm-up
    for label, prompt in (("short", SHORT), ("long", long_prompt(args.prompts_from))):
        for name, config in configs.items():
            per_step, rates = {p: [] for p in PHASES}, []
            for _ in range(args.repeats):
                session = decode(base, heads, prompt, config, page=PageViews(texts=False))
                records = session.records
                for phase in PHASES:
                    per_step[phase].append(1000 * sum(getattr(r.times, phase) for r in records) / len(records))
                rates.append(sum(len(r.new_tokens) for r in records) / sum(r.times.total for r in records))
            context = len(session.prompt_ids)
            cells = " ".join(f"{p} {statistics.median(v):6.2f}" for p, v in per_step.items())
            print(f"{label:5s} context {context:5d} {name:28s} {cells} | tokens/step {session.tokens_per_step:.2f}"
                  f" tokens/s {statistics.median(rates):.1f}")


if __name__ == "__main__":
    main()
