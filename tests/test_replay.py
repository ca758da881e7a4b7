"""Traces and replay: a recorded run draws the same views as the live run it recorded, without a model."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import labstate
from core.decoder import DecodeConfig, PageViews, start_session, strategy_config
from core.strategy import parse_strategy
from core.records import StepKind
from labstate import replay
from tests.tiny import tiny_base, tiny_heads, tiny_hydra
from viz.facts import ArBaseline, RunFacts, RunStats
from labstate.trace import MAX_TRACE_BYTES, TRACE_VERSION, TraceError, load_trace, trace_json
from viz.view import VIEW_FIELDS, build_view

REPO = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 42, 17, 42, 99, 3, 17, 42]  # repeats: the lookup chain has something to copy
REQUIRED_GALLERY = {"dynamic_vs_fixed", "right_then_wrong", "hydra_beside_medusa", "prompt_lookup_copy", "datastore_phrase",
                    "auto_falls_back", "typical_acceptance", "speculative_sampling", "bf16_near_tie"}


def _same(left, right) -> bool:
    """Two view values alike: figures by their JSON, everything else by value."""
    if hasattr(left, "to_json"):
        return left.to_json() == right.to_json()
    return left == right


def _live_facts(spec_text: str, fixed: bool = False, rival: bool = False) -> RunFacts:
    base = tiny_base("llama")
    spec = parse_strategy(spec_text)
    medusa, hydra = tiny_heads(base), tiny_hydra(base)
    heads, other = (hydra, medusa) if spec.family == "hydra" else (medusa, hydra)
    decode = strategy_config(spec.with_budget(12), DecodeConfig(max_new_tokens=10, top_m=8))
    session = start_session(base, heads, PROMPT, decode, page=PageViews(fixed=fixed, rival=other if rival else None))
    while not session.finished:
        session.step()
    stats = RunStats(tokens=len(session.output_ids), steps=len(session.records), mean_accepted=session.tokens_per_step,
                     tokens_per_s=123.4, status="finished: limit", check="identical (25 tokens)", check_state="ok",
                     vs_plain=1.7, vs_plain_basis="measured plain run", vs_plain_why="wins: a test")
    settings = {"strategy": spec.text, "budget": 12, "top_m": 8, "depth": 4, "fixed_preset": "mc_sim_7b_63",
                "rule": "greedy", "temperature": 0.0, "precision": "fp32", "max_new_tokens": 24,
                "compare_fixed": fixed, "custom_tree": "", "compare_heads": rival}
    return RunFacts(prompt="tiny", spec=spec, settings=settings, records=list(session.records),
                    output_ids=list(session.output_ids), first_text="x", text="tiny text",
                    token_bytes={t: bytes([t]) for t in range(256)}, stats=stats, check={"state": "ok"},
                    ar=ArBaseline(step_seconds=[0.01] * 24), state="finished: limit", finished=True,
                    stop_reason="limit", model="tiny-llama", heads="tiny heads")


@pytest.mark.parametrize("spec, config", [("dynamic", {"fixed": True}), ("fixed", {}),
                                          ("dynamic:auto+lookup", {}), ("hydra", {"rival": True})])
def test_a_trace_draws_every_view_as_the_live_run_did(spec, config):
    live = _live_facts(spec, **config)
    loaded = load_trace(trace_json(live, {"title": "round trip"})).facts
    assert len(loaded.records) == len(live.records) > 0
    for index in sorted({None, 0, len(live.records) // 2}, key=lambda i: -1 if i is None else i):
        ours, theirs = build_view(live, index), build_view(loaded, index)
        for name in VIEW_FIELDS:
            if name == "status":  # the replay says it is one
                assert theirs.status.endswith(ours.status) and "Replay of a recorded run" in theirs.status
                continue
            if name == "tree_compare" and "comparison is off" in ours.tree_compare.to_json():
                assert "recorded without the fixed-tree comparison" in theirs.tree_compare.to_json()
                continue  # a recording never asks to tick a box it lacks
            if name == "recording":  # and shows what it was recorded with, where a live run shows nothing
                assert ours.recording == "" and "This recording's settings" in theirs.recording
                continue
            assert _same(getattr(ours, name), getattr(theirs, name)), (spec, index, name)


@pytest.mark.parametrize("family", ["dynamic", "hydra"])
def test_two_drafters_grow_their_trees_from_the_same_context_and_change_nothing(family):
    base = tiny_base("llama")
    medusa, hydra = tiny_heads(base), tiny_hydra(base)
    heads, rival = (hydra, medusa) if family == "hydra" else (medusa, hydra)
    config = DecodeConfig(spec=f"{family}:10", top_m=8, max_new_tokens=12)
    alone = start_session(base, heads, PROMPT, config)
    beside = start_session(base, heads, PROMPT, config, page=PageViews(rival=rival))
    for session in (alone, beside):
        while not session.finished:
            session.step()
    assert beside.output_ids == alone.output_ids  # the other tree is verified, never committed
    drafted = [r for r in beside.records if r.kind == StepKind.TREE]  # steps near the token limit may be plain
    assert len(drafted) >= 3 and all(r.rival is not None for r in drafted)
    assert all(r.rival is None for r in alone.records)
    for record in drafted:
        assert record.rival.grown == (family == "dynamic")  # Hydra beside Medusa, Medusa beside Hydra
        assert record.rival.node_tokens[0] == record.outcome.node_tokens[0]  # the same root: the same context
        assert 1 <= record.rival.tree.num_nodes <= max(record.outcome.tree.num_nodes, 1)
    facts = _live_facts(family, rival=True)
    view = build_view(facts, 0)
    assert "same context" in view.tree_rival.layout.title.text and view.tree_rival.data


def _assert_valid_plotly(view) -> None:
    """The views build figures without plotly's validation (speed): passed back through a validating
    constructor, every one must hold only real plotly properties."""
    import plotly.graph_objects as go
    for name in VIEW_FIELDS:
        value = getattr(view, name)
        if hasattr(value, "to_json"):
            go.Figure(json.loads(value.to_json()))  # ValueError on any invalid property


def test_the_shipped_gallery_replays_every_step_without_a_model():
    entries = {entry.name: entry for entry in replay.gallery()}
    assert REQUIRED_GALLERY <= set(entries) and len(entries) >= 8
    for name, entry in entries.items():
        assert entry.title and len(entry.notice) > 40
        state = replay.open_gallery(name)
        total = replay.total_steps(state)
        assert total > 0 and build_view(replay.replay_facts(state)).tree is not None
        notes = replay.trace_of(state).facts.step_notes
        assert notes, f"{name}: nothing noted"  # the notes come from the records
        assert all(0 <= step < total for step in notes)
        assert state.shown - 1 in notes  # it opens on its point, a step its notes are about (issue 46)
        drawn = sorted({total - 1, *list(notes)[:1]})  # every step loads; a noted one and the last are drawn
        for step in drawn:
            view = build_view(replay.replay_facts(replay.moved(state, step + 1)), step)
            assert f"Step {step + 1}:" in view.tree.layout.title.text
            _assert_valid_plotly(view)
        while state.shown < total:
            state = replay.step(state)
        assert replay.replay_facts(state) == replay.trace_of(state).facts  # the end is the recorded run
        with pytest.raises(labstate.LabNotice, match="no more steps"):
            replay.step(state)


def test_replay_moves_and_its_speed_card_uses_the_recorded_baseline():
    state = replay.moved(replay.open_gallery("dynamic_vs_fixed"), 0)
    full = replay.trace_of(state).facts
    assert replay.replay_facts(state).records == [] and replay.replay_facts(state).output_ids == full.output_ids[:1]
    third = replay.moved(state, 3)
    facts = replay.replay_facts(third)
    assert len(facts.records) == 3 and len(facts.output_ids) == 1 + sum(len(r.new_tokens) for r in full.records[:3])
    seconds = sum(r.times.total for r in full.records[:3])
    plain = len(full.ar.step_seconds) / sum(full.ar.step_seconds)
    assert facts.stats.tokens_per_s == pytest.approx((len(facts.output_ids) - 1) / seconds)
    assert facts.stats.vs_plain == pytest.approx(facts.stats.tokens_per_s / plain)
    assert replay.moved(state, 10**6).shown == len(full.records) and replay.moved(third, -5).shown == 0
    assert facts.text and full.text.startswith(facts.text[:5])


def _gallery_text() -> str:
    return (replay.GALLERY_DIR / replay.gallery()[0].file).read_text(encoding="utf-8")


def _broken(mutate) -> str:
    data = json.loads(_gallery_text())
    mutate(data)
    return json.dumps(data)


MALFORMED = [
    ("not json", "not valid JSON"),
    ("[1, 2, 3]", "not a Medusa Tree Lab trace"),
    (json.dumps({"version": 1, "meta": {}, "steps": []}), "version 1"),
    (_broken(lambda d: d.update(steps="oops")), "damaged"),
    (_broken(lambda d: d["steps"][0]["outcome"].update(node_tokens=["a"])), "damaged"),
    (_broken(lambda d: d["steps"][0]["outcome"].update(accepted_nodes=[0, 999])), "accepted path"),
    (_broken(lambda d: d["facts"].update(strategy="beam")), "grammar"),
    (_broken(lambda d: d["facts"].pop("stats")), "missing field"),
    (_broken(lambda d: d["steps"][0].update(index=7)), "says it is step 8"),
    (_broken(lambda d: d["facts"]["stats"].update(tokens_per_s="x")), r"damaged.*expected a number"),
    (_broken(lambda d: d["facts"]["stats"].update(status=3)), r"damaged.*stats.status: expected a text"),
    (_broken(lambda d: d["facts"].update(settings={"budget": [1, 2]})), r"damaged.*settings"),
    # issue 71: values that loaded but crashed drawing, or kept memory, are a damaged trace now
    (_broken(lambda d: d["facts"]["settings"].update(temperature="hot")), r"damaged.*expected a number"),
    (_broken(lambda d: d["facts"]["settings"].update(depth="abc")), r"damaged.*expected a number"),
    (_broken(lambda d: d["steps"][0]["outcome"]["tree"].update(kind="bogus")), r"damaged.*unknown tree kind"),
    (_broken(lambda d: d["steps"][0].update(head_probs=[[-0.5] * len(r) for r in d["steps"][0]["head_probs"]])),
     r"damaged.*probability must be between 0 and 1"),
    (_broken(lambda d: d["steps"][0].update(head_token_ids=[list(range(100_000))] * 4,
                                            head_probs=[[0.0] * 100_000] * 4)), r"damaged.*at most 64"),
    (_broken(lambda d: d["facts"].update(ar={"step_seconds": [0, 0]})), r"damaged.*seconds must be between"),
    (_broken(lambda d: d["facts"].update(output_ids=[2 ** 70])), r"damaged.*whole number from 0"),
    (_broken(lambda d: d["facts"]["stats"].update(tokens=2 ** 70)), r"damaged.*stats.tokens"),
    (_broken(lambda d: d["facts"]["stats"].update(tokens_per_s=1e400)), r"damaged"),
    (_broken(lambda d: d["steps"][0]["times"].update(verify=-1)), r"damaged.*verify seconds"),
]


@pytest.mark.parametrize("text, message", MALFORMED + [(_gallery_text()[: len(_gallery_text()) // 2], "not valid JSON")])
def test_malformed_traces_get_a_clear_message(text, message):
    with pytest.raises(TraceError, match=message):
        load_trace(text)
    with pytest.raises(labstate.LabInputError, match=message):
        replay.open_upload(text.encode())


def test_a_huge_upload_is_refused_before_parsing():
    with pytest.raises(TraceError, match="bytes"):
        load_trace(b" " * (MAX_TRACE_BYTES + 1))
    assert TRACE_VERSION == json.loads(_gallery_text())["version"]


def test_a_version_2_trace_replays_as_version_3():
    """Version 2 named a step by one `strategy` (the family, or "autoregressive" / "lookup" for a step
    that verified the root or the chains alone); it is read as the run's family and the step's kind."""
    current = json.loads(_gallery_text())
    old = {**current, "version": 2, "steps": [
        {**{k: v for k, v in step.items() if k not in ("family", "kind")},
         "strategy": {"plain": "autoregressive", "chains": "lookup"}.get(step["kind"], step["family"])}
        for step in current["steps"]]}
    assert load_trace(json.dumps(old)).facts.records == load_trace(json.dumps(current)).facts.records
    wrong = {**current, "steps": [{**current["steps"][0], "kind": "guess"}]}
    with pytest.raises(TraceError, match="damaged"):
        load_trace(json.dumps(wrong))


def test_a_bad_upload_leaves_the_page_and_its_replay_working():
    import app

    state = replay.moved(replay.open_gallery("dynamic_vs_fixed"), 2)
    with pytest.warns(UserWarning, match="not valid JSON"):
        out = app.on_upload(b"{truncated", state)
    assert out[0] == state and "⚠️" in out[1 + VIEW_FIELDS.index("status")]
    stepped = app.on_replay_step(out[0])
    assert stepped[0].shown == 3
    with pytest.warns(UserWarning, match="Pick a gallery run"):
        app.on_replay_step(None)
    uploaded = app.on_upload(_gallery_text().encode(), None)
    assert uploaded[0].source.startswith("upload:") and replay.total_steps(uploaded[0]) > 0


def test_a_replayed_step_draws_the_next_one_ahead():
    import app
    import replay_events

    state = replay.moved(app.on_pick("dynamic_vs_fixed")[0], 0)
    for shown in (1, 2):
        state = app.on_replay_step(state)[0]
        replay_events.LOOK_AHEAD.submit(lambda: None).result()  # one worker: the look-ahead before it has finished
        assert len(replay_events.RECORDED_VIEWS) > 0
        hits = replay_events.RECORDED_VIEWS.hits
        ahead = replay_events.recorded_view(replay.moved(state, shown + 1), "")
        assert replay_events.RECORDED_VIEWS.hits == hits + 1  # already drawn: Step finds it cached
        ahead_state = replay.moved(state, shown + 1)
        assert ahead.status == build_view(replay.replay_facts(ahead_state), ahead_state.shown - 1, "").status


def test_revisit_appears_with_a_second_step_and_revisits_what_the_page_shows():
    import app
    import replay_events

    slider = VIEW_FIELDS.index("step_slider") + 1  # outputs: the replay state, then the view
    picked = app.on_pick("dynamic_vs_fixed")
    point = replay.open_gallery("dynamic_vs_fixed").shown  # its point: the first step the dynamic tree wins
    assert point >= 2 and picked[0].shown == point and picked[slider].visible is True  # opened on its point
    assert f"Opened on step {point}" in picked[1 + VIEW_FIELDS.index("status")]
    state = replay.moved(picked[0], 0)
    assert replay_events.replay_view(state)[slider].visible is False  # no "1 … 2" before any step
    first = app.on_replay_step(state)
    assert first[slider].visible is False  # one step: nothing to revisit yet
    state = app.on_replay_step(app.on_replay_step(first[0])[0])[0]
    assert state.shown == 3
    out = app.on_view(2, state)  # the live page's slider while a replay is shown: the replay's step 2
    assert out[0].shown == 2 and out[slider].visible is True and out[slider].value == 2
    assert "step 2 of" in out[1 + VIEW_FIELDS.index("status")]


def test_a_model_that_cannot_load_falls_back_to_the_gallery_and_says_why(monkeypatch):
    import gradio as gr

    import app

    def no_model(precision: str):
        raise OSError("no weights here")

    launched: list = []
    monkeypatch.setattr(app, "REPLAY_ONLY", False)
    monkeypatch.setattr(app, "demo", app.demo)  # main() rebinds it: put the live page back afterwards
    monkeypatch.setattr(app.labstate, "runtime", no_model)
    monkeypatch.setattr(app.labstate, "machine_precision", lambda: "fp32")
    monkeypatch.setattr(app, "prewarm", lambda: launched.append("prewarmed"))
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **options: launched.append(self))
    monkeypatch.setattr(gr.Blocks, "block_thread", lambda self: None)
    app.main(["--port", "7999"])
    page, prewarmed = launched
    texts = [str(getattr(block, "value", "")) for block in page.blocks.values()]
    assert any("could not be loaded here (OSError)" in text for text in texts)
    assert not any(getattr(block, "elem_id", None) == "start-btn" for block in page.blocks.values())
    assert prewarmed == "prewarmed"  # the gallery's first run is drawn ahead as in replay-only mode


def test_replay_only_mode_imports_neither_torch_nor_transformers():
    code = ("import sys, app; from labstate import replay; from viz.view import build_view; "
            "s = replay.step(replay.open_gallery(replay.gallery()[0].name)); build_view(replay.replay_facts(s), 0); "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    env = {"MEDUSA_LAB_REPLAY_ONLY": "1", "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False",
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)


def test_the_opening_gallery_run_opens_where_the_dynamic_tree_beats_the_fixed_one():
    """Issue 46: the first run of the gallery opens on a step where the dynamic tree accepts more
    than Medusa's fixed tree on the same heads and context."""
    opening = replay.open_gallery(replay.gallery()[0].name)
    record = replay.replay_facts(opening).records[-1]
    assert record.comparison is not None
    assert record.outcome.accepted_length > record.comparison.accepted_length


