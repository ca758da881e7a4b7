"""viz/ from hand-made StepRecords: no model, no gradio, fast."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from core.records import PhaseTimes, StepKind, StepRecord, TreeOutcome
from core.tree import CandidateTree, dynamic_tree, fixed_tree, named_tree
from viz import style
from viz.labels import escape, token_label, visible
from viz.mask_plot import mask_figure, mask_values
from core.strategy import parse_strategy
from viz.facts import RunFacts
from viz.text_html import RunStats, emitted_tokens, heads_html, stats_html, text_html
from viz.timing_plot import ArBaseline, accepted_figure, cumulative_figure, phase_figure
from labstate.trace import to_jsonable, trace_dict, trace_json
from viz.tree_plot import empty_figure, label_boxes, tree_figure, tree_layout
from viz.view import build_view

pytestmark = pytest.mark.timeout(60)

# tokens that have broken token viewers before: spaces, newlines, tabs, markup, emoji, empty
NASTY = [" Hello", "\n", "<b>html</b>", "🙂", "<script>alert(1)</script>", "a b", "\tx", "&amp;", ""]
HEAD_PROBS = [[0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.9, 0.05, 0.01]]


def _fixed_outcome() -> TreeOutcome:
    tree = fixed_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [2]])
    # nodes 1..8: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0) (0,0,1); accepted: root, (0,), (0,0), (0,0,0)
    assert tree.paths[3] == (0, 0) and tree.paths[6] == (0, 0, 0)
    scores = [1.0] + tree.path_scores(torch.tensor(HEAD_PROBS))
    return TreeOutcome(tree=tree, node_tokens=list(range(100, 109)), node_scores=scores,
                       accepted_nodes=[0, 1, 4, 7], bonus_token=999, node_texts=list(NASTY),
                       bonus_text="<i>bonus</i>")


def _dynamic_outcome(budget: int = 40, accepted: list[int] | None = None) -> TreeOutcome:
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 32, generator=generator) * 2, dim=-1).sort(dim=-1, descending=True).values
    tree = dynamic_tree(probs, budget)
    n = tree.num_nodes
    texts = [NASTY[i % len(NASTY)] + str(i) for i in range(n + 1)]
    return TreeOutcome(tree=tree, node_tokens=list(range(n + 1)), node_scores=[1.0] + list(tree.scores),
                       accepted_nodes=accepted or [0, 1], bonus_token=7, node_texts=texts, bonus_text=" next")


def _autoregressive_outcome() -> TreeOutcome:
    return TreeOutcome(tree=CandidateTree(paths=[], kind="autoregressive"), node_tokens=[5], node_scores=[1.0],
                       accepted_nodes=[0], bonus_token=6, node_texts=["\n"], bonus_text=" <b>")


def _plain_record(index: int) -> StepRecord:
    return _record(index, _autoregressive_outcome(), family="autoregressive", kind=StepKind.PLAIN)


def _record(index: int, outcome: TreeOutcome, comparison: TreeOutcome | None = None,
            family: str = "dynamic", kind: StepKind = StepKind.TREE) -> StepRecord:
    new = [outcome.node_tokens[i] for i in outcome.accepted_nodes[1:]] + [outcome.bonus_token]
    return StepRecord(index=index, family=family, kind=kind, context_length=20 + index, head_token_ids=[[1, 2, 3]] * 3,
                      head_probs=HEAD_PROBS, outcome=outcome, new_tokens=new,
                      times=PhaseTimes(heads=0.01, tree=0.001, verify=0.1, accept=0.002, commit=0.001,
                                       compare=0.09 if comparison else 0.0),
                      comparison=comparison, head_texts=[["a", "<b>", " c"]] * 3)


def _trace(fig, name: str):
    matches = [t for t in fig.data if t.name == name]
    assert len(matches) == 1, [t.name for t in fig.data]
    return matches[0]


def _segments(trace) -> int:
    return sum(1 for v in trace.x if v is None)


# -- labels ---------------------------------------------------------------------------------------
def test_visible_whitespace_and_escaping():
    assert visible(" a\tb\n") == "␣a⇥b↵"
    assert visible("") == "∅"
    assert token_label("<b>html</b>") == "&lt;b&gt;html&lt;/b&gt;"
    assert token_label("a" * 30).endswith("…") and len(token_label("a" * 30)) == 12
    assert escape('"<x>&') == "&quot;&lt;x&gt;&amp;"


# -- tree -----------------------------------------------------------------------------------------
def test_tree_layout_is_tidy():
    tree = fixed_tree([[0], [1], [0, 0], [0, 1]])
    layout = tree_layout(tree.parents, tree.depths, [0] + [p[-1] for p in tree.paths])
    # leaves (0,0), (0,1), (1,) take rows 0, 1, 2 in rank order; parents sit between their children
    assert layout.rows == 3
    assert layout.y[3] == 0 and layout.y[4] == 1 and layout.y[2] == 2
    assert layout.y[1] == 0.5 and layout.y[0] == 1.25
    assert layout.x == [0, 1, 1, 2, 2]


def test_fixed_tree_figure_nodes_edges_path_and_labels():
    outcome = _fixed_outcome()
    fig = tree_figure(outcome, "Fixed <tree>")
    nodes = _trace(fig, "candidate (colour = joint p)")
    assert len(nodes.x) == 9  # root + 8 candidates
    # edges: 8 in all, 3 on the accepted path (0->1->4->7), 5 elsewhere
    assert _segments(_trace(fig, "accepted path")) == 3
    assert _segments(_trace(fig, "candidate edge")) == 5
    path = _trace(fig, "accepted path")
    assert [v for v in path.x if v is not None] == [0, 1, 1, 2, 2, 3]
    outlines = list(nodes.marker.line.color)
    assert [i for i, c in enumerate(outlines) if c == style.ACCEPTED] == [0, 1, 4, 7]
    # labels: whitespace visible, markup escaped, emoji kept, empty token marked
    assert list(nodes.text[:4]) == ["␣Hello", "↵", "&lt;b&gt;html&lt;/b&gt;", "🙂"]
    assert nodes.text[6] == "⇥x" and nodes.text[7] == "&amp;amp;"
    assert nodes.text[8] == "∅"
    assert "<script>" not in json.dumps(fig.to_plotly_json()["data"])
    hover = nodes.hovertext[2]
    assert "&lt;b&gt;html&lt;/b&gt;" in hover and "head 1" in hover and "rank 1" in hover
    # hover numbers: node 5 is path (0, 1): marginal 0.2, joint 0.5 * 0.2
    assert "head 2 · rank 1" in nodes.hovertext[5]
    assert "marginal p = 0.2000" in nodes.hovertext[5] and "joint p = 1.00e-01" in nodes.hovertext[5]
    assert "✓ accepted" in nodes.hovertext[4] and "✗ not accepted" in nodes.hovertext[5]
    bonus = _trace(fig, "bonus token (base model)")
    assert list(bonus.text) == ["&lt;i&gt;bonus&lt;/i&gt;"]
    assert bonus.x[0] == 4  # one column after the last accepted node (depth 3)
    assert "&lt;tree&gt;" not in fig.layout.title.text  # the title is ours: not escaped, not token text
    assert list(fig.layout.xaxis.ticktext) == ["root", "depth 1", "depth 2", "depth 3", "bonus"]  # every tree's


def test_joint_probability_drives_colour_and_size():
    outcome = _fixed_outcome()
    nodes = _trace(tree_figure(outcome, "t"), "candidate (colour = joint p)")
    colours, sizes = list(nodes.marker.color), list(nodes.marker.size)
    assert colours[0] == 0.0 and sizes[0] == max(sizes)  # the root: p = 1
    best, worst = max(range(1, 9), key=lambda i: outcome.node_scores[i]), min(range(1, 9),
                                                                            key=lambda i: outcome.node_scores[i])
    assert colours[best] > colours[worst] and sizes[best] > sizes[worst]
    assert all(style.LOG_PROB_FLOOR <= c <= 0 for c in colours)


def test_dynamic_tree_of_256_nodes():
    outcome = _dynamic_outcome(budget=256, accepted=None)
    deep = max(range(1, 257), key=lambda i: (outcome.tree.depths[i], -i))
    accepted = outcome.tree.ancestors(deep)
    outcome = dataclasses.replace(outcome, accepted_nodes=accepted)
    fig = tree_figure(outcome, "Dynamic")
    nodes = _trace(fig, "candidate (colour = joint p)")
    assert len(nodes.x) == 257 and len(nodes.hovertext) == 257
    assert _segments(_trace(fig, "accepted path")) == len(accepted) - 1
    assert _segments(_trace(fig, "candidate edge")) == 256 - (len(accepted) - 1)
    labelled = [i for i, t in enumerate(nodes.text) if t]
    assert set(accepted) <= set(labelled)
    assert len(labelled) < 257  # labels are thinned where they would overlap
    assert fig.layout.height <= 1200


def test_autoregressive_tree_is_root_and_bonus():
    fig = tree_figure(_autoregressive_outcome(), "AR")
    nodes = _trace(fig, "candidate (colour = joint p)")
    assert list(nodes.x) == [0] and list(nodes.text) == ["↵"]
    assert _segments(_trace(fig, "candidate edge")) == 0
    bonus = _trace(fig, "bonus token (base model)")
    assert list(bonus.text) == ["␣&lt;b&gt;"] and bonus.x[0] == 1
    assert list(fig.layout.xaxis.ticktext) == ["root", "bonus"]
    assert nodes.marker.showscale is False


def test_empty_figure_has_message():
    fig = empty_figure("nothing yet")
    assert fig.layout.annotations[0].text == "nothing yet"
    assert "<br>" in empty_figure("a long message " * 8).layout.annotations[0].text


# -- mask -----------------------------------------------------------------------------------------
def test_mask_figure_matches_tree_buffers():
    outcome = _fixed_outcome()
    fig = mask_figure(outcome, context_length=42)
    z = [list(row) for row in fig.data[0].z]
    expected = outcome.tree.buffers().attn_mask.tolist()
    assert len(z) == 9 and all(len(row) == 9 for row in z)
    assert all(bool(z[q][k]) == expected[q][k] for q in range(9) for k in range(9))
    assert all(z[i][i] > 0 for i in range(9))  # every node sees itself
    assert z[7][4] == 2 and z[7][1] == 2 and z[7][0] == 2  # accepted path: ancestors on the path
    assert z[4][7] == 0  # never a descendant
    assert "42 context tokens" in fig.layout.title.text
    assert all("<b>" not in label for label in fig.layout.xaxis.ticktext)


def test_a_plain_step_mask_says_what_one_token_attends():
    """Issue 48: a plain step's mask was a lone green square; it says what the one query attends instead."""
    plain = TreeOutcome(tree=fixed_tree([]), node_tokens=[100], node_scores=[1.0], accepted_nodes=[0],
                        bonus_token=5, node_texts=["a"], bonus_text="b")
    fig = mask_figure(plain, context_length=12)
    assert not fig.data and "attends to the 12 context tokens and itself" in fig.layout.annotations[0].text.replace("<br>", " ")


