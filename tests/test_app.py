"""The app end to end through its API: launched in-process on a free port, driven by gradio_client.

Small settings (budget 15, 16 new tokens) keep it quick on a 2-core CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import re
import threading
import time
import urllib.request
from typing import Iterator

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client.exceptions import AppError  # noqa: E402

import app  # noqa: E402  (builds the Blocks; launches nothing)
from offline.served import free_port  # noqa: E402
import labstate  # noqa: E402
from labstate import replay as replay_module  # noqa: E402
from core import settings  # noqa: E402
import server  # noqa: E402
from core.decoder import DecodeConfig, decode  # noqa: E402
from core.budget.cost_profile import CostProfile  # noqa: E402
from core.records import PhaseTimes, StepKind, StepRecord, TreeOutcome  # noqa: E402
from core.strategy import DYNAMIC, StrategySpec  # noqa: E402
from core.tree import CandidateTree, fixed_tree  # noqa: E402
import viz.view as view_module  # noqa: E402
from viz.facts import RunFacts, RunStats  # noqa: E402

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:.*no_silent_downcasting:Warning"),
              pytest.mark.filterwarnings("ignore:The copy keyword is deprecated:Warning")]

OUT = {name: i for i, name in enumerate(app.VIEW_OUTPUT_NAMES)}
SETTINGS = dict(strategy="dynamic", budget=15, top_m=8, depth=4, fixed_preset="mc_sim_7b_63", rule="greedy",
                temperature=0.0, precision="fp32", max_new_tokens=16, compare_fixed=True)
PROMPT_A = "Write a haiku about cats."
PROMPT_B = "List three uses of <b>HTML</b> tags & why\nthey matter."


# a made-up verify-cost profile (no 5-10 s measurement in tests): one token 30 ms, 64 tokens 90 ms
PROFILE = CostProfile(sizes=[1, 16, 64, 256], ms=[30.0, 40.0, 90.0, 300.0], device="cpu", model="test")


@pytest.fixture(scope="module", autouse=True)
def profiles():
    saved = dict(labstate.shared.MODELS.profiles)
    labstate.shared.MODELS.profiles.update({"fp32": PROFILE, "bf16": PROFILE, "gguf": PROFILE})
    yield
    labstate.shared.MODELS.profiles.clear()
    labstate.shared.MODELS.profiles.update(saved)


@contextlib.contextmanager
def _serving(demo) -> Iterator[str]:
    """`demo` served in this process on a free port (the page's launch options); yields its URL."""
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **app.launch_kwargs())
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def url() -> str:
    with _serving(app.demo) as served:
        yield served


@pytest.fixture(scope="module")
def plain_greedy():
    """Plain greedy decoding of a prompt by core (the yardstick), cached per (prompt, tokens)."""
    base = labstate.runtime("fp32").base  # the same model object the app uses
    cache: dict[tuple[str, int], list[int]] = {}

    def run(prompt: str, max_new_tokens: int = SETTINGS["max_new_tokens"]) -> list[int]:
        key = (prompt, max_new_tokens)
        if key not in cache:
            config = DecodeConfig(spec="ar", max_new_tokens=max_new_tokens)
            cache[key] = decode(base, None, prompt, config).output_ids
        return cache[key]

    return run


def _client(url: str):
    return gradio_client.Client(url, verbose=False, download_files=False)


def _call(client, api: str, prompt: str | None = None, **overrides):
    if api in ("start", "step", "run"):
        kwargs = {**SETTINGS, **overrides}
        if api == "run":
            job = client.submit(prompt, **kwargs, api_name="/run")
            outputs = list(job)
            return outputs[-1], outputs
        return client.predict(prompt, **kwargs, api_name=f"/{api}")
    return client.predict(**overrides, api_name=f"/{api}")


def _card(view, name: str) -> str:
    """The value on a stats card, by its label."""
    found = re.search(rf'<div class="v">([^<]*)</div><div class="k">{name}</div>', view[OUT["stats"]])
    return found.group(1).strip() if found else ""


