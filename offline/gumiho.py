"""Gumiho as a configuration of the lab's drafters, measured held out before anything ships.

Gumiho (Li et al., 2025, arXiv 2503.10135) drafts the first tokens serially with a transformer
(they matter most: every later token is accepted only if they are) and the later ones in parallel
with cheap heads. Here the serial part is the shipped EAGLE layer (EAGLE-2's grown tree for the first
`serial` depths) and the parallel part the shipped Medusa heads (head d's guesses for depth d below
the `beam` best nodes of the depth above: `core.drafters.grown.grow_parallel`); the budget's best
nodes are kept as for every grown tree.

Exact greedy simulation over the held-out answers (the base model's own greedy text, so a node is
accepted exactly when it is the answer's next token), the same walk as `offline.train_eagle`'s
for EAGLE alone and `offline.simulate`'s for Medusa's dynamic tree, at the same budgets:

    python -m offline.gumiho --out assets/results/gumiho_round27.json

Gumiho ships as a family only if it beats both EAGLE and Hydra on held-out tokens per step at the
same budget (issue 45).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from core.drafters.eagle import EAGLE_BEAM, EAGLE_DEPTH, EagleLayer, default_eagle, grow_eagle_nodes
from core.drafters.grown import GrownNode, Growth, accepted_depth, grow_parallel
from core.drafters.interface import heads_for_drafting
from core.drafters.layers import KVRows
from core.drafters.medusa import DEFAULT_HEADS_DIR, MedusaHeads, load_heads
from core.machine import cpu_name
from core.model import BaseModel, ModelConfig, load_base_model
from offline.eagle_features import extract
from offline.simulate import TreeSpec, head_proposals, simulate_answer
from offline.train import held_out_sets, repo_path
from offline.train_eagle import BUDGETS, WIDTH

SERIAL_DEPTHS = (1, 2, 3)  # EAGLE depths before the parallel heads take over


def configurations(heads_depth: int) -> dict[str, int]:
    """Label -> serial depth: EAGLE alone grows to its own depth, each Gumiho hands over to the heads."""
    return {"eagle": EAGLE_DEPTH, **{f"gumiho(eagle {s} + medusa {_depths(s + 1, heads_depth)})": s
                                     for s in SERIAL_DEPTHS if s < heads_depth}}


def _depths(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def gumiho_nodes(eagle_nodes: list[GrownNode], head_probs: torch.Tensor, head_ids: torch.Tensor, serial: int
                 ) -> list[GrownNode]:
    """The EAGLE nodes of the first `serial` depths, then the heads' from depth `serial` + 1 on."""
    kept = [n for n in eagle_nodes if len(n.path) <= serial]
    if serial >= head_probs.shape[0]:
        return kept
    return grow_parallel(kept, head_probs, head_ids, first_depth=serial + 1, beam=EAGLE_BEAM,
                         children=min(WIDTH, EAGLE_BEAM))


@torch.inference_mode()
def answer_tokens_per_step(layer: EagleLayer, base: BaseModel, heads: MedusaHeads, row: dict,
                           budgets: tuple[int, ...]) -> dict[str, list[int]]:
    """(steps, tokens) of one greedy answer under each configuration and budget, and Medusa's dynamic tree."""
    features = extract(base, [row])
    answer = features.tokens.tolist()
    embed = base.model.get_input_embeddings()
    projection = layer.draft_projection(base.lm_head)
    fused = torch.cat([features.low, features.mid, features.high], dim=-1).float()  # [L, 3H]
    outputs, cache = layer.extend(None, fused, embed(features.tokens))  # [L, H]
    drafting, draft, _ = heads_for_drafting(heads, base)
    probs, ids = head_proposals(base, drafting, row["prompt_ids"], row["answer_ids"], WIDTH, draft)  # [L, K, width]
    configs = configurations(probs.shape[1])
    growth_at: dict[int, Growth] = {}
    totals: dict[str, list[int]] = {}
    for label, serial in configs.items():
        for budget in budgets:
            i, steps, emitted = 0, 0, 0
            while i < len(answer) - 1:
                if i not in growth_at:  # EAGLE's nodes from the cache as decoding holds it at position i
                    at_i = KVRows(keys=cache.keys[:, :i + 1], values=cache.values[:, :i + 1])
                    growth_at[i] = grow_eagle_nodes(layer, embed, projection, at_i, outputs[i], budget=max(budgets),
                                                    width=WIDTH, beam=EAGLE_BEAM, depth=EAGLE_DEPTH)
                growth = growth_at[i]
                growth_nodes = gumiho_nodes(growth.nodes, probs[i], ids[i], serial)
                tree = replace(growth, nodes=growth_nodes).best(budget, kind="eagle")
                step = min(accepted_depth(tree, answer, i) + 1, len(answer) - 1 - i)
                steps, emitted, i = steps + 1, emitted + step, i + step
            totals[f"{label}:{budget}"] = [steps, emitted]
    for budget in budgets:
        totals[f"dynamic:{budget}"] = _dynamic_steps(probs, ids, answer, budget)
    return totals


def _dynamic_steps(probs: torch.Tensor, ids: torch.Tensor, answer: list[int], budget: int) -> list[int]:
    """(steps, tokens) of Medusa's dynamic tree over the same proposals (`offline.simulate`'s walk)."""
    return list(simulate_answer(probs, ids, answer, TreeSpec(label=f"dynamic:{budget}", budget=budget), WIDTH))


def gumiho_report(base: BaseModel, layer: EagleLayer, heads: MedusaHeads, sets: dict[str, list[dict]],
                  budgets: tuple[int, ...] = BUDGETS) -> dict:
    """Tokens per step of EAGLE alone, each Gumiho configuration and Medusa's dynamic tree, per set."""
    report = {}
    for name, rows in sets.items():
        totals: dict[str, list[int]] = {}
        for row in tqdm([r for r in rows if len(r["answer_ids"]) >= 2], desc=f"Gumiho simulate {name}"):
            for label, (steps, emitted) in answer_tokens_per_step(layer, base, heads, row, budgets).items():
                pair = totals.setdefault(label, [0, 0])
                pair[0] += steps
                pair[1] += emitted
        report[name] = {label: round(emitted / steps, 4) for label, (steps, emitted) in totals.items() if steps}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/results/gumiho.json")
    parser.add_argument("--answers", type=int, default=0, help="answers per set (0: all)")
    args = parser.parse_args()
    started = time.time()
    base = load_base_model(ModelConfig(dtype="fp32", device="cpu", engine="hf"))
    layer = default_eagle()
    if layer is None or not (DEFAULT_HEADS_DIR / "heads.safetensors").exists():
        raise SystemExit("Gumiho reads the shipped EAGLE layer (assets/eagle) and Medusa heads (assets/heads)")
    sets = held_out_sets(base, 128)
    if args.answers:
        sets = {name: rows[:args.answers] for name, rows in sets.items()}
    report = {"eval": "exact greedy simulation over the base model's fp32 greedy answers (128 new tokens)",
              "beam": EAGLE_BEAM, "width": WIDTH, "cpu": cpu_name(),
              "tokens_per_step": gumiho_report(base, layer, load_heads(), sets)}
    report["seconds"] = round(time.time() - started, 1)
    out = repo_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["tokens_per_step"], indent=1))


if __name__ == "__main__":
    main()