def test_mask_values_marks_accepted_path():
    assert mask_values([[True, False], [True, True]], [0, 1]) == [[2, 0], [2, 2]]
    assert mask_values([[True, False], [True, True]], [0]) == [[2, 0], [1, 1]]


def test_mask_figure_256_nodes_thins_ticks():
    fig = mask_figure(_dynamic_outcome(budget=256))
    assert len(fig.data[0].z) == 257
    assert len(fig.layout.xaxis.tickvals) <= 40


# -- timing ---------------------------------------------------------------------------------------
def test_phase_and_accepted_figures():
    records = [_record(i, _fixed_outcome(), comparison=_fixed_outcome()) for i in range(3)]
    fig = phase_figure(records, 1)
    names = {t.name for t in fig.data}
    assert {"heads propose", "build tree", "verify (one forward)", "accept", "commit KV cache"} <= names
    assert "fixed-tree comparison (display only)" in names
    verify_all = [t for t in fig.data if t.name == "verify (one forward)" and len(t.x) == 3][0]
    assert list(verify_all.y) == pytest.approx([100.0] * 3)
    acc = accepted_figure(records, 1)
    assert list(acc.data[0].y) == [4, 4, 4]
    assert list(_trace(acc, "fixed tree, same context").y) == [4, 4, 4]