def _plot_points(view, name: str) -> int:
    figure = json.loads(view[OUT[name]]["plot"])
    nodes = [t for t in figure["data"] if t.get("name") == "candidate (colour = joint p)"]
    return len(nodes[0]["x"]) if nodes else 0


def test_start_step_run_matches_plain_greedy(url, plain_greedy, monkeypatch):
    monkeypatch.setattr(app, "RUN_REDRAW_S", 0.0)  # every step drawn
    client = _client(url)
    view = _call(client, "start", PROMPT_A)
    assert "Prefilled" in view[OUT["status"]]
    assert view[OUT["summary"]]["tokens"] == 1 and view[OUT["summary"]]["steps"] == 0
    for expected_steps in (1, 2, 3):
        view = _call(client, "step", PROMPT_A)
        summary = view[OUT["summary"]]
        assert summary["steps"] == expected_steps and summary["viewing_step"] == expected_steps  # from 1
    assert _plot_points(view, "tree") == 16  # root + 15 candidates
    assert _plot_points(view, "tree_compare") == 64  # mc_sim_7b_63 + root
    final, outputs = _call(client, "run", PROMPT_A)
    assert len(outputs) >= 2  # streamed, one update per step
    summary = final[OUT["summary"]]
    reference = plain_greedy(PROMPT_A)
    assert summary["finished"] and summary["output_ids"] == reference
    emitted = [len(r.new_tokens) for r in app.SESSIONS.get(client.session_hash).run.session.records]
    assert summary["viewing_step"] == emitted.index(max(emitted)) + 1  # the step that emitted the most
    assert summary["greedy_check"]["state"] == "ok"
    assert "identical" in final[OUT["stats"]]
    assert final[OUT["plain_text"]] == labstate.runtime("fp32").base.decode(reference)


def test_run_to_end_redraws_at_its_pace_and_always_draws_the_end(url, plain_greedy, monkeypatch):
    """Issue 46: Run to end redraws at most every RUN_REDRAW_S (each redraw takes the cores from
    decoding), the run's progress alone (status, cards, text); its first step's progress and its
    finished state, figures and all, are always drawn."""
    monkeypatch.setattr(app, "RUN_REDRAW_S", 3600.0)
    monkeypatch.setattr(app, "REDRAW_CLOCK", lambda: 0.0)  # a machine booted a moment ago (issue 70)
    client = _client(url)
    _call(client, "start", PROMPT_B)
    final, outputs = _call(client, "run", PROMPT_B)
    assert len(outputs) == 2 and _card(outputs[0], "steps") == "1"  # the first step's progress...
    skipped = {"__type__": "update"}  # ...and no figure or table: they are drawn when the run stops
    assert outputs[0][OUT["tree"]] == skipped and outputs[0][OUT["summary"]] == skipped
    assert outputs[0][OUT["tree_compare"]] == skipped and outputs[0][OUT["mask"]] == skipped
    assert final[OUT["summary"]]["finished"] and final[OUT["summary"]]["output_ids"] == plain_greedy(PROMPT_B)


def test_step_auto_starts_and_two_clients_keep_separate_state(url, plain_greedy):
    a, b = _client(url), _client(url)
    for step in range(1, 4):
        view_a = _call(a, "step", PROMPT_A)
        view_b = _call(b, "step", PROMPT_B, budget=8, compare_fixed=False)
        assert view_a[OUT["summary"]]["steps"] == step and view_a[OUT["summary"]]["prompt"] == PROMPT_A
        assert view_b[OUT["summary"]]["steps"] == step and view_b[OUT["summary"]]["prompt"] == PROMPT_B
    assert _plot_points(view_b, "tree") == 9
    assert "comparison is off" in view_b[OUT["tree_compare"]]["plot"]  # comparison off: a message, no tree
    final_b, _ = _call(b, "run", PROMPT_B, budget=8, compare_fixed=False)
    final_a, _ = _call(a, "run", PROMPT_A)
    assert final_a[OUT["summary"]]["output_ids"] == plain_greedy(PROMPT_A)
    assert final_b[OUT["summary"]]["output_ids"] == plain_greedy(PROMPT_B)


