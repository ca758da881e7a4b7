"""A verified candidate tree as a layered graph: root on the left, one column per depth, the bonus last.

Nodes are coloured and sized by their joint head probability; the accepted path is drawn in green
(edges and node outlines) and the bonus token, the base model's own next token after the accepted
path, is an orange star in its own column after the deepest node. Labels are fitted to their column
and thinned (accepted nodes first, then by joint probability) so that no two text boxes overlap at
the width the page gives the tree (`PLOT_WIDTH_PX`); hover shows every node.
"""
from __future__ import annotations

import html
import math
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import networkx as nx
import plotly.graph_objects as go

from core.families import depth_label, guesser
from viz import style
from viz.labels import TokenBytes, pieces, plotly_escape, shorten, text_px, token_hover, token_text, visible

if TYPE_CHECKING:  # core is only needed for type hints
    from core.records import TreeOutcome

PLOT_WIDTH_PX = 1000  # the tree tab's plot width on a laptop or projector (the figure is responsive)
FONT_PX = 12
LABEL_BOX_PX = 16  # a label's height, with a little air
ROW_PX = 18  # vertical pixels per leaf row
MIN_ROW_PX = 8  # rows close up to this so a tree fits a laptop's screen; wider trees grow past it
FIT_FIGURE_PX = 760  # a whole figure in view in a 1280x800 window (the page scrolls the tree into view)
MIN_PLOT_PX, MAX_HEIGHT = 220, 1200
MARGIN_BOTTOM, MARGIN_SIDE = 95, 20
TITLE_LINE_PX, TITLE_CHARS = 22, 90
COLOURBAR_PX = 90  # the colour bar and its tick labels
COLOURBAR_LEN_PX = 170
LEGEND_GAP_PX = 32  # legend starts this far below the plot area (under the tick labels)
LEFT_COLUMNS, RIGHT_COLUMNS = 1.0, 1.2  # x-axis room left of the root and right of the bonus
PLOT_AREA_WIDTH_PX = PLOT_WIDTH_PX - 2 * MARGIN_SIDE - COLOURBAR_PX  # the nodes' area, labels planned for it


@dataclass(frozen=True)
class TreeLayout:
    """Node positions: x is the depth, y the row (0 at the top)."""

    x: list[float]  # [n+1]
    y: list[float]  # [n+1]
    rows: int  # leaf rows used


@dataclass(frozen=True)
class Box:
    """A label's rectangle in pixels (x grows right, y grows down)."""

    left: float
    right: float
    top: float
    bottom: float

    def overlaps(self, other: Box) -> bool:
        return self.left < other.right and other.left < self.right and self.top < other.bottom and \
            other.top < self.bottom


@dataclass(frozen=True)
class Frame:
    """Data coordinates to pixels for the figure as drawn at PLOT_WIDTH_PX."""

    x_range: tuple[float, float]
    y_range: tuple[float, float]  # top row value first (the axis is reversed)
    width: float
    height: float

    def px(self, x: float, y: float) -> tuple[float, float]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        return (x - x0) / (x1 - x0) * self.width, (y - y1) / (y0 - y1) * self.height

    @property
    def column_px(self) -> float:
        return self.width / (self.x_range[1] - self.x_range[0])


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
    """Rank of each node within its head's top-m, or among its siblings in a Hydra tree (the root
    counts as rank 0). Length n+1."""
    return outcome.sibling_ranks()