def test_cumulative_figure_measured_and_estimated_baselines():
    records = [_record(i, _fixed_outcome(), comparison=_fixed_outcome()) for i in range(3)]
    estimated = cumulative_figure(records, ArBaseline(seconds_per_token=0.05))
    names = [t.name for t in estimated.data]
    assert names[0] == "dynamic (measured)"
    assert names[1] == "fixed tree (counterfactual, same contexts)"
    assert names[2].startswith("autoregressive (estimated")
    assert list(estimated.data[0].y) == [0, 4, 8, 12]
    assert estimated.data[2].x[-1] == pytest.approx(12 * 0.05)
    measured = cumulative_figure(records, ArBaseline(step_seconds=[0.04] * 20))
    ar = measured.data[2]
    assert ar.name == "autoregressive (measured plain run)" and list(ar.y)[-1] == 12
    only_self = cumulative_figure([_plain_record(0)], None)
    assert [t.name for t in only_self.data] == ["autoregressive (measured)"]


# -- text -----------------------------------------------------------------------------------------
def test_emitted_tokens_roles_steps_and_limit():
    records = [_record(0, _fixed_outcome()), _record(1, _autoregressive_outcome())]
    tokens = emitted_tokens(records, first_id=100, first_text=" Hello", limit=100)
    assert [(t.step, t.role) for t in tokens] == [(-1, "root"), (0, "accepted"), (0, "accepted"), (0, "accepted"),
                                                  (0, "bonus"), (1, "bonus")]
    assert [t.text for t in tokens[1:5]] == ["\n", "<script>alert(1)</script>", "&amp;", "<i>bonus</i>"]
    assert len(emitted_tokens(records, 100, " Hello", limit=3)) == 3


def test_text_html_escapes_and_marks_roles():
    records = [_record(0, _fixed_outcome()), _record(1, _autoregressive_outcome())]
    page = text_html(emitted_tokens(records, 100, " Hello", 100), selected_step=0)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<i>bonus" not in page and "&lt;i&gt;bonus&lt;/i&gt;" in page
    assert ">&amp;amp;</span>" in page  # "&amp;" as a token is shown literally
    assert '<span class="ws">↵</span><br>' in page  # a newline token: visible and breaking
    assert page.count("r-accepted") == 3 + 4  # three tokens + the legend's four depth marks
    assert page.count("r-bonus") == 2 + 1
    assert page.count(" sel") == 4  # the selected step's tokens
    assert 'class="tok s1 r-bonus"' in page
    assert "Press Start" in text_html([])


def test_heads_html_marks_accepted_guesses_and_escapes():
    page = heads_html(_record(0, _fixed_outcome()))
    assert page.count('class="acc"') == 3  # one per accepted depth (rank 0 each)
    assert "&lt;b&gt;" in page and "<b>" not in page
    assert "after the first step" in heads_html(None)
    plain = dataclasses.replace(_plain_record(0), head_probs=[],
                                head_token_ids=[], head_texts=[])
    assert "autoregressive" in heads_html(plain)