def test_view_past_step_and_trace(url):
    client = _client(url)
    final, _ = _call(client, "run", PROMPT_A, max_new_tokens=8)
    steps = final[OUT["summary"]]["steps"]
    past = client.predict(step_index=1, api_name="/view")  # steps are numbered from 1 on the page
    assert past[OUT["summary"]]["viewing_step"] == 1
    assert "Step 1:" in past[OUT["tree"]]["plot"]
    assert past[OUT["summary"]]["steps"] == steps
    file = client.predict(api_name="/trace")  # a FileData dict (download_files=False)
    assert file["orig_name"].endswith(".json")
    with urllib.request.urlopen(file["url"], timeout=30) as response:
        trace = json.loads(response.read().decode("utf-8"))
    assert len(trace["steps"]) == steps
    assert trace["meta"]["output_ids"] == final[OUT["summary"]]["output_ids"]
    assert trace["meta"]["decode_config"]["spec"]["family"] == "dynamic"  # the strategy, carried whole
    assert all(step["comparison"] is not None for step in trace["steps"])


def test_bad_input_gives_a_message_not_a_traceback(url):
    client = _client(url)
    with pytest.raises(AppError, match="Type a prompt"):  # a readable gr.Error, not a traceback
        _call(client, "start", "   ")
    with pytest.raises(AppError, match="greedy rule needs temperature 0"):
        _call(client, "step", PROMPT_A, temperature=0.7)
    with pytest.raises(AppError, match="no_such_tree"):
        _call(client, "step", PROMPT_A, fixed_preset="no_such_tree")
    with pytest.raises(AppError, match="node budget must be between 1 and 256, got 999"):
        _call(client, "start", PROMPT_A, budget=999)
    view = client.predict(api_name="/check")  # actions that do not apply now: a note, not an error
    assert "Nothing to check" in view[OUT["status"]]
    _call(client, "run", PROMPT_A, max_new_tokens=3)
    view = _call(client, "step", PROMPT_A, max_new_tokens=3)
    assert "finished" in view[OUT["status"]]


@pytest.mark.parametrize("strategy", ["autoregressive", "fixed"])
def test_other_strategies(url, plain_greedy, strategy):
    client = _client(url)
    final, _ = _call(client, "run", PROMPT_A, strategy=strategy, max_new_tokens=6, depth=2)
    summary = final[OUT["summary"]]
    assert summary["output_ids"] == plain_greedy(PROMPT_A, 6)
    if strategy == "autoregressive":
        assert summary["steps"] == 5 and _plot_points(final, "tree") == 1
        assert summary["greedy_check"]["text"] == "this is plain decoding"
    else:
        assert "cut to depth 2" in final[OUT["status"]]
        assert _plot_points(final, "tree") == 1 + sum(1 for p in labstate.load_named_trees()["mc_sim_7b_63"]
                                                      if len(p) <= 2)


def test_run_can_be_stopped_then_stepped(url):
    client = _client(url)
    job = client.submit(PROMPT_B, **{**SETTINGS, "max_new_tokens": 200}, api_name="/run")
    deadline = time.time() + 120
    while len(job.outputs()) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert job.cancel()
    time.sleep(1.0)
    done = len(job.outputs())
    view = _call(client, "step", PROMPT_B, max_new_tokens=200)
    summary = view[OUT["summary"]]
    assert not summary["finished"] and summary["steps"] >= done


# -- the state/services layer without the server -------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    (dict(budget=0), "node budget"), (dict(budget=15.5), "whole number"), (dict(strategy="beam"), "strategy"),
    (dict(rule="typical", temperature=3), "temperature"), (dict(temperature=0.5), "greedy rule"),
    (dict(precision="fp8"), "precision"), (dict(max_new_tokens=2000), "max new tokens"),
    (dict(fixed_preset="nope"), "unknown fixed tree"), (dict(top_m=None), "whole number"),
])
def test_parse_settings_rejects_bad_values(bad, message):
    assert labstate.parse_settings(SETTINGS).budget == 15
    with pytest.raises(labstate.LabInputError, match=message):
        labstate.parse_settings({**SETTINGS, **bad})


