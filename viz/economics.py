"""When does a tree pay? The arithmetic of speculation, for a lecture: data in, a figure and a sentence out.

A step accepts each guessed depth k with probability a_k given the depth above it, so it yields
1 + a_1 + a_1 a_2 + ... tokens (the bonus token always comes); it costs what drafting and the verify of
its tree cost, counted in plain steps (one plain step yields one token). The speed-up over plain
decoding is tokens a step / what a step costs: a tree pays above the line where the two are equal.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from viz.facts import ratio_verdict
from viz.style import ACCEPTED, BONUS, GRID, ROOT, TEXT, figure_of

# the Medusa heads' conditional acceptance by depth on MT-Bench (top-1 .324 / .177 / .124 / .091): where
# the sliders start, with a 4-node chain's cost on this project's CPU
DEFAULT_ACCEPTANCE = (0.32, 0.55, 0.70, 0.73)
DEFAULT_COST = 1.5

# EAGLE-2 on Vicuna-7B, one A100 (Li et al., 2024, arXiv 2406.16858): about 4.3 tokens a step at a
# 3.0-3.5x speed-up, so a step costs about 1.3 plain steps there (the paper's own ratios)
PAPER_7B_GPU = ("7B on a GPU (EAGLE-2)", 4.3, 4.3 / 3.3, "EAGLE-2 on Vicuna-7B, one A100: Li et al., 2024")


@dataclass(frozen=True)
class TreePoint:
    """A measured (or published) step: its tokens and its cost in plain steps."""

    label: str  # short: drawn beside the point
    tokens_per_step: float
    cost: float  # what a step costs, in plain steps (drafting + verify + the rest)
    detail: str = ""  # on hover

    @property
    def speedup(self) -> float:
        return self.tokens_per_step / self.cost


def expected_tokens(acceptance: Sequence[float]) -> float:
    """1 + a_1 + a_1 a_2 + ...: the tokens a step yields when depth k is accepted with probability a_k
    given the depths above it."""
    total, reached = 1.0, 1.0
    for rate in acceptance:
        reached *= rate
        total += reached
    return total


def economics_sentence(acceptance: Sequence[float], cost: float) -> str:
    """The sum in words, with its numbers."""
    terms = " + ".join(["1"] + [" x ".join(f"{a:.2f}" for a in acceptance[:k + 1]) for k in range(len(acceptance))])
    tokens = expected_tokens(acceptance)
    state = ratio_verdict(tokens / cost)
    return (f"A step yields {terms} = **{tokens:.2f} tokens** and costs **{cost:.2f} plain steps**: "
            f"{tokens:.2f} / {cost:.2f} = **{tokens / cost:.2f}x** plain decoding. "
            f"The tree {'pays' if state == 'wins' else state}.")


def economics_figure(acceptance: Sequence[float], cost: float, points: Sequence[TreePoint]) -> object:
    """Tokens a step against what a step costs: the break-even line, the setting on the sliders and the
    marked points (this machine's measured trees, the GPU's, a 7B model's from the papers)."""
    tokens = expected_tokens(acceptance)
    top = max(5.0, 1.15 * max([tokens, cost, *(p.tokens_per_step for p in points), *(p.cost for p in points)]))
    traces = [
        {"type": "scatter", "x": [0, top], "y": [0, top], "mode": "lines", "name": "break-even: tokens = cost",
         "line": {"color": ROOT, "dash": "dash"}, "hoverinfo": "skip"},
        {"type": "scatter", "x": [0, top, 0], "y": [0, top, top], "fill": "toself", "mode": "none",
         "fillcolor": "rgba(21, 128, 61, 0.08)", "name": "the tree pays", "hoverinfo": "skip"},
        {"type": "scatter", "x": [p.cost for p in points], "y": [p.tokens_per_step for p in points],
         "mode": "markers+text", "text": [f"{p.label}: {p.speedup:.2f}x" for p in points],
         "textposition": _label_sides(points, top), "marker": {"size": 12, "color": BONUS},
         "hovertext": [f"{p.detail}: {p.tokens_per_step:.2f} tokens a step, a step {p.cost:.2f} plain steps"
                       for p in points], "hoverinfo": "text", "name": "measured / published", "cliponaxis": False},
        {"type": "scatter", "x": [cost], "y": [tokens], "mode": "markers+text",
         "text": [f"the sliders: {tokens / cost:.2f}x"], "textposition": "top center",
         "marker": {"size": 16, "color": ACCEPTED, "symbol": "diamond"}, "name": "your setting", "cliponaxis": False},
    ]
    layout = {"title": {"text": "When does a tree pay? speed-up = tokens a step / what a step costs"},
              "xaxis": {"title": {"text": "what a step costs, in plain steps (drafting + verify)"}, "range": [0, top],
                        "gridcolor": GRID},
              "yaxis": {"title": {"text": "tokens a step"}, "range": [0, top], "gridcolor": GRID},
              "height": 460, "margin": {"l": 60, "r": 30, "t": 60, "b": 110}, "font": {"color": TEXT},
              "legend": {"orientation": "h", "y": -0.25}}
    return figure_of(traces, layout)


def _label_sides(points: Sequence[TreePoint], top: float) -> list[str]:
    """Where each point's label goes: towards the middle of the plot (never past its edge), and above /
    below in turn where points lie close together (no label over another)."""
    sides = []
    for i, point in enumerate(points):
        across = "left" if point.cost > top / 2 else "right"
        near = [q for q in points[:i] if abs(q.cost - point.cost) < top / 6 and abs(q.tokens_per_step -
                                                                                 point.tokens_per_step) < top / 12]
        sides.append(f"{'bottom' if len(near) % 2 else 'top'} {across}" if near or any(
            abs(q.cost - point.cost) < top / 6 and abs(q.tokens_per_step - point.tokens_per_step) < top / 12
            for q in points[i + 1:]) else f"middle {across}")
    return sides


def measured_points(results: Path) -> list[TreePoint]:
    """The trees this project measured (committed benchmark results: each file's largest fixed-size
    dynamic tree against its plain decoding), then the papers' 7B point."""
    points = []
    for path in sorted(results.glob("bench_*.json")):
        summary = json.loads(path.read_text()).get("summary", {})
        plain = summary.get("ar", {}).get("ms_per_step")
        sized = [name for name in summary if name.startswith("dynamic:") and name.split(":")[1].isdigit()]
        if not plain or not sized:
            continue
        name = max(sized, key=lambda n: int(n.split(":")[1]))
        where = "H200" if "gpu" in path.stem else "CPU"
        prompts = "MT-Bench" if "mtbench" in path.stem else "2nd set"
        machine = "one H200" if where == "H200" else "a 2-core CPU"
        points.append(TreePoint(f"{where}, {prompts}", summary[name]["mean_accepted"],
                                summary[name]["ms_per_step"] / plain,
                                f"{name} ({name.split(':')[1]} nodes) on {machine}, {prompts}, this project's benchmark"))
    return points + [TreePoint(*PAPER_7B_GPU)]
