"""What the page teaches, checked against the code that does it: "How it works" and the gallery's words."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from core.accept import AcceptConfig, accept_speculative
from core.sampling import SamplingConfig
from core.strategy import DEFAULT_FIXED_TREE
from core.tree import fixed_tree, load_named_trees
from core.verify import VerifyOutput

ASSETS = Path(__file__).resolve().parent.parent / "assets"
HOW = (ASSETS / "how_it_works.md").read_text(encoding="utf-8")


def _paragraph(title: str) -> str:
    found = re.search(rf"\*\*{re.escape(title)}.*?(?=\n\n|\Z)", HOW, re.S)
    assert found, title
    return " ".join(found.group(0).split())


def test_typical_acceptances_formula_is_the_codes():
    config = AcceptConfig()
    text = _paragraph("Acceptance")
    assert f"min({config.typical_threshold:g}, {config.typical_alpha:g} · exp(−H(p_u)))" in text


def test_speculative_sampling_is_described_as_the_code_does_it():
    """A guess is one proposal (q = 1): accepted with probability p(x); on a rejection x leaves p, the
    rest is renormalised, and the bonus is drawn from it (never x)."""
    text = _paragraph("Acceptance")
    assert "q(x) is 1" in text and "accepted with probability p(x)" in text and "removed from p" in text
    vocab, guessed = 6, 2
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.15, 0.15, 0.1]))
    verified = VerifyOutput(torch.zeros(2, 4), lambda hidden: logits.expand(hidden.shape[0], vocab))
    config = AcceptConfig(rule="speculative", sampling=SamplingConfig(temperature=1.0))
    tree, generator = fixed_tree([(0,)]), torch.Generator().manual_seed(0)
    runs, accepted = 4000, 0
    for _ in range(runs):
        result = accept_speculative(tree, torch.tensor([5, guessed]), verified, config, generator)
        if result.accepted_nodes == [0, 1]:
            accepted += 1
        else:
            assert result.bonus_token != guessed  # x was removed from the residual
    assert abs(accepted / runs - 0.3) < 0.03  # p(x), not min(1, p / q) with q the heads' probability


def test_the_fixed_tree_is_said_to_be_medusas_for_vicuna_7b():
    paths = load_named_trees()[DEFAULT_FIXED_TREE]
    text = _paragraph("Trees")
    assert f"`{DEFAULT_FIXED_TREE}`" in text and "Vicuna-7B" in text
    assert f"{len(paths)} nodes" in text and f"depth {max(map(len, paths))}" in text


def test_the_exactness_claim_names_every_precision_and_where_it_does_not_hold():
    from labstate.settings import PRECISIONS
    text = _paragraph("Exact in every precision")
    assert all(precision in text for precision in PRECISIONS)
    assert "`lean`" in text and "near-tie" in text  # the one forward that is exact only up to rounding


def test_how_it_works_promises_no_win_the_machine_has_not_measured():
    assert "are the ones that win" not in HOW and "nearly free" not in HOW


def test_the_gallery_says_what_each_of_its_rules_does():
    """Gallery words about speculative sampling say q = 1 (no "minus the draft's" residual), and the
    near-tie run says it was recorded without the exact kernels, as its trace's model line shows."""
    index = json.loads((ASSETS / "gallery" / "index.json").read_text())["runs"]
    texts = {row["name"]: json.loads((ASSETS / "gallery" / row["file"]).read_text()) for row in index}
    sampling = texts["speculative_sampling"]["meta"]
    words = " ".join([sampling["notice"], *sampling["notes"].values()])
    assert "minus the draft" not in words and "q(x) = 1" in words
    near_tie = texts["bf16_near_tie"]
    assert "lean forward" in near_tie["meta"]["notice"] and near_tie["meta"]["engine"] == "lean"
    assert all(json.loads((ASSETS / "gallery" / row["file"]).read_text())["meta"].get("engine") == "exact"
               for row in index if row["name"] != "bf16_near_tie")
    assert "gap 0 " not in json.dumps(near_tie["meta"]["notes"])


def test_when_a_tree_pays_is_the_sum_the_sentence_shows():
    """Issue 69: tokens a step = 1 + a1 + a1 a2 + ...; the speed-up is that over a step's cost in plain
    steps, and the figure marks the sliders' point, the measured trees and the papers' 7B point."""
    from pathlib import Path

    from viz.economics import (PAPER_7B_GPU, TreePoint, economics_figure, economics_sentence, expected_tokens,
                               measured_points)
    assert expected_tokens([0.5, 0.5]) == 1.75 and expected_tokens([]) == 1.0
    sentence = economics_sentence([0.5, 0.5], 1.25)
    assert "1 + 0.50 + 0.50 x 0.50 = **1.75 tokens**" in sentence and "1.75 / 1.25 = **1.40x**" in sentence
    assert "pays" in sentence and "loses" in economics_sentence([0.1], 2.0)
    points = measured_points(Path(__file__).resolve().parent.parent / "assets" / "results")
    assert points[-1].label == PAPER_7B_GPU[0] and any(p.label.startswith("CPU") for p in points)
    cpu = next(p for p in points if p.label.startswith("CPU"))
    assert cpu.speedup < 1 and points[-1].speedup > 3  # a tree loses on two cores, pays on a 7B GPU
    figure = economics_figure([0.5, 0.5], 1.25, [TreePoint("x", 2.0, 4.0)])
    ours = next(t for t in figure.data if t.name == "your setting")
    assert list(ours.x) == [1.25] and list(ours.y) == [1.75] and "1.40x" in ours.text[0]


def test_the_economics_sliders_refuse_what_they_cannot_hold():
    import gradio as gr
    import pytest

    import app
    figure, sentence = app.on_economics(0.3, 0.5, 0.7, 0.7, 1.5, [])
    assert "tokens" in sentence and figure.data
    for bad in ((1.5, 0.5, 0.7, 0.7, 1.5), (0.3, 0.5, 0.7, 0.7, 0.5), ("x", 0.5, 0.7, 0.7, 1.5)):
        with pytest.raises(gr.Error):
            app.on_economics(*bad, [])