def test_decode_config_cuts_deep_fixed_trees_and_rejects_missing_heads():
    config, note = labstate.decode_config(labstate.parse_settings({**SETTINGS, "depth": 2}), max_depth=4)
    assert all(len(p) <= 2 for p in config.fixed_tree) and "cut to depth 2" in note
    config, note = labstate.decode_config(labstate.parse_settings(SETTINGS), max_depth=4)
    assert config.fixed_tree == "mc_sim_7b_63" and note == ""
    with pytest.raises(labstate.LabInputError, match="exceeds"):
        labstate.decode_config(labstate.parse_settings({**SETTINGS, "depth": 5}), max_depth=4)


FP32_DYNAMIC = labstate.Settings(spec=StrategySpec(DYNAMIC), budget=8, max_new_tokens=6, compare_fixed=False,
                                 precision="fp32")


def test_greedy_check_reports_a_divergence_with_its_logit_gap():
    lab = labstate.LabState()
    with pytest.raises(labstate.LabInputError, match="prompt"):
        labstate.start_run(lab, " ", labstate.Settings())
    run = labstate.start_run(lab, PROMPT_A, FP32_DYNAMIC)
    while not run.session.finished:
        labstate.step_run(lab, run)
    with pytest.raises(labstate.LabInputError, match="finished"):
        labstate.step_run(lab, run)
    assert labstate.greedy_check(lab, run).state == "pending"
    labstate.compute_check(lab, run)  # the event's work: the plain run
    assert labstate.greedy_check(lab, run).state == "ok"
    assert labstate.ar_baseline(lab, run).measured
    reference = lab.references[run.reference_key]
    reference.output_ids[3] += 1  # plant a divergence at token 3 (the 4th token)
    assert labstate.greedy_check(lab, run).state == "pending"  # its logit gap is not computed by drawing
    labstate.compute_check(lab, run)
    check = labstate.greedy_check(lab, run)
    assert check.state == "diff" and check.position == 3
    top1, top2 = reference.margins[3]  # the gap is the plain run's own, as it chose token 4
    assert check.logit_gap == pytest.approx(top1 - top2)
    assert "differs at token 4" in check.text


# -- issue 13.8: the wiring says each setting once; drawing never decodes ---------------------------------
def test_every_settings_event_takes_the_same_named_parameters():
    expected = ["prompt", *labstate.SETTING_NAMES]
    clicked = [*expected, "clicked_at"]  # Step and Run also take the click's time (Stop drops older clicks)
    for handler, names in ((app.on_start, expected), (app.on_step, clicked), (app.on_run, clicked)):
        assert list(inspect.signature(handler).parameters) == [*names, "request"]
    defaults = labstate.Settings().raw()
    assert labstate.parse_settings(defaults) == labstate.Settings()  # the page's defaults round-trip
    api = app.demo.get_api_info()["named_endpoints"]
    for name, names in (("/start", expected), ("/step", clicked), ("/run", clicked), ("/stop", ["clicked_at"])):
        assert [p["parameter_name"] for p in api[name]["parameters"]] == names
    with pytest.raises(labstate.LabInputError, match="unknown setting: colour"):
        labstate.parse_settings({"colour": "red"})
    assert not hasattr(labstate.SessionRegistry, "sweep")  # nothing called it


def test_render_draws_what_is_stored_and_never_decodes(monkeypatch):
    lab = labstate.LabState()
    run = labstate.start_run(lab, PROMPT_A, FP32_DYNAMIC)
    while not run.session.finished:
        labstate.step_run(lab, run)

    def forbidden(*args, **kwargs):
        raise AssertionError("render decoded something")

    monkeypatch.setattr(labstate.plain, "decode", forbidden)
    monkeypatch.setattr(labstate.plain, "divergence_from_margins", forbidden)
    view = app.render(lab)
    assert view[OUT["summary"]]["greedy_check"]["state"] == "pending"
    monkeypatch.undo()
    labstate.compute_check(lab, run)
    assert app.render(lab)[OUT["summary"]]["greedy_check"]["state"] == "ok"


