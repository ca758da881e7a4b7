"""A verified candidate tree as a layered graph: root on the left, one column per head.

Nodes are coloured and sized by their joint head probability; the accepted path is drawn
in green (edges and node outlines) and the bonus token, the base model's own next token
after the accepted path, is an extra orange star in a lane above the tree.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import networkx as nx
import plotly.graph_objects as go

from viz import style
from viz.labels import token_hover, token_label

if TYPE_CHECKING:  # core is only needed for type hints
    from core.records import TreeOutcome

ROW_PX = 17  # vertical pixels per leaf row
LABEL_PX = 15  # two labels in one column need this much room
MIN_HEIGHT, MAX_HEIGHT = 300, 1100
MARGIN_TOP, MARGIN_BOTTOM = 70, 95  # title + subtitle above; axis ticks + legend below
HEADER_PX = MARGIN_TOP + MARGIN_BOTTOM
LEGEND_GAP_PX = 32  # legend starts this far below the plot area (under the tick labels)


@dataclass(frozen=True)
class TreeLayout:
    """Node positions: x is the depth (head), y the row (0 at the top)."""

    x: list[float]  # [n+1]
    y: list[float]  # [n+1]
    rows: int  # leaf rows used


def tree_graph(parents: Sequence[int], ranks: Sequence[int]) -> nx.DiGraph:
    """Directed parent -> child graph; children are inserted in rank order (best first)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(parents)))
    children = sorted(range(1, len(parents)), key=lambda node: (parents[node], ranks[node], node))
    graph.add_edges_from((parents[node], node) for node in children)
    return graph


def tree_layout(parents: Sequence[int], depths: Sequence[int], ranks: Sequence[int]) -> TreeLayout:
    """Tidy layered layout: leaves on consecutive rows in DFS order, parents centred on their children."""
    graph = tree_graph(parents, ranks)
    y = [0.0] * len(parents)
    next_row = 0
    for node in nx.dfs_postorder_nodes(graph, source=0):
        children = list(graph.successors(node))
        if children:
            y[node] = (y[children[0]] + y[children[-1]]) / 2
        else:
            y[node] = float(next_row)
            next_row += 1
    return TreeLayout(x=[float(d) for d in depths], y=y, rows=max(next_row, 1))


def _ranks(outcome: TreeOutcome) -> list[int]:
    """Rank of each node within its head's top-m (the root counts as rank 0). Length n+1."""
    return [0] + [path[-1] for path in outcome.tree.paths]