def test_a_plain_step_of_a_drafting_run_says_why_it_had_no_heads():
    """The last step of a run with one token left is plain: the table says so, not "autoregressive decoding"."""
    tree_step = _record(0, _fixed_outcome())
    plain = dataclasses.replace(_plain_record(1), head_probs=[],
                                head_token_ids=[], head_texts=[])
    emitted = 1 + len(tree_step.new_tokens)

    def heads_of(limit: int, strategy: str = "dynamic") -> str:
        facts = RunFacts(prompt="p", spec=parse_strategy(strategy), settings={"max_new_tokens": limit, "depth": 3},
                         records=[tree_step, plain], output_ids=[1] * (emitted + 1), first_text="a", text="ab",
                         token_bytes={}, stats=RunStats())
        return build_view(facts, 1).heads

    assert "one token was left" in heads_of(emitted + 1)
    assert "drafters offered nothing" in heads_of(emitted + 20)
    assert "autoregressive decoding" not in heads_of(emitted + 1)
    assert "one token was left" in heads_html(plain, plain_why="one token was left")


def test_an_eagle_tree_names_its_columns_by_depth_not_head():
    outcome = dataclasses.replace(_fixed_outcome(), tree=dataclasses.replace(_fixed_outcome().tree, kind="eagle"))
    fig = tree_figure(outcome, "EAGLE")
    assert list(fig.layout.xaxis.ticktext) == ["root", "depth 1", "depth 2", "depth 3", "bonus"]
    assert "depth 2 · rank 1" in _trace(fig, "candidate (colour = joint p)").hovertext[5]
    assert "3 draft guesses accepted" in fig.layout.title.text
    table = heads_html(_record(0, outcome, family="eagle"))
    assert "<th>depth 1<br>" in table and "<th>head 1<br>" not in table


def test_stats_html():
    page = stats_html(RunStats(tokens=12, steps=5, mean_accepted=2.4, tokens_per_s=9.5, status="running",
                               check="<identical>", check_state="ok"))
    assert "12" in page and "2.40" in page and "9.5" in page
    assert "&lt;identical&gt;" in page and 'check ok' in page
    assert "nodes / step" not in page  # plain decoding: no tree card
    trees = stats_html(RunStats(tokens=12, steps=4), tree_sizes=[0, 16, 0, 8])
    assert 'card trees' in trees and ">6.0<" in trees and "2 plain · largest 16" in trees


# -- trace ----------------------------------------------------------------------------------------
def test_trace_round_trips_through_json():
    records = [_record(0, _fixed_outcome(), comparison=_fixed_outcome()), _record(1, _autoregressive_outcome())]
    records[0].outcome.tree.buffers()  # populate the cached buffers: they must not leak into the trace
    facts = RunFacts(prompt="<b>hi</b>", spec=parse_strategy("fixed"), settings={"budget": 8}, records=records,
                     output_ids=[1, 2], first_text="a", text="ab", token_bytes={}, stats=RunStats())
    text = trace_json(facts, {"prompt": "<b>hi</b>", "nan": math.nan, "config": {"t": (1, 2)}})
    data = json.loads(text)
    assert data["meta"] == {"prompt": "<b>hi</b>", "nan": None, "config": {"t": [1, 2]}}
    assert len(data["steps"]) == 2
    step = data["steps"][0]
    assert step["outcome"]["tree"] == {"paths": [list(p) for p in records[0].outcome.tree.paths], "scores": None,
                                       "kind": "fixed"}
    assert step["outcome"]["accepted_nodes"] == [0, 1, 4, 7]
    assert step["outcome"]["accepted_length"] == 4 and step["comparison"]["accepted_length"] == 4
    assert step["times"]["total"] == pytest.approx(0.114)
    assert step["outcome"]["node_texts"] == NASTY
    assert data["steps"][1]["comparison"] is None
    assert trace_dict(facts, {})["version"] == 3 and data["facts"]["strategy"] == "fixed"


def test_to_jsonable_tensors_and_named_tree():
    assert to_jsonable(torch.tensor([[1, 2]])) == [[1, 2]]
    tree = to_jsonable(named_tree("mc_sim_7b_63"))
    assert len(tree["paths"]) == 63 and set(tree) == {"paths", "scores", "kind"}


def _lookup_outcome() -> TreeOutcome:
    """Heads' tree [[0], [1], [0, 0]] plus a lookup chain (rank 3) under (0,): nodes (0, 3), (0, 3, 3)."""
    tree = CandidateTree(paths=[(0,), (1,), (0, 0), (0, 3), (0, 3, 3)], scores=[0.6, 0.3, 0.3, 0.5, 0.4],
                         kind="dynamic")
    return TreeOutcome(tree=tree, node_tokens=list(range(200, 206)), node_scores=[1.0, 0.6, 0.3, 0.3, 0.5, 0.4],
                       accepted_nodes=[0, 1, 4, 5], bonus_token=999, node_texts=["r", "a", "b", "c", "d", "e"],
                       bonus_text="!", lookup_rank=3)