def test_a_step_that_waited_through_stop_is_dropped():
    lab = labstate.LabState()
    run = labstate.start_run(lab, PROMPT_A, FP32_DYNAMIC)
    epoch = lab.epoch  # the step is asked for ...
    lab.stop()  # ... Stop comes before it gets its turn
    assert labstate.step_run(lab, run, epoch) is None and not run.session.records
    assert run.state == "stopped"
    assert labstate.step_run(lab, run, lab.epoch) is not None


def test_a_run_stopped_while_its_step_is_in_flight_says_stopping(monkeypatch):
    """Stop during a step: until that step ends the run says "stopping", then "stopped after step N"
    with the step that ran counted (a redraw in between once said "stopped after step 7", then 8)."""
    lab = labstate.LabState()
    run = labstate.start_run(lab, PROMPT_A, FP32_DYNAMIC)
    states = []
    step = run.session.step

    def step_with_stop_inside():
        lab.stop()
        states.append(run.state)
        return step()

    monkeypatch.setattr(run.session, "step", step_with_stop_inside)
    assert labstate.step_run(lab, run) is not None
    assert states == ["stopping: step 1 is ending"]
    assert run.state == "stopped after step 1"


def test_a_step_clicked_before_stop_that_read_the_epoch_after_it_is_dropped():
    """The race CI saw once ("stopped after step 8", then 9): a Step passed its early clicked-before-Stop
    check just before Stop, read the epoch just after it, and got the lock after Stop had drawn the run."""
    lab = labstate.LabState()
    run = labstate.start_run(lab, PROMPT_A, FP32_DYNAMIC)
    lab.stop(clicked_at=200.0)  # Stop at page time 200 ...
    epoch = lab.epoch  # ... and the Step clicked at 100 reads the epoch after it
    assert labstate.step_run(lab, run, epoch, clicked_at=100.0) is None and not run.session.records
    assert labstate.step_run(lab, run, epoch, clicked_at=300.0) is not None  # clicked after Stop: it steps


# -- issue 14: first run, status, help, export, numbering --------------------------------------------------
def test_defaults_are_the_setting_that_wins_on_a_cpu():
    from core.precision import BF16_MIN_SPEEDUP, default_precision, precision_choice

    settings = labstate.Settings()
    choice = precision_choice()  # bf16 only where it measured clearly faster (or a GPU)
    measured_fast = choice.speedup >= BF16_MIN_SPEEDUP and choice.tree_speedup >= BF16_MIN_SPEEDUP  # both
    fast = "bf16" if choice.device == "cuda" or measured_fast else "fp32"
    if choice.exact:  # every precision exact on the kernels: the cheapest plain step + small tree
        costs = {"fp32": choice.fp32_ms + choice.fp32_tree_ms, "bf16": choice.bf16_ms + choice.bf16_tree_ms,
                 "gguf": choice.gguf_ms + choice.gguf_tree_ms, "gguf-q8": choice.gguf_q8_ms + choice.gguf_q8_tree_ms}
        fast = min(costs, key=costs.get)
    assert default_precision() == fast == choice.dtype
    assert (settings.precision, settings.strategy, settings.auto_budget, settings.lookup) == (fast, DYNAMIC, True,
                                                                                              True)
    strategy = next(b for b in app.demo.blocks.values() if getattr(b, "elem_id", None) == "strategy")
    precision = next(b for b in app.demo.blocks.values() if getattr(b, "elem_id", None) == "precision")
    assert strategy.value == labstate.LOOKUP_STRATEGY and precision.value == fast
    assert strategy.info == labstate.strategy_help()[labstate.LOOKUP_STRATEGY]


def test_strategy_help_text_follows_the_choice():
    helps = {name: app.on_strategy(name).info for name in labstate.ui_strategies()}
    assert len(set(helps.values())) == len(helps)
    assert "lookup" not in helps["fixed"].lower() and "auto" not in helps["dynamic"].lower()