def test_a_recording_on_screen_shows_the_settings_it_was_recorded_with():
    """In place of the live settings, a replay shows its own prompt, strategy, precision, acceptance rule
    and token limit, read-only; a live run shows none (the page then shows the live controls)."""
    state = replay.open_gallery("speculative_sampling")
    facts = replay.replay_facts(state)
    shown = build_view(facts, state.shown - 1).recording
    settings = facts.settings
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in shown.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows["Strategy"] == facts.strategy_label and rows["Precision"] == settings["precision"]
    assert rows["Acceptance"] == f"{settings['rule']} at temperature {settings['temperature']:g}"
    assert rows["Max new tokens"] == str(settings["max_new_tokens"])
    assert "Recorded with" not in build_view(facts, 0).notice  # the notice column keeps to what to notice
    live = dataclasses.replace(facts, recording="", notice="", step_notes={})
    assert build_view(live, 0).recording == ""


def test_recording_settings_escape_what_the_prompt_holds():
    """A trace's prompt is anyone's text: pipes, markup and line breaks cannot break the table or the page."""
    state = replay.open_gallery("speculative_sampling")
    facts = dataclasses.replace(replay.replay_facts(state), prompt="a | b\n<img src=x onerror=alert(1)> **bold**")
    shown = build_view(facts, 0).recording
    assert "<img" not in shown.replace("\\<img", "") and "a \\| b" in shown and "\\*\\*bold" in shown


def test_the_gallery_is_offered_numbered_in_lecture_order():
    """The picker numbers the recordings in the order a lecture takes them: the dynamic tree against the
    fixed one first, then what the heads get wrong, the other drafters, the budget and the sampling rules."""
    import gradio as gr
    import page
    entries = replay.gallery()
    with gr.Blocks():
        box = page.replay_controls(entries, open_=True, live=False)
    assert [label for label, _ in box["pick"].choices] == [f"{number}. {entry.title}"
                                                          for number, entry in enumerate(entries, start=1)]
    assert [entry.name for entry in entries][:4] == ["dynamic_vs_fixed", "right_then_wrong", "hydra_beside_medusa",
                                                     "eagle_beside_medusa"]