def test_lookup_nodes_are_diamonds_and_copied_tokens_are_marked():
    outcome = _lookup_outcome()
    fig = tree_figure(outcome, "hybrid")
    nodes = _trace(fig, "candidate (colour = joint p)")
    assert [i for i, s in enumerate(nodes.marker.symbol) if s == "diamond"] == [4, 5]
    assert "prompt lookup" in nodes.hovertext[4] and "rank" not in nodes.hovertext[4]
    assert "head 1 · rank 1" in nodes.hovertext[2]
    assert "3 guesses accepted (2 ◆ copied) + bonus = 4 tokens" in fig.layout.title.text
    assert list(fig.layout.xaxis.ticktext) == ["root", "depth 1", "depth 2", "depth 3", "bonus"]  # as without
    assert _trace(fig, "◆ copied by prompt lookup").marker.symbol == "diamond"
    assert not [t for t in tree_figure(_fixed_outcome(), "f").data if t.name == "◆ copied by prompt lookup"]
    tokens = emitted_tokens([_record(0, outcome)], first_id=200, first_text="r", limit=100)
    assert [t.role for t in tokens] == ["root", "accepted", "copied", "copied", "bonus"]
    page = text_html(tokens)
    assert page.count("r-copied") == 2 + 1  # two tokens + the legend entry, shown only when copies exist
    assert "r-copied" not in text_html(emitted_tokens([_record(0, _fixed_outcome())], 100, "x", 100))


# -- issue 14: readable at every size, the defects a new user hit ---------------------------------------
from viz.bench_plot import bench_figure, markdown_table, result_order  # noqa: E402
from viz.labels import sequence_texts, split_utf8, standalone_text  # noqa: E402
from viz.tree_plot import FIT_FIGURE_PX, PLOT_WIDTH_PX, TITLE_CHARS, Box, bonus_edge_px, node_texts  # noqa: E402
from viz.verify_view import verification, verification_html  # noqa: E402

EMOJI = "🙂".encode()  # F0 9F 99 82
HAMZA = "ء".encode()  # D8 A1


def _overlaps(fig) -> list[tuple[int, int]]:
    boxes = label_boxes(fig)
    return [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]


def _wide_outcome(budget: int, top_m: int, depth: int, texts: str = "wide") -> TreeOutcome:
    generator = torch.Generator().manual_seed(budget + top_m + depth)
    probs = torch.softmax(torch.randn(depth, top_m, generator=generator), dim=-1).sort(dim=-1, descending=True).values
    tree = dynamic_tree(probs, budget)
    n = tree.num_nodes
    labels = {"wide": [" internationalisation"] * (n + 1), "cjk": ["漢字漢字漢字"] * (n + 1),
              "quote": ['"'] * (n + 1)}[texts]
    deepest = max(range(n + 1), key=lambda i: tree.depths[i])
    return TreeOutcome(tree=tree, node_tokens=list(range(n + 1)), node_scores=[1.0] + list(tree.scores),
                       accepted_nodes=tree.ancestors(deepest) if n else [0], bonus_token=7,
                       node_texts=labels, bonus_text=" a very long bonus token text")


@pytest.mark.parametrize("budget, top_m, depth", [(1, 1, 1), (15, 8, 4), (63, 32, 4), (256, 64, 4), (256, 1, 4),
                                                  (256, 64, 1), (40, 4, 2)])
@pytest.mark.parametrize("texts", ["wide", "cjk"])
def test_tree_labels_never_overlap_at_any_size(budget, top_m, depth, texts):
    outcome = _wide_outcome(budget, top_m, depth, texts)
    fig = tree_figure(outcome, "Step 1: Dynamic tree, auto budget: 12 of ≤ 63 nodes (top-32, depth 4) + lookup ◆ "
                               "and a title long enough to need a second line")
    assert _overlaps(fig) == []
    nodes = _trace(fig, "candidate (colour = joint p)")
    assert all(nodes.text[i] for i in outcome.accepted_nodes)  # the accepted path is always labelled
    root = label_boxes(fig)[0]
    assert root.left >= -fig.layout.margin.l  # the root label is never clipped on the left
    assert all(len(line.replace("<sup>", "").replace("</sup>", "")) <= TITLE_CHARS
               for line in fig.layout.title.text.split("<br>"))  # wrapped, never cut
    bar = nodes.marker.colorbar
    assert bar.lenmode == "pixels" and bar.len <= 170  # the colour bar keeps its size


def _crosses(corners: list[tuple[float, float]], box: Box) -> bool:
    """Whether an axis-aligned polyline passes through a box."""
    for (x0, y0), (x1, y1) in zip(corners, corners[1:]):
        left, right, top, bottom = min(x0, x1), max(x0, x1), min(y0, y1), max(y0, y1)
        if left < box.right - 1 and box.left + 1 < right + 1e-9 and top < box.bottom - 1 and box.top + 1 < bottom + 1e-9:
            return True
    return False


@pytest.mark.parametrize("budget, top_m, depth", [(15, 8, 4), (63, 32, 4), (63, 4, 4), (256, 64, 4), (40, 4, 2)])
@pytest.mark.parametrize("deepest", [True, False])
def test_the_bonus_edge_crosses_no_label(budget, top_m, depth, deepest):
    """Issue 48: the dotted bonus edge runs up its node's column and along a lane above the tree, never
    through another node's label, whichever node the path ends on."""
    outcome = _wide_outcome(budget, top_m, depth)
    if not deepest:  # the path ends on an inner node in the middle of the tree
        middle = outcome.tree.num_nodes // 2
        outcome = dataclasses.replace(outcome, accepted_nodes=outcome.tree.ancestors(middle))
    fig = tree_figure(outcome, "Step 1")
    corners = bonus_edge_px(fig)
    assert len(corners) == 3 and corners[0][0] == corners[1][0] and corners[1][1] == corners[2][1]
    assert [box for box in label_boxes(fig) if _crosses(corners, box)] == []