def test_queued_steps_are_kept_and_export_is_cleared_on_restart():
    fns = list(app.demo.fns.values())
    step = next(fn for fn in fns if fn.name == "on_step")
    assert step.trigger_mode == "multiple"  # Step clicks during a step are queued, not dropped
    clears = [fn for fn in fns if fn.name == "_clear_trace"]
    assert len(clears) == 2 and all(fn.outputs[0].elem_id == "trace-file" for fn in clears)
    status = next(b for b in app.demo.blocks.values() if getattr(b, "elem_id", None) == "status")
    assert status.label != "status"  # Gradio's i18n has a "status" group: the console warned about it


def _lookup_step_record() -> StepRecord:
    chain = CandidateTree(paths=[(32,), (32, 32)], scores=[0.5, 0.4], kind="dynamic")
    outcome = TreeOutcome(tree=chain, node_tokens=[1, 2, 3], node_scores=[1.0, 0.5, 0.4], accepted_nodes=[0, 1],
                          bonus_token=4, node_texts=["a", "b", "c"], bonus_text="d", lookup_rank=32)
    return StepRecord(index=4, family=DYNAMIC, kind=StepKind.CHAINS, context_length=30, head_token_ids=[], head_probs=[],
                      outcome=outcome, new_tokens=[2, 4], times=PhaseTimes(verify=0.01))


def _facts(settings: labstate.Settings) -> RunFacts:
    return RunFacts(prompt="", spec=settings.spec, settings=settings.raw(), records=[], output_ids=[1], first_text="",
                    text="", token_bytes={}, stats=RunStats())


def test_comparison_and_tree_notes_say_what_happened():
    facts = _facts(labstate.parse_settings({**SETTINGS, "strategy": labstate.LOOKUP_STRATEGY}))
    figure = view_module._comparison(facts, _lookup_step_record())
    message = figure.layout.annotations[0].text.replace("<br>", " ")
    assert "skipped the heads" in message and "step 5" in message and "dynamic strategy" not in message
    shallow = StepRecord(index=0, family=DYNAMIC, kind=StepKind.TREE, context_length=9, head_token_ids=[], head_probs=[],
                         outcome=TreeOutcome(tree=fixed_tree([[0], [0, 0], [0, 0, 0]]), node_tokens=[1, 2, 3, 4],
                                             node_scores=[1.0, 0.5, 0.2, 0.1], accepted_nodes=[0], bonus_token=5),
                         new_tokens=[5], times=PhaseTimes())
    assert "deepest node at depth 3 of 4 allowed" in view_module._depth_note(facts, shallow)
    sampled = _facts(labstate.parse_settings({**SETTINGS, "rule": "speculative", "temperature": 0.7}))
    assert "residual" in view_module._bonus_note(sampled) and view_module._bonus_note(facts) == ""


def test_status_and_speed_through_the_api(url):
    client = _client(url)
    view = _call(client, "start", PROMPT_B, max_new_tokens=60)
    assert view[OUT["summary"]]["state"] == "ready: press Step" and "running" not in view[OUT["stats"]]
    view = _call(client, "step", PROMPT_B, max_new_tokens=60)
    assert view[OUT["summary"]]["state"].startswith("paused after step 1")
    assert "measuring" in view[OUT["stats"]] and "× plain" not in view[OUT["stats"]]  # no estimate (issue 46)
    assert "sub wins" not in view[OUT["stats"]] and "sub loses" not in view[OUT["stats"]]  # no verdict yet
    assert view[OUT["summary"]]["vs_plain_basis"].startswith("measuring")
    assert "depth 1" in view[OUT["verify"]] or "root alone" in view[OUT["verify"]]
    job = client.submit(PROMPT_B, **{**SETTINGS, "max_new_tokens": 60}, api_name="/run")
    deadline = time.time() + 120
    while len(job.outputs()) < 2 and time.time() < deadline:
        time.sleep(0.2)
    stopped = client.predict(api_name="/stop")  # waits for the step in flight, then draws the run as it is
    steps = stopped[OUT["summary"]]["steps"]
    assert stopped[OUT["summary"]]["state"] == f"stopped after step {steps}"
    time.sleep(2.0)
    later = client.predict(step_index=steps, api_name="/view")
    assert later[OUT["summary"]]["steps"] == steps  # nothing ran after Stop
    checked = client.predict(api_name="/check")
    assert checked[OUT["summary"]]["steps"] == steps and checked[OUT["summary"]]["vs_plain_basis"] == \
        "measured plain run"


