"""Exact greedy simulation of tokens per step, for many trees at once.

Under greedy decoding the output is known in advance (plain greedy's), so whether a tree's
path is accepted depends only on the heads' proposals at each step's starting position and on
the next greedy tokens. One teacher-forced forward over prompt + greedy answer gives every
hidden state; each tree is then walked step by step without further model calls. The result
equals the real decoder's tokens per step up to floating-point near-ties (tests check it).

    python -m offline.simulate --answers data/mt_bench_answers.jsonl \
        --trees fixed:mc_sim_7b_63,fixed:calibrated,dynamic:8,dynamic:16,dynamic:32,dynamic:63 \
        --out assets/results/tokens_per_step.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from core.drafters.interface import heads_for_drafting
from core.drafters.medusa import DraftProjection, MedusaHeads, default_heads
from core.model import BaseModel, ModelConfig, load_base_model
from core.families import FAMILIES
from core.strategy import DEFAULT_FIXED_TREE, StrategyError, parse_strategy
from core.tree import CandidateTree, dynamic_tree, named_tree
from core.verify import VerifyOutput, forward_tokens


@dataclass(frozen=True)
class TreeSpec:
    """`fixed:<name>` or `dynamic:<budget>`."""

    label: str
    fixed: CandidateTree | None = None
    budget: int = 0


def parse_tree_spec(text: str) -> TreeSpec:
    """A tree to simulate from a strategy in the one grammar: `fixed[:<name>]` or `dynamic[:<budget>]`."""
    spec = parse_strategy(text)
    entry = FAMILIES.get(spec.family)
    if entry is not None and entry.decodes_fixed_tree:
        return TreeSpec(label=spec.text, fixed=named_tree(spec.tree or DEFAULT_FIXED_TREE))
    # the Medusa heads' own ranked tree (the family the fixed tree is drawn beside), of a fixed size
    if entry is not None and entry.fixed_beside and not (spec.auto or spec.lookup or spec.store or spec.engine):
        return TreeSpec(label=spec.text, budget=spec.node_budget)
    raise StrategyError(f"the simulator replays fixed and dynamic:<budget> trees over recorded answers, not {text!r}")


@torch.inference_mode()
def sequence_states(base: BaseModel, ids: list[int]) -> VerifyOutput:
    """One causal forward of `ids` from an empty cache by the forward the decoder runs (the exact
    engine's in its precision: a prefill's rows are the plain steps' numbers), so drafters are
    scored, and trained, on the hidden states they read when decoding."""
    cache = base.new_cache(len(ids) + 1)
    return forward_tokens(base, cache, torch.tensor(ids), torch.arange(len(ids)))  # hidden [n, H]


@torch.inference_mode()
def head_proposals(base: BaseModel, heads: MedusaHeads, prompt_ids: list[int], answer_ids: list[int],
                   width: int, draft: DraftProjection | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`width` head probabilities and ids at every answer position, teacher-forced (one forward):
    ([L, K, width], [L, K, width]); row j holds what the heads guess from the hidden state that predicts a_j.
    The heads rank their draft vocabulary, as the decoder's do (`draft`: pass one to reuse it)."""
    hidden = sequence_states(base, prompt_ids + answer_ids).hidden  # [P+L, H]
    starts = hidden[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(answer_ids)]  # [L, H]: predicts a_i
    if draft is None:  # draft exactly as the decoder does (bf16 under an fp32 base where bf16 is fast)
        heads, draft, _ = heads_for_drafting(heads, base)
    starts = starts.to(next(heads.parameters()).dtype)
    probs, ids = heads.propose(starts, width, draft)  # [K, L, width] each
    return probs.transpose(0, 1).cpu(), ids.transpose(0, 1).cpu()  # [L, K, width]


def accepted_depth(tree: CandidateTree, ranks: list[int | None]) -> int:
    """Deepest d such that the path of the true tokens' ranks (r1..rd) is a node of the tree."""
    depth = 0
    for d in range(1, len(ranks) + 1):
        path = tuple(ranks[:d])
        if None in path or path not in tree:
            break
        depth = d
    return depth


def simulate_answer(probs: torch.Tensor, ids: torch.Tensor, answer_ids: list[int], spec: TreeSpec,
                    top_m: int) -> tuple[int, int]:
    """(steps, tokens emitted by steps) for one greedy answer under one tree."""
    length = len(answer_ids)
    i, steps, emitted = 0, 0, 0
    while i < length - 1:
        depth_limit = probs.shape[1]
        if spec.fixed is not None:
            tree = spec.fixed
        else:
            tree = dynamic_tree(probs[i, :, :top_m], spec.budget)
        ranks: list[int | None] = []
        for d in range(1, min(depth_limit, tree.max_depth) + 1):
            if i + d >= length:
                break
            hits = (ids[i, d - 1] == answer_ids[i + d]).nonzero()
            ranks.append(int(hits[0]) if len(hits) else None)
        accepted = accepted_depth(tree, ranks)
        step_tokens = min(accepted + 1, length - 1 - i)
        steps += 1
        emitted += step_tokens
        i += step_tokens
    return steps, emitted


def simulate(base: BaseModel, heads: MedusaHeads, rows: list[dict], specs: list[TreeSpec], top_m: int = 32
             ) -> dict[str, float]:
    """Mean accepted tokens per step of each tree over greedy answers `rows` (prompt_ids, answer_ids)."""
    width = max([top_m] + [s.fixed.max_rank + 1 for s in specs if s.fixed is not None])
    totals = {s.label: [0, 0] for s in specs}
    drafting, draft, _ = heads_for_drafting(heads, base)  # as the decoder drafts (bf16 where bf16 is fast)
    for row in tqdm(rows, desc="simulate"):
        probs, ids = head_proposals(base, drafting, row["prompt_ids"], row["answer_ids"], width, draft)
        for spec in specs:
            steps, emitted = simulate_answer(probs, ids, row["answer_ids"], spec, top_m)
            totals[spec.label][0] += steps
            totals[spec.label][1] += emitted
    return {label: emitted / steps for label, (steps, emitted) in totals.items() if steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, required=True, help="JSONL with prompt_ids and answer_ids")
    parser.add_argument("--trees", default="fixed:mc_sim_7b_63,fixed:calibrated,dynamic:8,dynamic:16,dynamic:32,dynamic:63")
    parser.add_argument("--top-m", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    base = load_base_model(ModelConfig(dtype="fp32", device="cpu"))
    heads, heads_source = default_heads(base.model.config.hidden_size, base.model.config.vocab_size)
    rows = [json.loads(line) for line in args.answers.read_text().split("\n") if line.strip()]
    specs = [parse_tree_spec(s) for s in args.trees.split(",")]
    result = {"answers": str(args.answers), "prompts": len(rows), "new_tokens": sum(len(r["answer_ids"]) for r in rows),
              "heads": heads_source, "model": base.source, "top_m": args.top_m,
              "tokens_per_step": simulate(base, heads, rows, specs, args.top_m)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["tokens_per_step"], indent=1))


if __name__ == "__main__":
    main()