@pytest.mark.parametrize("budget, top_m", [(63, 32), (63, 8), (30, 30)])
def test_a_default_sized_tree_fits_a_laptop_screen(budget, top_m):
    """Issue 48: the auto budget's trees (up to 63 nodes) fit in a 1280x800 window: rows close up."""
    note = "the heads had not paid lately: the auto budget verified the lookup chain alone (the heads' nodes faded)"
    fig = tree_figure(_wide_outcome(budget, top_m, 4), "Step 3: Dynamic tree, auto budget: 63 of ≤ 63 nodes", note)
    assert fig.layout.title.text.count("<br>") >= 2 and fig.layout.height <= FIT_FIGURE_PX
    assert _overlaps(fig) == []


def test_lookup_chain_of_ten_is_labelled_legibly():
    heads = [(0,), (1,), (0, 0)]
    chain = [(0,) + (3,) * d for d in range(1, 10)]  # a ten-token chain: (0,) then nine copied nodes
    tree = CandidateTree(paths=heads + chain, scores=[0.6, 0.3, 0.3] + [0.5 - 0.02 * d for d in range(9)],
                         kind="dynamic")
    n = tree.num_nodes
    outcome = TreeOutcome(tree=tree, node_tokens=list(range(n + 1)), node_scores=[1.0] + list(tree.scores),
                          accepted_nodes=[0, 1] + list(range(4, 4 + 9)), bonus_token=999,
                          node_texts=[f" word{i}" for i in range(n + 1)], bonus_text="!", lookup_rank=3)
    fig = tree_figure(outcome, "lookup")
    nodes = _trace(fig, "candidate (colour = joint p)")
    assert _overlaps(fig) == []
    assert all(nodes.text[i] for i in range(4, 13))  # every diamond on the accepted chain has its label
    assert min(nodes.marker.size[i] for i in range(4, 13)) >= 13
    assert list(fig.layout.xaxis.ticktext)[-1] == "bonus" and _trace(fig, "bonus token (base model)").x[0] == 11


def test_quotes_are_not_escaped_twice_in_plot_labels():
    fig = tree_figure(_wide_outcome(15, 8, 4, "quote"), 'A "quoted" title')
    payload = json.dumps(fig.to_plotly_json()["data"])
    assert "&quot;" not in payload and "&#x27;" not in payload  # plotly shows entities other than & < > literally
    assert token_label('"<a>"') == '"&lt;a&gt;"'


def test_bonus_star_has_its_own_column_after_the_deepest_node():
    outcome = dataclasses.replace(_fixed_outcome(), accepted_nodes=[0, 1])  # the path stops at depth 1
    fig = tree_figure(outcome, "t")
    assert _trace(fig, "bonus token (base model)").x[0] == 4  # depth 3 tree: bonus column 4, not head 2's column
    assert list(fig.layout.xaxis.ticktext) == ["root", "depth 1", "depth 2", "depth 3", "bonus"]


def test_split_characters_show_whole_or_as_byte_pieces():
    assert split_utf8(EMOJI[:2]) == ("", EMOJI[:2])
    assert standalone_text(EMOJI[:2]) == "‹0xF0›‹0x9F›"
    assert standalone_text(EMOJI[2:], pending=EMOJI[:2]) == "🙂"
    assert standalone_text(b"\xff") == "‹0xFF›"
    assert sequence_texts([b"a", HAMZA[:1], HAMZA[1:], EMOJI[:3]]) == [("a", False), ("", True), ("ء", False),
                                                                      ("‹0xF0›‹0x9F›‹0x99›", False)]


def _byte_record() -> tuple[StepRecord, dict[int, bytes]]:
    """A step whose tokens split "ء" and "🙂" over two tokens each: ids 1-4 are the pieces."""
    table = {0: b" hi", 1: HAMZA[:1], 2: HAMZA[1:], 3: EMOJI[:2], 4: EMOJI[2:], 5: b"!"}
    tree = fixed_tree([[0], [1], [0, 0], [0, 1]])  # nodes: 1 (0,), 2 (1,), 3 (0,0), 4 (0,1)
    outcome = TreeOutcome(tree=tree, node_tokens=[0, 1, 3, 2, 5], node_scores=[1.0, 0.5, 0.3, 0.4, 0.1],
                          accepted_nodes=[0, 1, 3], bonus_token=3, node_texts=[" hi", "�", "�", "�", "!"],
                          bonus_text="�")
    record = StepRecord(index=0, family="dynamic", kind=StepKind.TREE, context_length=5, head_token_ids=[[1, 3], [2, 4]],
                        head_probs=[[0.6, 0.3], [0.5, 0.2]], outcome=outcome, new_tokens=[1, 2, 3],
                        times=PhaseTimes(verify=0.01), head_texts=[["�", "�"], ["�", "�"]])
    return record, table