def test_the_server_measures_what_a_first_start_needs_after_it_is_up(monkeypatch):
    """Issue 46: the verify-cost profile is measured on a background thread once the server answers,
    never on a Start's request path (a Start that comes first waits for the rest of it)."""
    import threading

    import gradio as gr

    events: list = []
    measured = threading.Event()

    def warm_up(precision: str, tree: bool, notify, wait: bool = False) -> None:
        events.append(("warm-up", precision, tree, wait, threading.current_thread().name))
        measured.set()

    monkeypatch.setattr(app, "REPLAY_ONLY", False)
    monkeypatch.setattr(app, "demo", app.demo)
    monkeypatch.setattr(app.labstate, "runtime", lambda precision: events.append("model loaded"))
    monkeypatch.setattr(app.labstate, "machine_precision", lambda: "fp32")
    monkeypatch.setattr(app.labstate, "warm_up", warm_up)
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **options: events.append("serving"))
    monkeypatch.setattr(gr.Blocks, "block_thread", lambda self: measured.wait(10))
    app.main(["--port", "7998"])
    assert events == ["model loaded", "serving", ("warm-up", "fp32", True, True, "warm-up")]


def test_a_zero_gpu_start_decodes_the_whole_run_and_the_page_replays_it(plain_greedy):
    """Issue 46 (ZeroGPU): where a GPU lives for one call only, Start decodes the whole run in that call
    (`labstate.gpu_call`, a no-op off ZeroGPU) and the page shows it as a recording: the decoded text is
    plain greedy decoding's, the replay opens on step 1, its Step goes on, and no live stepping is wired."""
    demo = app.build_demo(record_on_start=True)
    names = {fn.api_name for fn in demo.fns.values() if fn.api_name}
    assert "start" in names and not names & {"step", "run", "stop", "check", "reset"}
    with _serving(demo) as served:
        view = _call(_client(served), "start", PROMPT_A)
    status = view[OUT["status"]]
    assert "Replay of a recorded run" in status and "Decoded the whole run in one GPU call" in status
    assert "1 step(s)" in status and "This recording's settings" in view[OUT["recording"]]["value"]
    expected = labstate.runtime("fp32").base.decode(plain_greedy(PROMPT_A))
    assert expected.startswith(view[OUT["plain_text"]])  # the text so far: step 1 of the recording
    state, *_ = app.on_record(PROMPT_A, **SETTINGS)  # the handler itself: its replay state, taken to the end
    assert replay_module.replay_facts(replay_module.to_end(state)).text == expected


