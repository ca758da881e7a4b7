"""viz/ from hand-made StepRecords: no model, no gradio, fast."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from core.records import PhaseTimes, StepRecord, TreeOutcome
from core.tree import CandidateTree, dynamic_tree, fixed_tree, named_tree
from viz import style
from viz.labels import escape, token_label, visible
from viz.mask_plot import mask_figure, mask_values
from viz.text_html import RunStats, emitted_tokens, heads_html, stats_html, text_html
from viz.timing_plot import ArBaseline, accepted_figure, cumulative_figure, phase_figure
from viz.trace import to_jsonable, trace_dict, trace_json
from viz.tree_plot import empty_figure, tree_figure, tree_layout

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


def _record(index: int, outcome: TreeOutcome, comparison: TreeOutcome | None = None,
            strategy: str = "dynamic") -> StepRecord:
    new = [outcome.node_tokens[i] for i in outcome.accepted_nodes[1:]] + [outcome.bonus_token]
    return StepRecord(index=index, strategy=strategy, context_length=20 + index, head_token_ids=[[1, 2, 3]] * 3,
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
    assert list(fig.layout.xaxis.ticktext) == ["root", "head 1", "head 2", "head 3", "bonus"]


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
    assert fig.layout.height <= 1100


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
    only_self = cumulative_figure([_record(0, _autoregressive_outcome(), strategy="autoregressive")], None)
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
    assert page.count("r-accepted") == 3 + 1  # three tokens + the legend
    assert page.count("r-bonus") == 2 + 1
    assert page.count(" sel") == 4  # the selected step's tokens
    assert 'class="tok s1 r-bonus"' in page
    assert "Press Start" in text_html([])


def test_heads_html_marks_accepted_guesses_and_escapes():
    page = heads_html(_record(0, _fixed_outcome()))
    assert page.count('class="acc"') == 3  # one per accepted depth (rank 0 each)
    assert "&lt;b&gt;" in page and "<b>" not in page
    assert "after the first step" in heads_html(None)
    plain = dataclasses.replace(_record(0, _autoregressive_outcome(), strategy="autoregressive"), head_probs=[],
                                head_token_ids=[], head_texts=[])
    assert "autoregressive" in heads_html(plain)


def test_stats_html():
    page = stats_html(RunStats(tokens=12, steps=5, mean_accepted=2.4, tokens_per_s=9.5, status="running",
                               check="<identical>", check_state="ok"))
    assert "12" in page and "2.40" in page and "9.5" in page
    assert "&lt;identical&gt;" in page and 'check ok' in page


# -- trace ----------------------------------------------------------------------------------------
def test_trace_round_trips_through_json():
    records = [_record(0, _fixed_outcome(), comparison=_fixed_outcome()), _record(1, _autoregressive_outcome())]
    records[0].outcome.tree.buffers()  # populate the cached buffers: they must not leak into the trace
    text = trace_json(records, {"prompt": "<b>hi</b>", "nan": math.nan, "config": {"t": (1, 2)}})
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
    assert trace_dict(records, {})["version"] == 1


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
    assert list(fig.layout.xaxis.ticktext) == ["root", "1", "2", "3", "bonus"]
    assert _trace(fig, "◆ copied by prompt lookup").marker.symbol == "diamond"
    assert not [t for t in tree_figure(_fixed_outcome(), "f").data if t.name == "◆ copied by prompt lookup"]
    tokens = emitted_tokens([_record(0, outcome)], first_id=200, first_text="r", limit=100)
    assert [t.role for t in tokens] == ["root", "accepted", "copied", "copied", "bonus"]
    page = text_html(tokens)
    assert page.count("r-copied") == 2 + 1  # two tokens + the legend entry, shown only when copies exist
    assert "r-copied" not in text_html(emitted_tokens([_record(0, _fixed_outcome())], 100, "x", 100))