def test_no_replacement_characters_where_tokens_complete_a_character():
    record, table = _byte_record()
    texts, bonus = node_texts(record.outcome, table)
    assert texts == [" hi", "‹0xD8›", "‹0xF0›‹0x9F›", "ء", "!"] and bonus == "‹0xF0›‹0x9F›"
    page = text_html(emitted_tokens([record], 0, " hi", 4, table))
    assert "\ufffd" not in page and "ء" in page and "‹0xF0›‹0x9F›" in page
    assert ">ء</span>" in page and " + step 1 · head 2 rank 0" in page  # the two pieces share one span
    heads = heads_html(record, table)
    assert "\ufffd" not in heads and "‹0xD8›" in heads
    fig = tree_figure(record.outcome, "t", token_bytes=table)
    assert "\ufffd" not in json.dumps(fig.to_plotly_json()["data"], ensure_ascii=False)
    mask = mask_figure(record.outcome, 5, table)
    assert "\ufffd" not in json.dumps(mask.to_plotly_json(), ensure_ascii=False) and "3·ء" in mask.data[0].x


def test_generated_tokens_name_their_source_and_depth():
    records = [_record(0, _fixed_outcome()), _record(1, _lookup_outcome())]
    tokens = emitted_tokens(records, 100, " Hello", 100)
    assert tokens[1].source.startswith("head 1 rank 0 (joint p 0.5") and tokens[1].depth == 1
    assert tokens[3].source.startswith("head 3 rank 0") and tokens[3].depth == 3
    assert [t.source for t in tokens if t.role == "copied"] == ["prompt lookup, depth 2", "prompt lookup, depth 3"]
    page = text_html(tokens)
    assert 'r-accepted d1' in page and 'r-accepted d3' in page and "r-copied d2" in page
    assert 'title="step 1 · head 2 rank 0' in page and "step 2 · prompt lookup, depth 3" in page
    assert 'title="prefill' in page and "step 0" not in page  # steps count from 1 on the page


def test_verification_view_shows_the_base_models_token_beside_the_candidates():
    record = _record(0, _fixed_outcome())  # accepted 0 -> 1 -> 4 -> 7; node 7 has no children
    checks = verification(record)
    assert [c.depth for c in checks] == [1, 2, 3]
    first = checks[0]
    assert first.choice == NASTY[1] and first.accepted  # the base model's token after the root = node 1's
    assert [c.matches for c in first.candidates] == [True, False, False]
    assert sum(c.matches for c in checks[2].candidates) == 1
    stopped = dataclasses.replace(record, outcome=dataclasses.replace(record.outcome, accepted_nodes=[0, 1]))
    last = verification(stopped)[-1]
    assert last.depth == 2 and not last.accepted and last.choice == "<i>bonus</i>"
    assert not any(c.matches for c in last.candidates)
    page = verification_html(stopped, greedy=True)
    assert "✗ no candidate matches" in page and "&lt;i&gt;bonus&lt;/i&gt;" in page and "argmax" in page
    assert "sampled" in verification_html(stopped, greedy=False)
    argmax = dataclasses.replace(stopped.outcome, base_top_tokens=[101, 555, -1, -1, -1, -1, -1, -1, -1])
    sampled = verification(dataclasses.replace(stopped, outcome=argmax))  # recorded argmax: shown as is
    sampled_page = verification_html(dataclasses.replace(stopped, outcome=argmax), greedy=False)
    assert sampled[1].choice == "#555" and "argmax (for reference: sampling accepts by probability)" in sampled_page
    assert "sampling rule accepted" in sampled_page and "no candidate matches" not in sampled_page  # issue 48
    assert "root alone" in verification_html(_record(0, _autoregressive_outcome()), greedy=True)


def test_timing_plots_show_every_step_from_one_and_legends_stay_below():
    records = [_record(i, _fixed_outcome(), comparison=_fixed_outcome()) for i in range(46)]
    phases = phase_figure(records, 45)
    steps = [t for t in phases.data if t.name == "verify (one forward)" and len(t.x) == 46][0]
    assert list(steps.x) == list(range(1, 47))
    assert phases.layout.xaxis2.range[0] <= 1 and phases.layout.xaxis2.range[1] >= 46
    accepted = accepted_figure(records, 0)
    assert list(accepted.data[0].x) == list(range(1, 47)) and accepted.layout.xaxis.range[1] >= 46
    cumulative = cumulative_figure(records, ArBaseline(seconds_per_token=0.5))
    end = max(x for t in cumulative.data for x in t.x if x is not None)
    assert cumulative.layout.xaxis.range[1] >= end
    for fig in (phases, accepted, cumulative):
        assert fig.layout.legend.y < 0  # below the plot, never over the title