def _marginals(scores: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Each node's own head probability: its joint probability over its parent's."""
    out = [1.0]
    for node in range(1, len(scores)):
        parent_score = scores[parents[node]]
        out.append(scores[node] / parent_score if parent_score > 0 else 0.0)
    return out


def _log_prob(p: float) -> float:
    return max(math.log10(p), style.LOG_PROB_FLOOR) if p > 0 else style.LOG_PROB_FLOOR


def _marker_size(p: float) -> float:
    return 8.0 + 14.0 * (1.0 - _log_prob(p) / style.LOG_PROB_FLOOR)


def _labelled_nodes(layout: TreeLayout, scores: Sequence[float], accepted: Sequence[int], row_px: float) -> set[int]:
    """Nodes that get a text label: accepted ones first, then by score, never two too close in a column."""
    min_gap = LABEL_PX / max(row_px, 1e-6)
    order = list(accepted) + sorted((i for i in range(len(scores)) if i not in set(accepted)),
                                    key=lambda i: -scores[i])
    placed: dict[float, list[float]] = {}
    chosen: set[int] = set()
    for node in order:
        column = placed.setdefault(layout.x[node], [])
        if node in accepted or all(abs(layout.y[node] - other) >= min_gap for other in column):
            column.append(layout.y[node])
            chosen.add(node)
    return chosen


def _node_texts(outcome: TreeOutcome) -> list[str]:
    """Token text of every node (falls back to the id when texts were not recorded)."""
    if len(outcome.node_texts) == len(outcome.node_tokens):
        return list(outcome.node_texts)
    return [f"#{token}" for token in outcome.node_tokens]


def _hover(node: int, text: str, token: int, depth: int, rank: int, marginal: float, joint: float,
           accepted: bool, copied: bool = False) -> str:
    if node == 0:
        return (f"<b>root</b> {token_hover(text)} (id {token})<br>the base model's own next token,"
                f"<br>emitted by the previous step" + ("<br><b>✓ start of the accepted path</b>" if accepted else ""))
    verdict = "<b>✓ accepted</b>" if accepted else "✗ not accepted"
    if copied:
        return (f"<b>{token_hover(text)}</b> (id {token})<br>node {node} · depth {depth} · ◆ prompt lookup: copied from"
                f" where the last words appeared before<br>estimated p = {joint:.3f} (learned this run)<br>{verdict}")
    return (f"<b>{token_hover(text)}</b> (id {token})<br>node {node} · head {depth} · rank {rank}"
            f"<br>marginal p = {marginal:.4f}<br>joint p = {joint:.2e}<br>{verdict}")


def _edge_xy(layout: TreeLayout, edges: Sequence[tuple[int, int]]) -> tuple[list, list]:
    xs: list[float | None] = []
    ys: list[float | None] = []
    for parent, child in edges:
        xs += [layout.x[parent], layout.x[child], None]
        ys += [layout.y[parent], layout.y[child], None]
    return xs, ys


def _height(rows: int) -> int:
    return int(min(MAX_HEIGHT, max(MIN_HEIGHT, HEADER_PX + ROW_PX * (rows + 1))))


def tree_figure(outcome: TreeOutcome, title: str) -> go.Figure:
    """The verified tree of one step: nodes by joint probability, accepted path and bonus token highlighted.

    Works for the autoregressive case (a root-only tree) and for trees of a few hundred nodes
    (labels are thinned where they would overlap; hover shows every node).
    """
    tree = outcome.tree
    parents, depths, ranks = tree.parents, tree.depths, _ranks(outcome)
    scores = list(outcome.node_scores)
    layout = tree_layout(parents, depths, ranks)
    height = _height(layout.rows)
    row_px = (height - HEADER_PX) / (layout.rows + 1)
    accepted = list(outcome.accepted_nodes)
    accepted_set = set(accepted)
    copied = outcome.lookup_nodes
    texts = _node_texts(outcome)
    marginals = _marginals(scores, parents)
    labelled = _labelled_nodes(layout, scores, accepted, row_px)

    fig = go.Figure()
    plain_edges = [(parents[i], i) for i in range(1, len(parents)) if not (i in accepted_set)]
    path_edges = list(zip(accepted[:-1], accepted[1:]))
    xs, ys = _edge_xy(layout, plain_edges)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"color": style.EDGE, "width": 1.2},
                             hoverinfo="skip", name="candidate edge", showlegend=False))
    xs, ys = _edge_xy(layout, path_edges) if path_edges else ([None], [None])  # keeps the legend entry
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"color": style.ACCEPTED, "width": 5},
                             hoverinfo="skip", name="accepted path", showlegend=True))

    bonus_x = layout.x[accepted[-1]] + 1
    bonus_y = -1.0  # a lane above the tree
    fig.add_trace(go.Scatter(x=[layout.x[accepted[-1]], bonus_x], y=[layout.y[accepted[-1]], bonus_y],
                             mode="lines", line={"color": style.BONUS, "width": 3, "dash": "dot"},
                             hoverinfo="skip", showlegend=False, name="bonus edge"))

    fig.add_trace(go.Scatter(
        x=layout.x, y=layout.y, mode="markers+text", name="candidate (colour = joint p)",
        text=[token_label(texts[i]) if i in labelled else "" for i in range(len(texts))],
        textposition=["middle left"] + ["middle right"] * (len(texts) - 1),  # root label left of the fan
        textfont={"size": 12, "color": style.TEXT},
        hovertext=[_hover(i, texts[i], outcome.node_tokens[i], depths[i], ranks[i], marginals[i], scores[i],
                          i in accepted_set, i in copied) for i in range(len(texts))],
        hoverinfo="text",
        marker={
            "size": [_marker_size(p) for p in scores],
            "symbol": ["diamond" if i in copied else "circle" for i in range(len(texts))],
            "color": [_log_prob(p) for p in scores],
            "colorscale": style.PROB_COLORSCALE, "cmin": style.LOG_PROB_FLOOR, "cmax": 0.0,
            "line": {"color": [style.ACCEPTED if i in accepted_set else "white" for i in range(len(texts))],
                     "width": [3.5 if i in accepted_set else 1 for i in range(len(texts))]},
            "colorbar": {"title": {"text": "joint p", "side": "right"}, "thickness": 12, "len": 0.6,
                         "tickvals": [-4, -3, -2, -1, 0], "ticktext": ["≤1e-4", "0.001", "0.01", "0.1", "1"]},
            "showscale": tree.num_nodes > 0,  # a lone root has nothing to compare
        },
        customdata=list(range(len(texts))),
    ))
    if copied:  # a legend entry for the chain's marker
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="◆ copied by prompt lookup",
                                 marker={"symbol": "diamond", "size": 12, "color": style.TEXT}))
    bonus_text = outcome.bonus_text if outcome.bonus_text else f"#{outcome.bonus_token}"
    fig.add_trace(go.Scatter(
        x=[bonus_x], y=[bonus_y], mode="markers+text", name="bonus token (base model)",
        text=[token_label(bonus_text)], textposition="middle right",
        textfont={"size": 13, "color": style.BONUS},
        marker={"symbol": "star", "size": 22, "color": style.BONUS, "line": {"color": "white", "width": 1}},
        hovertext=[f"<b>bonus {token_hover(bonus_text)}</b> (id {outcome.bonus_token})<br>the base model's own"
                   f" next token after the accepted path;<br>it is the next step's root"],
        hoverinfo="text",
    ))

    max_x = max(layout.x + [bonus_x])
    # columns beyond the tree hold only the bonus token (the base model's, not a head's)
    # a lookup chain may run deeper than the heads: its columns are numbered by depth, compactly
    column = "" if copied else "head "
    tick_text = ["root"] + [f"{column}{d}" if d <= tree.max_depth else "bonus" for d in range(1, int(max_x) + 1)]
    accepted_heads = len(accepted) - 1
    accepted_copies = sum(1 for node in accepted if node in copied)
    source = f" ({accepted_copies} ◆ copied)" if copied else ""
    subtitle = (f"{tree.num_nodes} candidate{'s' if tree.num_nodes != 1 else ''} · {accepted_heads} "
                f"{'' if copied else 'head '}guess{'es' if accepted_heads != 1 else ''} accepted{source} + bonus = "
                f"{accepted_heads + 1} token{'s' if accepted_heads else ''}")
    fig.update_layout(**style.base_layout(f"{title}<br><sup>{subtitle}</sup>", height))
    fig.update_layout(
        showlegend=True,
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": -LEGEND_GAP_PX / (height - HEADER_PX),
                "yanchor": "top", "font": {"size": 12}},
        xaxis={"tickvals": list(range(int(max_x) + 1)), "ticktext": tick_text, "range": [-0.7, max_x + 1.0],
               "showgrid": True, "gridcolor": style.GRID, "zeroline": False, "side": "bottom", "fixedrange": False},
        yaxis={"visible": False, "range": [layout.rows - 0.4, -1.8]},  # max first: row 0 at the top
        margin={"l": 20, "r": 10, "t": MARGIN_TOP, "b": MARGIN_BOTTOM},
    )
    return fig


def empty_figure(message: str, height: int = 300) -> go.Figure:
    """A blank figure with a centred message (before the first step, or when not applicable)."""
    message = "<br>".join(textwrap.wrap(message, width=48))
    fig = go.Figure()
    fig.update_layout(**style.base_layout("", height))
    fig.update_layout(
        xaxis={"visible": False}, yaxis={"visible": False},
        annotations=[{"text": message, "x": 0.5, "y": 0.5, "xref": "paper", "yref": "paper",
                      "showarrow": False, "font": {"size": 15, "color": "#64748b"}}],
    )
    return fig