def test_the_whole_run_recorder_is_the_function_itself_off_zero_gpu(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert not labstate.on_zero_gpu() and labstate.gpu_call(labstate.record_run) is labstate.record_run
    monkeypatch.setattr(settings, "SETTINGS", dataclasses.replace(settings.SETTINGS, record_on_start=True))
    assert labstate.records_on_start() and not labstate.on_zero_gpu()


def test_the_queue_does_not_poll_every_millisecond():
    """Issue 46: Gradio's queue looks for work every 1 ms (and for progress every 10 ms) on Linux; each
    wake-up took a core from the decoding's two OpenMP threads on a 2-core machine (served steps 1.2x
    a plain process's). The lab's queue polls every QUEUE_POLL_S and PROGRESS_POLL_S instead."""
    queue = app.build_demo()._queue
    assert queue.sleep_when_free >= app.QUEUE_POLL_S >= 0.01
    assert queue.progress_update_sleep_when_free >= app.PROGRESS_POLL_S


def test_a_browser_on_this_machine_is_waited_for_until_it_has_drawn_each_redraw(monkeypatch):
    """Issue 46: where the decoding takes every core, a browser on the same machine drew each Run-to-end
    redraw inside the next steps, and the steps' clock charged it to decoding. The run waits until the
    page says it has drawn the redraw (its number; an older number does not count; Stop ends the wait),
    at most app.DRAW_WAIT_S, and counts the wait as the page's time; a browser elsewhere and API clients are
    never waited for."""
    from types import SimpleNamespace

    def request(host: str, user: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(client=SimpleNamespace(host=host), headers={"x-gradio-user": user} if user else {},
                               url=f"http://{host}:7860/gradio_api/queue/join")

    assert server.browser_on_this_machine(request("127.0.0.1"))
    assert server.browser_on_this_machine(request("::1"))
    assert not server.browser_on_this_machine(request("10.0.0.7"))  # a classroom's laptops, a Space's visitors
    assert not server.browser_on_this_machine(request("127.0.0.1", user="api"))  # gradio_client draws nothing
    assert not server.browser_on_this_machine(None)
    lab = labstate.LabState()
    lab.run = SimpleNamespace(page_seconds=[], draws_awaited=[], mode="running")
    number = lab.expect_drawing()  # 600 s: never reached, each wait below ends on a word or on Stop
    waiter = threading.Thread(target=server.wait_for_the_browser, args=(lab, 600.0))
    started = time.perf_counter()
    waiter.start()
    lab.mark_drawn(number - 1)  # an older redraw's word does not end the wait
    waiter.join(0.3)
    assert waiter.is_alive() and lab.run.draws_awaited == []
    lab.mark_drawn(number)
    waiter.join(60)
    waited = time.perf_counter() - started
    assert not waiter.is_alive() and lab.run.draws_awaited == [True]
    assert 0 < lab.run.page_seconds[0] <= waited  # the wait is counted as the page's time

    lab.expect_drawing()  # a page that never says so: the run goes on after the wait
    server.wait_for_the_browser(lab, 0.05)
    assert lab.run.draws_awaited == [True, False] and lab.run.page_seconds[-1] >= 0.05

    lab.expect_drawing()  # Stop while waiting: the loop goes on at once, to stop
    waiter = threading.Thread(target=server.wait_for_the_browser, args=(lab, 600.0))
    waiter.start()
    lab.stop()
    waiter.join(60)
    assert not waiter.is_alive() and lab.run.page_seconds[-1] < 60


def test_the_pages_word_that_it_drew_reaches_its_own_sessions_run_only():
    """`on_drawn` (the page's hidden button) releases the wait of the clicking tab's run for the redraw
    number it names; another tab's, an unknown or expired session's, or a missing number do nothing."""
    from types import SimpleNamespace

    key, other = f"drawn-{time.time_ns()}", f"drawn-other-{time.time_ns()}"
    lab, other_lab = app.SESSIONS.open(key), app.SESSIONS.open(other)
    try:
        number, other_number = lab.expect_drawing(), other_lab.expect_drawing()
        app.on_drawn(None, request=SimpleNamespace(session_hash=key))
        app.on_drawn(float(number), request=SimpleNamespace(session_hash="never-seen"))
        assert not lab.wait_drawn(0) and not other_lab.wait_drawn(0)
        app.on_drawn(float(number), request=SimpleNamespace(session_hash=key))
        assert lab.wait_drawn(0) and not other_lab.wait_drawn(0)
    finally:
        app.SESSIONS.drop(key)
        app.SESSIONS.drop(other)


def test_the_lecture_preset_shows_accepted_head_paths_within_three_steps(url):
    """Issue 69: the Lecture preset fills the prompt and a fixed-size dynamic tree (the precision stays the
    page's); its first three Steps accept head guesses, so a class sees the method work at once."""
    import gradio as gr

    prompt, *values = app.on_lecture()
    preset = {name: value for name, value in zip(labstate.SETTING_NAMES, values) if not isinstance(value, type(gr.skip()))}
    assert prompt == labstate.LECTURE_PROMPT and "precision" not in preset and preset["strategy"] == "dynamic"
    client = _client(url)
    settings = {**preset, "precision": labstate.Settings().precision}
    for _ in range(3):
        _call(client, "step", prompt, **settings)
    records = app.SESSIONS.get(client.session_hash).run.session.records
    head_tokens = [sum(1 for n in r.outcome.accepted_nodes[1:] if r.outcome.node_source(n) == "heads") for r in records]
    assert len(records) == 3 and sum(head_tokens) >= 2, head_tokens