def test_benchmark_figure_skips_missing_tokens_per_step_and_orders_mt_bench_first():
    result = {"summary": {"ar": {"tokens_per_s": 10.0, "mean_accepted": 1.0, "speedup_vs_ar": 1.0},
                          "dynamic:auto+lookup": {"tokens_per_s": 17.0, "mean_accepted": 2.1, "speedup_vs_ar": 1.7},
                          "hf:prompt_lookup": {"tokens_per_s": 14.0, "mean_accepted": None, "speedup_vs_ar": 1.4}},
              "config": {"dtype": "bf16", "prompt_count": 80}}
    fig = bench_figure(result, "t")
    per_step = _trace(fig, "tokens/step")
    assert "hf:prompt_lookup" not in list(per_step.x) and "0.00" not in list(per_step.text)
    assert all(t.cliponaxis is False for t in fig.data)
    assert fig.layout.yaxis.range[1] >= 17.0 * 1.2
    assert "| strategy | tokens / step |" in markdown_table(result)
    names = ["bench_adversarial_bf16", "bench_gpu_h200_mtbench_fp32", "bench_mtbench_fp32", "bench_mtbench_bf16"]
    assert sorted(names, key=result_order) == ["bench_mtbench_bf16", "bench_mtbench_fp32", "bench_adversarial_bf16",
                                               "bench_gpu_h200_mtbench_fp32"]  # CPU first, MT-Bench first


def test_speed_card_says_how_the_run_compares_with_plain_decoding():
    page = stats_html(RunStats(tokens=40, steps=12, mean_accepted=3.2, tokens_per_s=27.0, vs_plain=1.93,
                               vs_plain_basis="estimated from the verify-cost profile (1 token)",
                               vs_plain_why="wins: a verify of 20 tokens costs 30 ms"))
    # an estimate is said to be one and carries no verdict
    assert "≈ 1.9× plain decoding (estimated" in page
    assert "wins" not in page.replace("wins: a verify", "") and "loses" not in page and "This setting" not in page
    page = stats_html(RunStats(tokens_per_s=5.0, vs_plain=0.42, vs_plain_basis="measured plain run",
                               vs_plain_why="loses: a verify of 64 tokens costs 90 ms against 30 ms"))
    assert "0.42× plain decoding (measured)" in page and "speed-note loses" in page
    page = stats_html(RunStats(tokens_per_s=12.0, vs_plain=1.31, vs_plain_basis="measured plain run",
                               vs_plain_why="wins: a verify of 20 tokens costs 30 ms"))
    assert "1.31× plain decoding (measured)" in page and "sub wins" in page and "This setting wins" in page
    # before plain decoding is measured: no ratio at all (issue 46)
    page = stats_html(RunStats(tokens_per_s=9.0, vs_plain=None, vs_plain_basis="measuring: the ratio comes later"))
    assert "measuring" in page and "× plain" not in page and "This setting" not in page
    # plain decoding is the yardstick: no ratio against itself
    page = stats_html(RunStats(tokens_per_s=15.0, vs_plain=None,
                               vs_plain_basis="this run is plain decoding: the yardstick"))
    assert "× plain" not in page and "the yardstick" in page and "This setting" not in page
    assert PLOT_WIDTH_PX >= 900


def test_no_winning_verdict_on_a_loop_or_from_the_whole_runs_reason_part_way():
    from viz.text_html import sources_note
    winning = RunStats(tokens_per_s=40.0, vs_plain=2.1, vs_plain_basis="measured plain run",
                       vs_plain_why="wins: a verify of 20 tokens costs 30 ms")
    page = stats_html(winning, sources_note({"lookup": 30, "base model": 10}, True), looping=True)
    assert "This setting wins" not in page and "sub wins" not in page and "speed-note wins" not in page
    assert "2.1× plain decoding (measured, on a loop)" in page and "repeats itself" in page
    assert "30 by prompt lookup" in page and "10 token(s) from the base model" in page
    assert "This setting wins: a verify" in stats_html(winning)  # the same run without a loop
    # a replay part-way: the ratio so far loses while the recorded reason is the whole run's win
    early = dataclasses.replace(winning, vs_plain=0.8)
    page = stats_html(early)
    assert "speed-note loses" in page and "This setting loses so far" in page and "wins:" not in page
    assert sources_note({"base model": 5}, False) == ""  # nothing guessed, no loop: nothing to say


def test_step_trace_figure_draws_every_step_of_the_adaptive_rows():
    from viz.bench_plot import step_trace_figure, stepped_strategies
    rows = [{"strategy": "ar", "prompt_id": "1", "step_nodes": [0, 0], "step_tokens": [1, 1],
             "step_verify_ms": [20.0, 20.0], "step_state": ["", ""]}]
    for pid in ("1", "2"):
        rows.append({"strategy": "dynamic:auto", "prompt_id": pid, "step_nodes": [0, 5, 9, 0],
                     "step_tokens": [1, 2, 3, 1], "step_verify_ms": [20.0, 25.0, 30.0, 20.0],
                     "step_state": ["normal", "probing", "normal", "backing off"]})
    result = {"rows": rows}
    assert stepped_strategies(result) == ["dynamic:auto"]
    figure = step_trace_figure(result, "dynamic:auto")
    drawn = sum(len(trace.x) for trace in figure.data)
    assert drawn == 8  # every step of both prompts, none of the plain run's
    assert {trace.name for trace in figure.data} == {"normal", "probing", "backing off"}
    import plotly.graph_objects as go
    for built in (figure, bench_figure({"summary": {"ar": {"tokens_per_s": 10.0, "mean_accepted": 1.0}}}, "t")):
        go.Figure(json.loads(built.to_json()))  # built without validation: only real plotly properties
