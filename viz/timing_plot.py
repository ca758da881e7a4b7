"""Where the time went: phases per step, tokens per step, and tokens over time per strategy."""
from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

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
    """Stacked wall time per phase: the selected step (left) and every step so far (right)."""
    shown = index + 1
    fig = make_subplots(rows=1, cols=2, column_widths=[0.16, 0.84], horizontal_spacing=0.08,
                        subplot_titles=(f"step {shown}", f"all {len(records)} steps"))
    phases = list(DECODE_PHASES) + (["compare"] if any(r.times.compare > 0 for r in records) else [])
    steps = _step_numbers(records)
    current = records[index]
    for phase in phases:
        colour = style.PHASE_COLOURS[phase]
        pattern = {"shape": "/"} if phase == "compare" else None
        fig.add_trace(go.Bar(x=[f"step {shown}"], y=[_ms(getattr(current.times, phase))], name=PHASE_NAMES[phase],
                             marker={"color": colour, "pattern": pattern}, legendgroup=phase, showlegend=False,
                             hovertemplate=f"{PHASE_NAMES[phase]}: %{{y:.1f}} ms<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Bar(x=steps, y=[_ms(getattr(r.times, phase)) for r in records], name=PHASE_NAMES[phase],
                             marker={"color": colour, "pattern": pattern}, legendgroup=phase,
                             hovertemplate=f"step %{{x}} · {PHASE_NAMES[phase]}: %{{y:.1f}} ms<extra></extra>"),
                      row=1, col=2)
    fig.add_vrect(x0=shown - 0.5, x1=shown + 0.5, row=1, col=2, fillcolor="#fde68a", opacity=0.45,
                  line_width=0, layer="below")
    fig.update_layout(**style.base_layout("Wall time per phase (ms)", 400))
    fig.update_layout(barmode="stack", bargap=0.15,
                      legend={"orientation": "h", "y": -0.25, "yanchor": "top", "x": 0, "font": {"size": 12}},
                      margin={"l": 50, "r": 20, "t": 80, "b": 110})
    fig.update_xaxes(**_step_axis(len(records)), row=1, col=2)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    return fig


def accepted_figure(records: Sequence[StepRecord], index: int) -> go.Figure:
    """Tokens emitted per step (accepted head guesses + bonus), with the fixed tree's count where compared."""
    steps = _step_numbers(records)
    shown = index + 1
    counts = [len(r.new_tokens) for r in records]
    strategy = records[0].strategy if records else DYNAMIC
    colour = style.STRATEGY_COLOURS.get(strategy, style.STRATEGY_COLOURS[DYNAMIC])
    fig = style.new_figure(go.Bar(
        x=steps, y=counts, name=f"{strategy} (this run)",
        marker={"color": colour, "line": {"color": [style.BONUS if s == shown else colour for s in steps],
                                          "width": [3 if s == shown else 0 for s in steps]}},
        hovertemplate="step %{x}: %{y} tokens<extra></extra>",
    ))
    compared = [(r.index + 1, r.comparison.accepted_length) for r in records if r.comparison is not None]
    if compared:
        fig.add_trace(go.Scatter(x=[s for s, _ in compared], y=[c for _, c in compared], mode="markers",
                                 name="fixed tree, same context", marker={"color": style.STRATEGY_COLOURS[FIXED],
                                                                         "size": 9, "symbol": "diamond"},
                                 hovertemplate="step %{x}: fixed tree would give %{y}<extra></extra>"))
    if counts:
        mean = sum(counts) / len(counts)
        fig.add_hline(y=mean, line={"color": style.TEXT, "dash": "dash", "width": 1},
                      annotation_text=f"mean {mean:.2f}", annotation_position="top left")
    fig.update_layout(**style.base_layout("Tokens per step (accepted guesses + bonus)", 380))
    fig.update_layout(legend={"orientation": "h", "y": -0.3, "yanchor": "top", "x": 0, "font": {"size": 12}},
                      xaxis=_step_axis(len(records)), yaxis={"title": "tokens", "rangemode": "tozero", "dtick": 1},
                      margin={"l": 50, "r": 20, "t": 60, "b": 110})
    return fig


def _cumulative(seconds: Sequence[float], tokens: Sequence[int]) -> tuple[list[float], list[int]]:
    return [0.0] + list(accumulate(seconds)), [0] + list(accumulate(tokens))


def cumulative_figure(records: Sequence[StepRecord], ar: ArBaseline | None) -> go.Figure:
    """Generated tokens against decode time (prefill excluded) for this run, the fixed tree and plain decoding.

    The fixed-tree line is counterfactual: the fixed tree verified on the same contexts as this
    run (what it would have accepted; its verify time is measured). The autoregressive line is
    measured when a plain run exists, otherwise estimated from one measured single-token forward.
    """
    strategy = records[0].strategy if records else DYNAMIC
    fig = style.new_figure()
    x, y = _cumulative([r.times.total for r in records], [len(r.new_tokens) for r in records])
    fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"{strategy} (measured)",
                             line={"color": style.STRATEGY_COLOURS.get(strategy, style.TEXT), "width": 3},
                             hovertemplate="%{x:.2f} s: %{y} tokens<extra></extra>"))
    total_tokens = y[-1]
    compared = [r for r in records if r.comparison is not None]
    if compared and len(compared) == len(records):
        fx, fy = _cumulative([r.times.heads + r.times.compare + r.times.commit for r in records],
                             [r.comparison.accepted_length for r in records])
        fig.add_trace(go.Scatter(x=fx, y=fy, mode="lines", name="fixed tree (counterfactual, same contexts)",
                                 line={"color": style.STRATEGY_COLOURS[FIXED], "width": 2, "dash": "dash"},
                                 hovertemplate="%{x:.2f} s: %{y} tokens<extra></extra>"))
    if ar is not None and strategy != AUTOREGRESSIVE and total_tokens:
        _add_ar_line(fig, ar, total_tokens)
    end = max((x for trace in fig.data for x in trace.x if x is not None), default=0.0)
    fig.update_layout(**style.base_layout("Tokens vs decode time (prefill excluded)", 380))
    fig.update_layout(legend={"orientation": "h", "y": -0.3, "yanchor": "top", "x": 0, "font": {"size": 12}},
                      xaxis={"title": "seconds", "range": [0, max(end, 1e-3) * 1.03]},
                      yaxis={"title": "tokens", "range": [0, max(total_tokens, 1) * 1.05]},
                      margin={"l": 50, "r": 20, "t": 60, "b": 130})
    return fig


def _add_ar_line(fig: go.Figure, ar: ArBaseline, total_tokens: int) -> None:
    colour = style.STRATEGY_COLOURS[AUTOREGRESSIVE]
    if ar.measured:
        seconds = ar.step_seconds[:total_tokens]
        x, y = _cumulative(seconds, [1] * len(seconds))
        name = "autoregressive (measured plain run)"
    elif ar.seconds_per_token:
        x, y = [0.0, total_tokens * ar.seconds_per_token], [0, total_tokens]
        name = f"autoregressive (estimated: {1000 * ar.seconds_per_token:.0f} ms per token, measured 1-token forward)"
    else:
        return
    fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name,
                             line={"color": colour, "width": 2, "dash": "dot" if not ar.measured else "solid"},
                             hovertemplate="%{x:.2f} s: %{y} tokens<extra></extra>"))
