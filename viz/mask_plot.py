"""The tree-attention mask of one verified tree as a heatmap with token labels."""
from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go

from viz import style
from viz.labels import TokenBytes, token_label
from viz.tree_plot import empty_figure, node_texts

if TYPE_CHECKING:
    from core.records import TreeOutcome

MASKED, VISIBLE, ON_PATH = 0, 1, 2
MASK_COLORSCALE = [  # discrete: three bands over [0, 2]
    [0.0, "#ffffff"], [0.333, "#ffffff"],
    [0.333, "#93c5fd"], [0.666, "#93c5fd"],
    [0.666, style.ACCEPTED], [1.0, style.ACCEPTED],
]
MAX_TICKS = 40


def mask_values(mask: list[list[bool]], accepted: list[int]) -> list[list[int]]:
    """0 masked, 1 visible, 2 visible and both query and key on the accepted path. [n+1][n+1]."""
    on_path = set(accepted)
    return [[(ON_PATH if (q in on_path and k in on_path) else VISIBLE) if allowed else MASKED
             for k, allowed in enumerate(row)] for q, row in enumerate(mask)]


def _node_labels(texts: list[str]) -> list[str]:
    """Unique category names for the axes: node index and (escaped, visible) token."""
    return [f"{i}·{token_label(text, 8)}" for i, text in enumerate(texts)]


def _ticks(labels: list[str]) -> list[str]:
    stride = max(1, -(-len(labels) // MAX_TICKS))  # ceil: at most MAX_TICKS labels per axis
    return labels[::stride]


def mask_figure(outcome: TreeOutcome, context_length: int | None = None,
                token_bytes: TokenBytes | None = None) -> go.Figure:
    """Heatmap of `outcome.tree.buffers().attn_mask`: row = query node, column = key node.

    Every node also sees all committed context tokens (not drawn); inside the tree a node sees
    itself and its ancestors only, which is what lets one forward verify many branches.
    Hover text comes from the axis categories, so the figure stays small for 256 nodes.
    """
    mask = outcome.tree.mask_rows()  # [n+1][n+1] bool
    if len(mask) == 1:  # a plain step: nothing to mask, say what it attends instead of a lone square
        seen = f"the {context_length} context tokens" if context_length is not None else "every context token"
        return empty_figure(f"A plain step verifies no tree: its one query (the root, the last token emitted) attends "
                            f"to {seen} and itself, causal attention as in ordinary decoding. A tree's mask appears "
                            f"here when a step verifies candidates.", height=180)
    texts = node_texts(outcome, token_bytes)[0]  # whole characters where a node completes one
    labels = _node_labels(texts)
    z = mask_values(mask, list(outcome.accepted_nodes))
    size = len(mask)
    gap = 1 if size <= 80 else 0
    heatmap = dict(  # plain data: plotly's builders cost 25 ms a mask
        type="heatmap", z=z, x=labels, y=labels, zmin=0, zmax=2, colorscale=MASK_COLORSCALE, showscale=False,
        xgap=gap, ygap=gap,
        hovertemplate="query %{y}<br>key %{x}<br>%{z} (0 masked · 1 visible · 2 accepted path)<extra></extra>",
    )
    context = f" + the {context_length} context tokens every node sees" if context_length is not None else ""
    title = (f"Tree attention mask: {size}×{size}{context}<br><sup>row = query node, column = key it may attend"
             f" to · blue = visible · green = accepted path · white = masked</sup>")
    height = int(min(900, max(360, 160 + 14 * min(size, 60))))
    ticks = _ticks(labels)
    layout = {**style.base_layout(title, height), **dict(
        xaxis={"type": "category", "tickvals": ticks, "ticktext": ticks, "tickangle": -60, "side": "top",
               "tickfont": {"size": 10}, "constrain": "domain"},
        yaxis={"type": "category", "tickvals": ticks, "ticktext": ticks, "autorange": "reversed",
               "tickfont": {"size": 10}, "scaleanchor": "x", "constrain": "domain"},
        margin={"l": 110, "r": 20, "t": 160, "b": 20},
    )}
    return style.figure_of([heatmap], layout)
