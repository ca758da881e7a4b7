"""Where the time went: phases per step, tokens per step, and tokens over time per strategy."""
from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Sequence

import plotly.graph_objects as go

from core.strategy import AUTOREGRESSIVE, DYNAMIC, FIXED
from viz import style
from viz.facts import ArBaseline

if TYPE_CHECKING:
    from core.records import StepRecord

DECODE_PHASES = ("heads", "tree", "verify", "accept", "commit")
PHASE_NAMES = {
    "heads": "heads propose",
    "tree": "build tree",
    "verify": "verify (one forward)",
    "accept": "accept",
    "commit": "commit KV cache",
    "compare": "fixed-tree comparison (display only)",
}


def _ms(seconds: float) -> float:
    return 1000.0 * seconds


def _step_numbers(records: Sequence[StepRecord]) -> list[int]:
    """Steps as users read them: from 1."""
    return [r.index + 1 for r in records]


def _step_axis(count: int) -> dict:
    """An x axis that shows every step of the run (fixed range, so no stale zoom crops the end)."""
    return {"title": "step", "range": [0.5, max(count, 1) + 0.5], "dtick": max(1, -(-count // 25))}


def phase_figure(records: Sequence[StepRecord], index: int) -> go.Figure:
    """Stacked wall time per phase: the selected step (left) and every step so far (right). Built as
    plain data (plotly's builders took 90 of a live step's page milliseconds)."""
    shown = index + 1
    phases = list(DECODE_PHASES) + (["compare"] if any(r.times.compare > 0 for r in records) else [])
    steps = _step_numbers(records)
    current = records[index]
    traces = []
    for phase in phases:
        marker = {"color": style.PHASE_COLOURS[phase], **({"pattern": {"shape": "/"}} if phase == "compare" else {})}
        traces.append({"type": "bar", "x": [f"step {shown}"], "y": [_ms(getattr(current.times, phase))],
                       "name": PHASE_NAMES[phase], "marker": marker, "legendgroup": phase, "showlegend": False,
                       "hovertemplate": f"{PHASE_NAMES[phase]}: %{{y:.1f}} ms<extra></extra>",
                       "xaxis": "x", "yaxis": "y"})
        traces.append({"type": "bar", "x": steps, "y": [_ms(getattr(r.times, phase)) for r in records],
                       "name": PHASE_NAMES[phase], "marker": marker, "legendgroup": phase,
                       "hovertemplate": f"step %{{x}} · {PHASE_NAMES[phase]}: %{{y:.1f}} ms<extra></extra>",
                       "xaxis": "x2", "yaxis": "y2"})
    left, right = [0.0, 0.12], [0.20, 1.0]  # the step shown | every step (0.16 : 0.84 of the width after the gap)
    titles = [{"text": text, "x": sum(domain) / 2, "y": 1.0, "xref": "paper", "yref": "paper", "xanchor": "center",
               "yanchor": "bottom", "showarrow": False, "font": {"size": 16}}
              for text, domain in ((f"step {shown}", left), (f"all {len(records)} steps", right))]
    highlight = {"type": "rect", "x0": shown - 0.5, "x1": shown + 0.5, "xref": "x2", "y0": 0, "y1": 1,
                 "yref": "y2 domain", "fillcolor": "#fde68a", "opacity": 0.45, "line": {"width": 0}, "layer": "below"}
    layout = {**style.base_layout("Wall time per phase (ms)", 400), "barmode": "stack", "bargap": 0.15,
              "legend": {"orientation": "h", "y": -0.25, "yanchor": "top", "x": 0, "font": {"size": 12}},
              "margin": {"l": 50, "r": 20, "t": 80, "b": 110},
              "xaxis": {"domain": left, "anchor": "y"}, "yaxis": {"anchor": "x", "domain": [0, 1], "title": {"text": "ms"}},
              "xaxis2": {"domain": right, "anchor": "y2", **_step_axis(len(records))},
              "yaxis2": {"anchor": "x2", "domain": [0, 1]}, "annotations": titles, "shapes": [highlight]}
    return style.figure_of(traces, layout)


def accepted_figure(records: Sequence[StepRecord], index: int) -> go.Figure:
    """Tokens emitted per step (accepted head guesses + bonus), with the fixed tree's count where compared."""
    steps = _step_numbers(records)
    shown = index + 1
    counts = [len(r.new_tokens) for r in records]
    strategy = records[0].family if records else DYNAMIC
    colour = style.STRATEGY_COLOURS.get(strategy, style.STRATEGY_COLOURS[DYNAMIC])
    traces = [{"type": "bar", "x": steps, "y": counts, "name": f"{strategy} (this run)",
               "marker": {"color": colour, "line": {"color": [style.BONUS if s == shown else colour for s in steps],
                                                    "width": [3 if s == shown else 0 for s in steps]}},
               "hovertemplate": "step %{x}: %{y} tokens<extra></extra>"}]
    compared = [(r.index + 1, r.comparison.accepted_length) for r in records if r.comparison is not None]
    if compared:
        traces.append({"type": "scatter", "x": [s for s, _ in compared], "y": [c for _, c in compared],
                       "mode": "markers", "name": "fixed tree, same context",
                       "marker": {"color": style.STRATEGY_COLOURS[FIXED], "size": 9, "symbol": "diamond"},
                       "hovertemplate": "step %{x}: fixed tree would give %{y}<extra></extra>"})
    shapes, notes = [], []
    if counts:
        mean = sum(counts) / len(counts)
        shapes.append({"type": "line", "x0": 0, "x1": 1, "xref": "x domain", "y0": mean, "y1": mean, "yref": "y",
                       "line": {"color": style.TEXT, "dash": "dash", "width": 1}})
        notes.append({"text": f"mean {mean:.2f}", "x": 0, "xref": "x domain", "y": mean, "yref": "y",
                      "xanchor": "left", "yanchor": "bottom", "showarrow": False})
    layout = {**style.base_layout("Tokens per step (accepted guesses + bonus)", 380),
              "legend": {"orientation": "h", "y": -0.3, "yanchor": "top", "x": 0, "font": {"size": 12}},
              "xaxis": _step_axis(len(records)), "yaxis": {"title": {"text": "tokens"}, "rangemode": "tozero", "dtick": 1},
              "margin": {"l": 50, "r": 20, "t": 60, "b": 110}, "shapes": shapes, "annotations": notes}
    return style.figure_of(traces, layout)


def _cumulative(seconds: Sequence[float], tokens: Sequence[int]) -> tuple[list[float], list[int]]:
    return [0.0] + list(accumulate(seconds)), [0] + list(accumulate(tokens))


def cumulative_figure(records: Sequence[StepRecord], ar: ArBaseline | None) -> go.Figure:
    """Generated tokens against decode time (prefill excluded) for this run, the fixed tree and plain decoding.

    The fixed-tree line is counterfactual: the fixed tree verified on the same contexts as this
    run (what it would have accepted; its verify time is measured). The autoregressive line is
    measured when a plain run exists, otherwise estimated from one measured single-token forward.
    """
    strategy = records[0].family if records else DYNAMIC
    x, y = _cumulative([r.times.total for r in records], [len(r.new_tokens) for r in records])
    traces = [_line(x, y, f"{strategy} (measured)", {"color": style.STRATEGY_COLOURS.get(strategy, style.TEXT), "width": 3},
                    "lines+markers")]
    total_tokens = y[-1]
    compared = [r for r in records if r.comparison is not None]
    if compared and len(compared) == len(records):
        fx, fy = _cumulative([r.times.heads + r.times.compare + r.times.commit for r in records],
                             [r.comparison.accepted_length for r in records])
        traces.append(_line(fx, fy, "fixed tree (counterfactual, same contexts)",
                            {"color": style.STRATEGY_COLOURS[FIXED], "width": 2, "dash": "dash"}))
    plain = _ar_line(ar, total_tokens) if ar is not None and strategy != AUTOREGRESSIVE and total_tokens else None
    traces += [plain] if plain else []
    end = max((x for trace in traces for x in trace["x"] if x is not None), default=0.0)
    layout = {**style.base_layout("Tokens vs decode time (prefill excluded)", 380),
              "legend": {"orientation": "h", "y": -0.3, "yanchor": "top", "x": 0, "font": {"size": 12}},
              "xaxis": {"title": {"text": "seconds"}, "range": [0, max(end, 1e-3) * 1.03]},
              "yaxis": {"title": {"text": "tokens"}, "range": [0, max(total_tokens, 1) * 1.05]},
              "margin": {"l": 50, "r": 20, "t": 60, "b": 130}}
    return style.figure_of(traces, layout)


def _line(x: Sequence[float], y: Sequence[int], name: str, line: dict, mode: str = "lines") -> dict:
    return {"type": "scatter", "x": list(x), "y": list(y), "mode": mode, "name": name, "line": line,
            "hovertemplate": "%{x:.2f} s: %{y} tokens<extra></extra>"}


def _ar_line(ar: ArBaseline, total_tokens: int) -> dict | None:
    """Plain decoding's line: measured (its steps' own times), else estimated from one forward; None without either."""
    colour = style.STRATEGY_COLOURS[AUTOREGRESSIVE]
    if ar.measured:
        seconds = ar.step_seconds[:total_tokens]
        x, y = _cumulative(seconds, [1] * len(seconds))
        name = "autoregressive (measured plain run)"
    elif ar.seconds_per_token:
        x, y = [0.0, total_tokens * ar.seconds_per_token], [0, total_tokens]
        name = f"autoregressive (estimated: {1000 * ar.seconds_per_token:.0f} ms per token, measured 1-token forward)"
    else:
        return None
    return _line(x, y, name, {"color": colour, "width": 2, "dash": "dot" if not ar.measured else "solid"})