def _marginals(scores: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Each node's own head probability: its joint probability over its parent's."""
    out = [1.0]
    for node in range(1, len(scores)):
        parent_score = scores[parents[node]]
        out.append(scores[node] / parent_score if parent_score > 0 else 0.0)
    return out


def _log_prob(p: float) -> float:
    return max(math.log10(p), style.LOG_PROB_FLOOR) if p > 0 else style.LOG_PROB_FLOOR


def _marker_size(p: float, copied: bool = False) -> float:
    size = 8.0 + 14.0 * (1.0 - _log_prob(p) / style.LOG_PROB_FLOOR)
    return max(size, 13.0) if copied else size  # a diamond needs room to read as one


def node_texts(outcome: TreeOutcome, token_bytes: TokenBytes | None = None) -> tuple[list[str], str]:
    """Each node's text and the bonus text: a character split over tokens is shown whole on the node that
    completes it (its ancestors' unfinished bytes come first), unfinished bytes as ‹0xNN› pieces."""
    tokens = list(outcome.node_tokens)
    if token_bytes is None or not all(t in token_bytes for t in tokens + [outcome.bonus_token]):
        texts = list(outcome.node_texts) if len(outcome.node_texts) == len(tokens) else [f"#{t}" for t in tokens]
        return texts, outcome.bonus_text or f"#{outcome.bonus_token}"
    parents = outcome.tree.parents
    pending: list[bytes] = []
    texts = []
    for node, token in enumerate(tokens):  # parents come before children
        text, tail = token_text(token_bytes[token], pending[parents[node]] if node else b"")
        pending.append(tail)
        texts.append(text + pieces(tail))
    bonus, tail = token_text(token_bytes[outcome.bonus_token], pending[outcome.accepted_nodes[-1]])
    return texts, bonus + pieces(tail)


def _fit(text: str, max_px: float) -> str:
    """The visible label, shortened with an ellipsis until it fits `max_px`."""
    label = visible(text)
    limit = len(label)
    while limit > 1 and text_px(shorten(label, limit), FONT_PX) > max_px:
        limit -= 1
    return shorten(label, limit)


def _label_box(frame: Frame, x: float, y: float, label: str, size: float, left: bool) -> Box:
    px, py = frame.px(x, y)
    width = text_px(label, FONT_PX)
    gap = size / 2 + 3
    horizontal = (px - gap - width, px - gap) if left else (px + gap, px + gap + width)
    return Box(horizontal[0], horizontal[1], py - LABEL_BOX_PX / 2, py + LABEL_BOX_PX / 2)


def _labels(frame: Frame, layout: TreeLayout, texts: Sequence[str], sizes: Sequence[float],
            order: Sequence[int], reserved: Sequence[Box]) -> list[str]:
    """A label for every node whose text box overlaps no other label (nodes in `order`, best first)."""
    max_px = frame.column_px - 2 * max(sizes) / 2 - 8
    placed = list(reserved)
    labels = [""] * len(texts)
    for node in order:
        label = _fit(texts[node], max(max_px, 3 * FONT_PX))
        box = _label_box(frame, layout.x[node], layout.y[node], label, sizes[node], left=node == 0)
        if not any(box.overlaps(other) for other in placed):
            placed.append(box)
            labels[node] = plotly_escape(label)
    return labels


CHAIN_SOURCE_TEXT = {"lookup": "◆ prompt lookup: copied from where the last words appeared before",
                     "store": "◆ datastore: what most often followed these words in the model's own answers"}


def _hover(node: int, text: str, token: int, depth: int, rank: int, marginal: float, joint: float,
           accepted: bool, copied: str = "", depth_word: str = "head") -> str:
    """Hover text of one node; `copied` names the chain drafter of a chain-only node ("" for head nodes),
    `depth_word` what guessed its depth (the family's `depth_label`: "head", "depth")."""
    if node == 0:
        return (f"<b>root</b> {token_hover(text)} (id {token})<br>the base model's own next token,"
                f"<br>emitted by the previous step" + ("<br><b>✓ start of the accepted path</b>" if accepted else ""))
    verdict = "<b>✓ accepted</b>" if accepted else "✗ not accepted"
    if copied:
        source = CHAIN_SOURCE_TEXT.get(copied, f"◆ {copied}")
        return (f"<b>{token_hover(text)}</b> (id {token})<br>node {node} · depth {depth} · {source}"
                f"<br>estimated p = {joint:.3f} (learned this run)<br>{verdict}")
    return (f"<b>{token_hover(text)}</b> (id {token})<br>node {node} · {depth_word} {depth} · rank {rank}"
            f"<br>marginal p = {marginal:.4f}<br>joint p = {joint:.2e}<br>{verdict}")


def _edge_xy(layout: TreeLayout, edges: Sequence[tuple[int, int]]) -> tuple[list, list]:
    xs: list[float | None] = []
    ys: list[float | None] = []
    for parent, child in edges:
        xs += [layout.x[parent], layout.x[child], None]
        ys += [layout.y[parent], layout.y[child], None]
    return xs, ys


def _wrap(text: str) -> list[str]:
    """Title lines of at most TITLE_CHARS characters (a title is never cut at the figure's edge)."""
    return textwrap.wrap(text, width=TITLE_CHARS) or [""]


def _subtitle(outcome: TreeOutcome, note: str) -> str:
    tree, copied = outcome.tree, outcome.lookup_nodes
    accepted = len(outcome.accepted_nodes) - 1
    accepted_copies = sum(1 for node in outcome.accepted_nodes if node in copied)
    source = f" ({accepted_copies} ◆ copied)" if copied else ""
    who = "" if copied else f"{guesser(tree.kind)} "
    text = (f"{tree.num_nodes} candidate{'s' if tree.num_nodes != 1 else ''} · {accepted} "
            f"{who}guess{'es' if accepted != 1 else ''} accepted{source} + bonus = "
            f"{accepted + 1} token{'s' if accepted else ''}")
    return f"{text} · {note}" if note else text


def _title_html(title: str, subtitle: str) -> tuple[str, int]:
    """The title and subtitle as wrapped lines, and the number of lines."""
    main = _wrap(title)
    sub = _wrap(subtitle)
    return "<br>".join(main) + "<br>" + "<br>".join(f"<sup>{line}</sup>" for line in sub), len(main) + len(sub)


def _row_px(rows: int, margin_top: float) -> float:
    """Pixels a leaf row gets: ROW_PX, closed up (to MIN_ROW_PX at least) so the figure fits FIT_FIGURE_PX."""
    fitting = (FIT_FIGURE_PX - margin_top - MARGIN_BOTTOM) / (rows + 2.0)  # the lane takes up to 1.6 rows
    return max(MIN_ROW_PX, min(ROW_PX, fitting))


def _frame(layout: TreeLayout, bonus_x: float, plot_height: float, top: float) -> Frame:
    return Frame(x_range=(-LEFT_COLUMNS, bonus_x + RIGHT_COLUMNS), y_range=(layout.rows - 0.4, top),
                 width=PLOT_AREA_WIDTH_PX, height=plot_height)


def tree_figure(outcome: TreeOutcome, title: str, note: str = "", token_bytes: TokenBytes | None = None,
                unverified: frozenset[int] = frozenset()) -> go.Figure:
    """The verified tree of one step: nodes by joint probability, accepted path and bonus token highlighted.

    `note` is added to the subtitle (why the tree is shallower than allowed, how the bonus was chosen).
    `unverified`: nodes of a proposal the step did not verify, drawn faded on grey edges.
    Works for the autoregressive case (a root-only tree) and for trees of a few hundred nodes.
    """
    tree = outcome.tree
    parents, depths, ranks = tree.parents, tree.depths, _ranks(outcome)
    scores = list(outcome.node_scores)
    layout = tree_layout(parents, depths, ranks)
    accepted = list(outcome.accepted_nodes)
    accepted_set = set(accepted)
    copied = outcome.lookup_nodes
    texts, bonus_text = node_texts(outcome, token_bytes)
    depth_word = depth_label(tree.kind)
    marginals = _marginals(scores, parents)
    sizes = [_marker_size(p, i in copied) for i, p in enumerate(scores)]
    title_text, title_lines = _title_html(title, _subtitle(outcome, note))
    margin_top = 20 + TITLE_LINE_PX * title_lines
    row_px = _row_px(layout.rows, margin_top)
    bonus_x = float(tree.max_depth + 1)  # its own column, after the deepest node
    bonus_y = -max(1.0, LABEL_BOX_PX / row_px)  # a lane above the tree, clear of the top row's labels
    rows_shown = layout.rows + 0.4 - bonus_y  # the y range: the last row's half, the rows, the lane and its air
    plot_height = max(MIN_PLOT_PX, min(MAX_HEIGHT - margin_top - MARGIN_BOTTOM, row_px * rows_shown))
    height = int(plot_height + margin_top + MARGIN_BOTTOM)
    # closed-up rows get smaller markers (a diamond keeps the size it needs to read as one)
    sizes = [max(13.0 if i in copied else 5.0, size * row_px / ROW_PX) for i, size in enumerate(sizes)]
    frame = _frame(layout, bonus_x, plot_height, top=bonus_y - 0.8)
    bonus_label = _fit(bonus_text, frame.column_px * RIGHT_COLUMNS - 14)
    reserved = [_label_box(frame, bonus_x, bonus_y, bonus_label, 22, left=False)]
    order = accepted + sorted((i for i in range(len(scores)) if i not in accepted_set), key=lambda i: -scores[i])
    labels = _labels(frame, layout, texts, sizes, order, reserved)

    traces: list[dict] = []  # plain data: plotly's builders cost 30+ ms a tree
    plain_edges = [(parents[i], i) for i in range(1, len(parents)) if i not in accepted_set and i not in unverified]
    path_edges = list(zip(accepted[:-1], accepted[1:]))
    xs, ys = _edge_xy(layout, plain_edges)
    traces.append(_scatter(x=xs, y=ys, mode="lines", line={"color": style.EDGE, "width": 1.2},
                             hoverinfo="skip", name="candidate edge", showlegend=False))
    if unverified:
        xs, ys = _edge_xy(layout, [(parents[i], i) for i in sorted(unverified)])
        traces.append(_scatter(x=xs, y=ys, mode="lines", line={"color": style.UNVERIFIED, "width": 1, "dash": "dot"},
                                 hoverinfo="skip", name="proposed, not verified (the budget's cut)", showlegend=True))
    xs, ys = _edge_xy(layout, path_edges) if path_edges else ([None], [None])  # keeps the legend entry
    traces.append(_scatter(x=xs, y=ys, mode="lines", line={"color": style.ACCEPTED, "width": 5},
                             hoverinfo="skip", name="accepted path", showlegend=True))
    # the bonus edge climbs its node's column to the lane above the tree, then runs along the lane to the
    # star: a column holds markers only (labels sit right of them), so the edge crosses no label
    last = accepted[-1]
    traces.append(_scatter(x=[layout.x[last], layout.x[last], bonus_x], y=[layout.y[last], bonus_y, bonus_y],
                             mode="lines", line={"color": style.BONUS, "width": 3, "dash": "dot"},
                             hoverinfo="skip", showlegend=False, name="bonus edge"))
    traces.append(_scatter(
        x=layout.x, y=layout.y, mode="markers+text", name="candidate (colour = joint p)",
        text=labels, textposition=["middle left"] + ["middle right"] * (len(texts) - 1),
        textfont={"size": FONT_PX, "color": [style.UNVERIFIED if i in unverified else style.TEXT
                                             for i in range(len(texts))]}, cliponaxis=False,
        hovertext=[_hover(i, texts[i], outcome.node_tokens[i], depths[i], ranks[i], marginals[i], scores[i],
                          i in accepted_set, outcome.node_source(i) if i in copied else "", depth_word=depth_word)
                   + ("<br><i>proposed, not verified this step</i>" if i in unverified else "")
                   for i in range(len(texts))],
        hoverinfo="text",
        marker={
            "size": sizes,
            "opacity": [style.UNVERIFIED_OPACITY if i in unverified else 1.0 for i in range(len(texts))],
            "symbol": ["diamond" if i in copied else "circle" for i in range(len(texts))],
            "color": [_log_prob(p) for p in scores],
            "colorscale": style.PROB_COLORSCALE, "cmin": style.LOG_PROB_FLOOR, "cmax": 0.0,
            "line": {"color": [style.ACCEPTED if i in accepted_set else ("#6d28d9" if i in copied else "white")
                               for i in range(len(texts))],
                     "width": [3.5 if i in accepted_set else (2 if i in copied else 1) for i in range(len(texts))]},
            "colorbar": {"title": {"text": "joint p", "side": "right"}, "thickness": 12, "lenmode": "pixels",
                         "len": min(COLOURBAR_LEN_PX, plot_height - 10), "y": 1.0, "yanchor": "top",
                         "tickvals": [-4, -3, -2, -1, 0], "ticktext": ["≤1e-4", "0.001", "0.01", "0.1", "1"]},
            "showscale": tree.num_nodes > 0,  # a lone root has nothing to compare
        },
        customdata=list(range(len(texts))),
    ))
    if copied:  # a legend entry for the chains' marker, naming the drafters that made them
        names = {"lookup": "prompt lookup", "store": "datastore"}
        sources = sorted({names.get(outcome.node_source(i), outcome.node_source(i)) for i in copied})
        traces.append(_scatter(x=[None], y=[None], mode="markers", name=f"◆ copied by {' / '.join(sources)}",
                                 marker={"symbol": "diamond", "size": 12, "color": style.TEXT}))
    traces.append(_scatter(
        x=[bonus_x], y=[bonus_y], mode="markers+text", name="bonus token (base model)",
        text=[plotly_escape(bonus_label)], textposition="middle right", cliponaxis=False,
        textfont={"size": FONT_PX + 1, "color": style.BONUS},
        marker={"symbol": "star", "size": 22, "color": style.BONUS, "line": {"color": "white", "width": 1}},
        hovertext=[f"<b>bonus {token_hover(bonus_text)}</b> (id {outcome.bonus_token})<br>the base model's own"
                   f" next token after the accepted path;<br>it is the next step's root"],
        hoverinfo="text",
    ))
    # one axis for every tree, with or without chains (which may run deeper than the heads): "depth d"; the
    # hover and the heads table say which head (or draft step) guessed it
    tick_text = ["root"] + [f"depth {d}" for d in range(1, tree.max_depth + 1)] + ["bonus"]
    layout = {**style.base_layout(title_text, height), **dict(
        showlegend=True,
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": -LEGEND_GAP_PX / plot_height,
                "yanchor": "top", "font": {"size": 12}},
        xaxis={"tickvals": list(range(tree.max_depth + 2)), "ticktext": tick_text, "range": list(frame.x_range),
               "showgrid": True, "gridcolor": style.GRID, "zeroline": False, "side": "bottom", "fixedrange": False},
        yaxis={"visible": False, "range": list(frame.y_range)},  # max first: row 0 at the top
        margin={"l": MARGIN_SIDE, "r": MARGIN_SIDE, "t": margin_top, "b": MARGIN_BOTTOM},
    )}
    return style.figure_of(traces, layout)


def _scatter(**properties: object) -> dict:
    return {"type": "scatter", **properties}


def _figure_frame(fig: go.Figure) -> Frame:
    margin = fig.layout.margin
    return Frame(x_range=tuple(fig.layout.xaxis.range), y_range=tuple(fig.layout.yaxis.range),
                 width=PLOT_AREA_WIDTH_PX, height=fig.layout.height - margin.t - margin.b)


def label_boxes(fig: go.Figure) -> list[Box]:
    """The label boxes `tree_figure` planned (for tests: none of them overlap)."""
    nodes = next(t for t in fig.data if t.name == "candidate (colour = joint p)")
    frame = _figure_frame(fig)
    boxes = []
    for i, (x, y, label, size) in enumerate(zip(nodes.x, nodes.y, nodes.text, nodes.marker.size)):
        if label:
            boxes.append(_label_box(frame, x, y, html.unescape(label), size, left=i == 0))
    return boxes


def bonus_edge_px(fig: go.Figure) -> list[tuple[float, float]]:
    """The bonus edge's corners in the pixels `label_boxes` uses (for tests: it crosses no label)."""
    edge = next(t for t in fig.data if t.name == "bonus edge")
    frame = _figure_frame(fig)
    return [frame.px(x, y) for x, y in zip(edge.x, edge.y)]


def empty_figure(message: str, height: int = 300) -> go.Figure:
    """A blank figure with a centred message (before the first step, or when not applicable)."""
    message = "<br>".join(textwrap.wrap(message, width=60))
    layout = {**style.base_layout("", height), "xaxis": {"visible": False}, "yaxis": {"visible": False},
              "annotations": [{"text": message, "x": 0.5, "y": 0.5, "xref": "paper", "yref": "paper",
                               "showarrow": False, "font": {"size": 15, "color": "#64748b"}}]}
    return style.figure_of([], layout)
