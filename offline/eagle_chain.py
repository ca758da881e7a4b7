"""Why the EAGLE layer's own guesses score below its given-path accuracy: the chain's earlier misses.

Own-guess accuracy at depth d (each depth fed the layer's own top-1 before it) counts a position as
right when the d-th guess of the greedy chain is the answer's token; a chain whose earlier guess was
wrong conditions depth d on a token the answer does not have, so it is rarely right there, and a
drafted node below a wrong guess can never be accepted anyway. This splits own-guess accuracy by
whether the chain's earlier guesses were right, on the held-out answers, for the shipped layer:

    PYTHONPATH=. .venv/bin/python -m offline.eagle_chain [--depths 3] [--out assets/results/eagle_chain.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from core.drafters.eagle import EagleLayer, load_eagle
from core.model import BaseModel, ModelConfig, load_base_model
from offline.eagle_features import FusedFeatures, extract
from offline.train import held_out_sets
from offline.train_eagle import _states_fed, answer_batch


@torch.inference_mode()
def chain_accuracy(layer: EagleLayer, base: BaseModel, features: FusedFeatures, depths: int) -> dict[str, list[float]]:
    """Per depth: top-1 given the path, fed its own guesses, the share of positions whose earlier own
    guesses were all right, and own-guess top-1 where they were / were not."""
    embed = base.model.get_input_embeddings().weight.float()
    projection = layer.draft_projection(base.lm_head)
    starts = features.starts
    lengths = features.remaining[starts] + 1
    given, own, counted, earlier_right, own_after_right, own_after_wrong = (torch.zeros(depths) for _ in range(6))
    for answer in range(len(starts)):
        fused, rows, lens = answer_batch(features, starts, lengths, torch.tensor([answer]), depths)
        valid = fused.shape[1] - depths  # positions with a target at every depth
        if valid <= 0:
            continue
        tokens = features.tokens[rows]  # [1, T + depths]
        by_path = _states_fed(layer, fused, embed, tokens, lens, depths, projection, own_guesses=False)
        by_own = _states_fed(layer, fused, embed, tokens, lens, depths, projection, own_guesses=True)
        chain_right = torch.ones(valid, dtype=torch.bool)  # [valid]: the own guesses before this depth all right
        for depth in range(depths):
            target = tokens[0, depth + 1:depth + 1 + valid]  # [valid]
            path_hit = by_path[depth][0, :valid, 0] == target
            own_hit = by_own[depth][0, :valid, 0] == target
            given[depth] += path_hit.sum()
            own[depth] += own_hit.sum()
            counted[depth] += valid
            earlier_right[depth] += chain_right.sum()
            own_after_right[depth] += (own_hit & chain_right).sum()
            own_after_wrong[depth] += (own_hit & ~chain_right).sum()
            chain_right &= own_hit
    return {"given_path": (given / counted).tolist(), "own_guesses": (own / counted).tolist(),
            "earlier_guesses_right": (earlier_right / counted).tolist(),
            "own_where_earlier_right": (own_after_right / earlier_right.clamp_min(1)).tolist(),
            "own_where_earlier_wrong": (own_after_wrong / (counted - earlier_right).clamp_min(1)).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base = load_base_model(ModelConfig(dtype="fp32", device="cpu", engine="hf"))
    layer = load_eagle().float().eval()
    report = {}
    for name, rows in held_out_sets(base, 128).items():
        features = extract(base, [row for row in rows if len(row["answer_ids"]) >= 2])
        report[name] = {key: [round(value, 3) for value in values]
                        for key, values in chain_accuracy(layer, base, features, args.depths).items()}
        print(name, json.dumps(report[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
