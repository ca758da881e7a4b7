"""Ship a trained Medusa candidate: its weights into assets/heads, ranking `--depth-vocab` rows of its
draft vocabulary per head when decoding, and its calibrated tree into assets/trees.json.

    python -m offline.ship_heads data/heads_candidate --depth-vocab 4096,4096,2048,2048

This only copies; what ships is decided first on held-out tokens a step of both sets (`offline.bench`,
docs/RESULTS.md). Training ranks more rows at depth 1 than decoding does (head 1's right guesses lie
in the most frequent tokens, so decoding reads a quarter of the rows for the same tokens a step).
"""
from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

from core.drafters.medusa import DEFAULT_HEADS_DIR, checked_depth_vocab, load_heads
from core.tree import TREES_FILE, fixed_tree

CALIBRATED_NOTE = "calibrated: Medusa's greedy construction from the shipped heads' MT-Bench top-k accuracies"


def ship_heads(candidate: Path, depth_vocab: tuple[int, ...] = (), *, heads_dir: Path = DEFAULT_HEADS_DIR,
               trees_file: Path = TREES_FILE) -> None:
    """Copy `candidate` (weights, report, config with `depth_vocab` when given) into `heads_dir` and its
    `calibrated_tree.json` into `trees_file`'s `calibrated` tree. ValueError, with nothing written, when
    the candidate does not load, the sizes do not fit its heads or its calibrated tree is missing."""
    candidate = Path(candidate)
    heads = load_heads(candidate)  # loads (and checks) before anything is overwritten
    config = heads.config
    if depth_vocab:
        config = replace(config, depth_vocab=checked_depth_vocab(depth_vocab, config.num_heads,
                                                                 config.draft_vocab_size))
    if not (candidate / "calibrated_tree.json").exists():
        raise ValueError(f"{candidate} has no calibrated_tree.json (offline.train writes it)")
    choices = json.loads((candidate / "calibrated_tree.json").read_text())
    fixed_tree(choices)  # a valid tree, or ValueError
    heads_dir = Path(heads_dir)
    heads_dir.mkdir(parents=True, exist_ok=True)
    for name in ("heads.safetensors", "report.json"):
        if (candidate / name).exists():
            shutil.copyfile(candidate / name, heads_dir / name)
    fields = json.loads((candidate / "config.json").read_text()) | {"depth_vocab": list(config.depth_vocab)}
    (heads_dir / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    write_calibrated_tree(choices, trees_file)
    load_heads(heads_dir)  # what shipped loads


def write_calibrated_tree(choices: list[list[int]], trees_file: Path = TREES_FILE) -> None:
    """The shipped heads' calibrated tree (Medusa's greedy construction from their MT-Bench accuracies,
    `offline.train.calibrated_choices`) into `trees_file`."""
    trees = json.loads(Path(trees_file).read_text())
    trees["trees"]["calibrated"] = choices
    trees["calibrated_note"] = CALIBRATED_NOTE
    Path(trees_file).write_text(json.dumps(trees) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("candidate", type=Path)
    parser.add_argument("--depth-vocab", default="", help="rows each head ranks when decoding, e.g. 4096,4096,2048,2048")
    args = parser.parse_args()
    sizes = tuple(int(n) for n in args.depth_vocab.split(",") if n.strip())
    ship_heads(args.candidate, sizes)
    print(f"shipped {args.candidate} into {DEFAULT_HEADS_DIR} (depth_vocab {list(sizes) or 'as trained'})")


if __name__ == "__main__":
    main()
