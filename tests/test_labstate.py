"""labstate on its own (quick subset): settings, the session registry on an injected clock, and a run's
whole lifecycle on a tiny model standing in for the shipped one."""
from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import tracemalloc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import labstate
from core.budget.cost_profile import CostProfile
from core.records import StepKind
from labstate.runs import decode_config
from labstate.shared import Runtime
from labstate.trace import load_trace
from tests.fakes import FakeClock
from tests.tiny import greedy_reference, tiny_base, tiny_heads
from viz.view import PROGRESS_FIELDS, build_progress, build_view

PROMPT = "abcabcabcabc, and then?"


# -- settings -------------------------------------------------------------------------------------------
def test_settings_round_trip_through_their_raw_values():
    for strategy in labstate.ui_strategies():
        settings = labstate.parse_settings({"strategy": strategy, "budget": 20, "precision": "fp32"})
        assert labstate.parse_settings(settings.raw()) == settings
    custom = labstate.parse_settings({"fixed_preset": "custom", "custom_tree": "[[0], [1], [0, 0]]", "precision": "fp32"})
    assert custom.custom_tree == ((0,), (1,), (0, 0)) and labstate.parse_settings(custom.raw()) == custom


@pytest.mark.parametrize("values, message", [
    ({"colour": "red"}, "unknown setting: colour"), ({"budget": 0}, "between 1 and 256"),
    ({"strategy": "dynamic:40"}, "node budget is its own setting"), ({"temperature": 0.5}, "greedy rule"),
    ({"fixed_preset": "custom", "custom_tree": "[[1, 0]]"}, "no parent"), ({"precision": "fp8"}, "fp32, bf16"),
])
def test_bad_settings_say_what_is_wrong(values, message):
    with pytest.raises(labstate.LabInputError, match=message):
        labstate.parse_settings({"precision": "fp32", **values})


def test_a_custom_tree_nothing_reads_never_blocks_start():
    """Under a dynamic strategy without the comparison the custom box is read by nothing: a broken tree
    there is ignored; with the comparison (or the fixed strategy) it is checked and the error says why."""
    broken = {"fixed_preset": "custom", "custom_tree": "[[1, 0]]", "precision": "fp32"}
    unused = labstate.parse_settings({**broken, "strategy": "dynamic", "compare_fixed": False})
    assert not unused.uses_fixed_tree and unused.custom_tree == ()
    config, note = decode_config(unused, max_depth=4)
    assert note == "" and config.fixed_tree == "mc_sim_7b_63"  # the default, never read (no comparison)
    with pytest.raises(labstate.LabInputError, match=r"no parent .*untick the comparison"):
        labstate.parse_settings({**broken, "strategy": "dynamic", "compare_fixed": True})
    with pytest.raises(labstate.LabInputError, match=r"no parent \[1\] in the tree$"):
        labstate.parse_settings({**broken, "strategy": "fixed", "compare_fixed": False})
    cut = labstate.parse_settings({"strategy": "dynamic", "compare_fixed": True, "depth": 1, "precision": "fp32"})
    assert decode_config(cut, max_depth=4)[1].startswith("the comparison's fixed tree")
    assert decode_config(dataclasses.replace(cut, compare_fixed=False), max_depth=4)[1] == ""  # nothing is cut


# -- the session registry -------------------------------------------------------------------------------
def test_registry_expires_idle_sessions_evicts_the_least_recent_and_says_so():
    clock = FakeClock()
    registry = labstate.SessionRegistry(max_sessions=2, idle_seconds=100, clock=clock)
    first, second = registry.open("a"), registry.open("b")
    clock.now = 10
    assert registry.get("a") is first  # touched: "b" is now the least recent
    with second.working():
        registry.open("c")  # full: "b" is busy, so the least recent idle one ("a") goes
    assert "a" not in registry and "b" in registry and "c" in registry
    assert registry.keys() == ["b", "c"]  # least recently used first
    with pytest.raises(labstate.SessionExpired):
        registry.get("a")
    clock.now = 200
    with pytest.raises(labstate.SessionExpired):
        registry.get("b")  # idle too long
    assert registry.get("never") is None


# -- a run's lifecycle on a tiny model ----------------------------------------------------------------------
def medusa_runtime(base) -> Runtime:
    """A runtime whose only drafter weights are tiny Medusa heads (fixed and dynamic trees)."""
    heads = tiny_heads(base)
    return Runtime(base=base, weights={"medusa": heads}, heads_description="tiny heads")


@pytest.fixture()
def tiny_runtime(monkeypatch):
    base = tiny_base("llama", max_positions=2048)  # the lab keeps room for 1024 new tokens and a 256-node tree
    rt = medusa_runtime(base)
    monkeypatch.setattr(labstate.runs, "runtime", lambda precision: rt)
    monkeypatch.setitem(labstate.shared.MODELS.profiles, base.config.dtype,
                        CostProfile(sizes=[1, 16, 64], ms=[10.0, 12.0, 30.0], device="cpu", model="tiny"))
    return rt


@pytest.mark.parametrize("cached_on_disk, said", [(True, []), (False, ["Measuring what a tree verify costs"])])
def test_a_first_start_says_what_it_measures_and_nothing_it_only_reads(monkeypatch, cached_on_disk, said):
    import labstate.shared as shared
    base = tiny_base("llama")
    rt = medusa_runtime(base)
    monkeypatch.setattr(shared, "MODELS", shared.SharedModels(runtimes={"fp32": rt}))  # loaded: nothing to say
    monkeypatch.setattr(shared, "profile_cached", lambda base: cached_on_disk)
    monkeypatch.setattr(shared, "verify_profile", lambda base, **how: CostProfile(sizes=[1, 16], ms=[10.0, 12.0],
                                                                                  device="cpu", model="tiny"))
    messages: list[str] = []
    shared.warm_up("fp32", tree=True, notify=messages.append)
    assert [m[:len(p)] for m, p in zip(messages, said)] == said and len(messages) == len(said)
    if not cached_on_disk:  # measured on its own thread: a Start never waits for it
        shared.MODELS.measuring[base.config.dtype].join(10)
    shared.cost_profile(rt)
    assert base.config.dtype in shared.MODELS.profiles


@pytest.mark.parametrize("cached_on_disk", [True, False])
def test_a_profile_read_from_disk_warms_every_tree_size_before_a_user_step(monkeypatch, cached_on_disk):
    """Issue 46: a process that reads its profile from disk has never verified a tree, and its first
    tree verify was 3x the benchmark's (in the user's first tree step): one verify of each size the page
    uses runs with the profile. A profile measured in this process ran them all already."""
    import core.budget.cost_profile as cost_profile
    import labstate.shared as shared
    base = tiny_base("llama", max_positions=2048)
    rt = medusa_runtime(base)
    profile = CostProfile(sizes=[1, 16], ms=[10.0, 12.0], device="cpu", model="tiny")
    monkeypatch.setattr(shared, "MODELS", shared.SharedModels())
    monkeypatch.setattr(shared, "profile_cached", lambda base: cached_on_disk)
    monkeypatch.setattr(shared, "verify_profile", lambda base, **how: profile)
    verified_rows: list[int] = []
    real_verify = cost_profile.verify_tree

    def counted_verify(base, cache, tokens, *args, **kwargs):
        verified_rows.append(len(tokens))
        return real_verify(base, cache, tokens, *args, **kwargs)

    monkeypatch.setattr(cost_profile, "verify_tree", counted_verify)
    assert shared.MODELS._measure_profile(rt) is profile
    assert verified_rows == (list(cost_profile.WARM_SIZES) if cached_on_disk else [])
    assert max(cost_profile.WARM_SIZES) >= 64 and min(cost_profile.WARM_SIZES) <= 2


def test_a_first_start_draws_a_tree_while_the_profile_is_still_being_measured(monkeypatch):
    """Issue 46: the verify-cost profile never blocks a Start: while it is measured (held here until
    the run has stepped), an auto-budget run starts on a provisional profile and steps a tree; the
    measured profile lands afterwards and later runs use it."""
    import threading

    import labstate.shared as shared
    base = tiny_base("llama", max_positions=2048)  # room for the lab's token and tree limits
    rt = medusa_runtime(base)
    monkeypatch.setattr(shared, "MODELS", shared.SharedModels(runtimes={"fp32": rt}))
    monkeypatch.setattr(labstate.runs, "runtime", lambda precision: rt)
    monkeypatch.setattr(shared, "profile_cached", lambda base: False)
    release, measured = threading.Event(), CostProfile(sizes=[1, 16, 64], ms=[10.0, 12.0, 30.0], device="cpu",
                                                       model="tiny")

    def slow_measurement(base, **how) -> CostProfile:
        assert release.wait(60), "the run never stepped while the profile was being measured"
        return measured

    monkeypatch.setattr(shared, "verify_profile", slow_measurement)
    messages: list[str] = []
    shared.warm_up("fp32", tree=True, notify=messages.append)
    assert messages and "in the background" in messages[0]
    lab = labstate.LabState()
    settings = labstate.parse_settings({**SETTINGS, "strategy": "dynamic:auto", "budget": 12})
    run = labstate.start_run(lab, PROMPT, settings)
    assert "provisional" in run.session.controller.profile.model
    drawn = [labstate.step_run(lab, run) for _ in range(3)]
    assert shared.MODELS.measuring["fp32"].is_alive() and "fp32" not in shared.MODELS.profiles  # still measuring
    assert any(record.proposal is not None or record.outcome.tree.num_nodes for record in drawn)
    release.set()
    shared.MODELS.measuring["fp32"].join(10)
    assert shared.cost_profile(rt, wait=False) is measured


class OperatorsOnThisThread(TorchDispatchMode):
    """Counts the tensor operators run on the thread that entered it (dispatch modes are per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_the_page_runs_every_tensor_operator_on_the_tensor_thread(monkeypatch, tmp_path):
    """Issue 46: an operator run on another thread than the tensor thread gives the process a second
    OpenMP team, and every operator after it pays a wake-up (a plain gguf-q8 step 4.7 -> 9.7 ms on a
    2-core EPYC once the profile had zeroed its caches on the measuring thread). Measuring the profile,
    reading it back (the warm verifies), Start, Step and Run to end leave no operator on the caller's."""
    import core.budget.cost_profile as cost_profile
    import labstate.shared as shared
    from core.tensor_thread import run_on_tensor_thread

    def load() -> Runtime:  # as `load_base_model` loads: the forward built at load, on the tensor thread
        base = tiny_base("llama", max_positions=2048)
        _ = base.engine
        return medusa_runtime(base)

    rt = run_on_tensor_thread(load)
    monkeypatch.setattr(shared, "MODELS", shared.SharedModels(runtimes={"fp32": rt}))
    monkeypatch.setattr(labstate.runs, "runtime", lambda precision: rt)
    monkeypatch.setattr(cost_profile, "measured_quietly", lambda *ms: True)
    measured_in = tmp_path / "profiles"
    monkeypatch.setattr(shared, "profile_cached", lambda base: cost_profile.profile_cached(base, measured_in))
    monkeypatch.setattr(shared, "verify_profile",
                        lambda base, run: cost_profile.verify_profile.__wrapped__(base, measured_in, run))
    settings = labstate.parse_settings({**SETTINGS, "strategy": "dynamic:auto+lookup"})
    lab = labstate.LabState()
    with OperatorsOnThisThread() as operators:
        shared.warm_up("fp32", tree=True, notify=lambda message: None, wait=True)  # measured, then written
        shared.MODELS.profiles.clear()
        shared.warm_up("fp32", tree=True, notify=lambda message: None, wait=True)  # read back, then warmed
        labstate.start_fresh(lab, PROMPT, settings)
        labstate.step_once(lab, PROMPT, settings)
        list(labstate.run_to_end(lab, PROMPT, settings, alive=lambda: True))
    assert lab.run.session.finished and list(measured_in.glob("*.json"))
    assert operators.seen == {}


SETTINGS = {"strategy": "dynamic", "budget": 12, "top_m": 8, "precision": "fp32", "max_new_tokens": 20,
            "compare_fixed": True}


def test_start_step_run_stop_reset_on_a_tiny_model(tiny_runtime):
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    assert labstate.start_fresh(lab, PROMPT, settings) == "" and lab.run.state == "ready: press Step"
    assert labstate.step_once(lab, PROMPT, settings) == "" and len(lab.run.session.records) == 1
    other = labstate.parse_settings({**SETTINGS, "budget": 5})
    assert "press **Start** to apply" in labstate.step_once(lab, PROMPT, other)
    messages = list(labstate.run_to_end(lab, PROMPT, settings, alive=lambda: True))
    assert messages and lab.run.session.finished
    prompt_ids = tiny_runtime.base.chat_ids(PROMPT)
    assert lab.run.session.output_ids == greedy_reference(tiny_runtime.base, prompt_ids, 20)
    assert labstate.greedy_check(lab, lab.run).state == "ok"  # run_to_end ran the check
    with pytest.raises(labstate.LabNotice, match="finished"):
        labstate.step_once(lab, PROMPT, settings)
    facts = labstate.facts_of(lab, lab.run)
    assert build_view(facts).summary["output_ids"] == lab.run.session.output_ids
    whole, progress = build_view(facts, message="running"), build_progress(facts, message="running")
    assert all(getattr(progress, name) == getattr(whole, name) for name in PROGRESS_FIELDS)  # the same, unfigured
    assert load_trace(labstate.run_trace(lab)).facts.output_ids == facts.output_ids
    verdict = labstate.check_now(lab)  # Check says its result in words (the page shows it where the eye is)
    assert verdict.startswith("Compared with a plain greedy run of this prompt: identical")
    assert labstate.stop(lab).startswith("Stopped") and lab.run.mode == labstate.STOPPED
    labstate.reset(lab)
    assert lab.run is None and labstate.stop(lab) == "Nothing to stop."
    with pytest.raises(labstate.LabNotice, match="Nothing to check"):
        labstate.check_now(lab)


def test_step_on_a_paused_run_never_reads_the_prompt_box(tiny_runtime):
    """The run goes on with its own prompt: an emptied prompt box says Start would apply it, and
    never refuses the Step; bad new settings are still refused (they would be applied next Start)."""
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    labstate.start_fresh(lab, PROMPT, settings)
    assert "press **Start** to apply" in labstate.step_once(lab, "", settings)
    assert "press **Start** to apply" in labstate.step_once(lab, "   ", settings)
    assert len(lab.run.session.records) == 2 and lab.run.prompt == PROMPT
    too_deep = labstate.parse_settings({**SETTINGS, "depth": 5})  # the tiny runtime has 4 heads
    with pytest.raises(labstate.LabInputError, match="exceeds the 4 heads"):
        labstate.step_once(lab, "", too_deep)


def test_a_run_that_loses_its_session_says_so(tiny_runtime):
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    loop = labstate.run_to_end(lab, PROMPT, settings, alive=iter([True, False]).__next__)
    next(loop)
    with pytest.raises(labstate.SessionExpired, match="expired while running"):
        next(loop)
    assert lab.run.mode == labstate.PAUSED and not lab.run.session.finished


def test_a_step_or_run_clicked_before_stop_never_steps_even_when_its_turn_comes_after(tiny_runtime):
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    labstate.step_once(lab, PROMPT, settings, clicked_at=1000.0)
    assert labstate.stop(lab, clicked_at=2000.0).startswith("Stopped")
    # the race the epoch cannot see: clicked at 1999 ms, started only after Stop bumped the epoch
    assert labstate.step_once(lab, PROMPT, settings, clicked_at=1999.0) == labstate.DROPPED_STEP
    assert list(labstate.run_to_end(lab, PROMPT, settings, alive=lambda: True, clicked_at=1500.0)) == [
        "Stopped: a Run clicked before Stop was dropped."]
    assert len(lab.run.session.records) == 1 and lab.run.state == "stopped after step 1"
    assert labstate.step_once(lab, PROMPT, settings, clicked_at=2001.0) == ""  # clicked after Stop: it steps
    assert len(lab.run.session.records) == 2 and lab.run.state == "paused after step 2: press Step"
    assert labstate.step_once(lab, PROMPT, settings) == ""  # the API sends no click time: the epoch rule alone
    labstate.stop(lab)  # a Stop without a click time keeps the last one
    assert lab.stop_clicked_at == 2000.0


def test_a_stop_during_the_step_in_flight_leaves_the_run_stopped_not_paused(tiny_runtime):
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    labstate.step_once(lab, PROMPT, settings)
    session, step = lab.run.session, lab.run.session.step

    def step_while_stop_arrives():
        record = step()
        lab.stop(clicked_at=5.0)  # Stop lands while this step computes (it holds the lock; Stop does not wait)
        return record
    session.step = step_while_stop_arrives
    assert labstate.step_once(lab, PROMPT, settings) == ""
    assert len(session.records) == 2 and lab.run.state == "stopped after step 2"  # the step counts; it stays stopped
    session.step = step
    lab.run.mode = labstate.RUNNING  # a Run loop drives the run: a Step beside it keeps it running
    labstate.step_once(lab, PROMPT, settings)
    assert len(session.records) == 3 and lab.run.state == "running"


def test_the_prefill_and_every_step_run_on_the_tensor_thread(tiny_runtime, monkeypatch):
    """Gradio calls from a pool of threads; a forward on a second thread opened a second OpenMP team
    and made every forward of the process slower (core.tensor_thread)."""
    import core.decoder
    from core.tensor_thread import THREAD_NAME
    seen = []
    original_step, original_prefill = core.decoder.DecodeSession.step, core.decoder.DecodeSession._prefill

    def step(session):
        seen.append(("step", threading.current_thread().name))
        return original_step(session)

    def prefill(session):
        seen.append(("prefill", threading.current_thread().name))
        return original_prefill(session)

    monkeypatch.setattr(core.decoder.DecodeSession, "step", step)
    monkeypatch.setattr(core.decoder.DecodeSession, "_prefill", prefill)
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    caller = threading.Thread(target=lambda: labstate.step_once(lab, PROMPT, settings))
    caller.start()
    caller.join()
    labstate.step_once(lab, PROMPT, settings)
    assert [kind for kind, _ in seen] == ["prefill", "step", "step"]
    assert all(name.startswith(THREAD_NAME) for _, name in seen)


def test_the_speed_card_says_measuring_until_plain_decoding_is_timed_then_compares_like_with_like(tiny_runtime):
    """Issue 46: no estimated ratio. A fixed-size run says "measuring" until the plain run of the
    prompt is timed; an auto run measures plain decoding on its own plain steps (the probes) once
    three ran; both rates are the steps' own decoding time (`PhaseTimes.total`)."""
    from labstate.plain import MIN_OWN_PLAIN, speed_vs_plain
    lab = labstate.LabState()
    labstate.step_once(lab, PROMPT, labstate.parse_settings(SETTINGS))
    early = speed_vs_plain(lab, lab.run)
    assert early.ratio is None and early.basis.startswith("measuring")
    auto = labstate.parse_settings({**SETTINGS, "strategy": "dynamic:auto"})
    lab = labstate.LabState()
    for _ in range(8):
        labstate.step_once(lab, PROMPT, auto)
    records = lab.run.session.records
    plain_steps = [r.times.total for r in records if r.kind == StepKind.PLAIN and r.times.tree == 0]
    assert len(plain_steps) >= MIN_OWN_PLAIN
    speed = speed_vs_plain(lab, lab.run)
    assert speed.measured and speed.basis == f"measured: {len(plain_steps)} plain steps of this run"
    emitted = len(lab.run.session.output_ids) - 1
    expected = (emitted / sum(r.times.total for r in records)) / (len(plain_steps) / sum(plain_steps))
    assert speed.ratio == pytest.approx(expected)


def test_the_speed_sentence_is_the_ratios_own_arithmetic_and_says_nothing_of_learning_once_finished(tiny_runtime):
    """Issue 69: the card's why is the arithmetic that gives its ratio (tokens a step times plain decoding's
    ms a token over the step's whole ms, drafting included), with the same numbers, and a finished run is
    not told that it "should improve as it learns"."""
    import re

    from labstate.plain import compute_check, speed_vs_plain
    auto = labstate.parse_settings({**SETTINGS, "strategy": "dynamic:auto", "max_new_tokens": 24})
    lab = labstate.LabState()
    while lab.run is None or not lab.run.session.finished:
        labstate.step_once(lab, PROMPT, auto)
    compute_check(lab, lab.run)
    speed = speed_vs_plain(lab, lab.run)
    found = re.search(r"^(wins|loses|ties): a step yields ([\d.]+) tokens in ([\d.]+) ms \(drafting ([\d.]+) \+ verify "
                      r"([\d.]+) \+ accept and commit ([\d.]+), over its (\d+) steps, (\d+) of them plain\) where plain "
                      r"decoding takes ([\d.]+) ms a token: \2 × \9 / \3 = ([\d.]+)×", speed.why)
    assert found, speed.why
    tokens, step_ms, draft, verify, rest, plain_ms, ratio = (float(found.group(i)) for i in (2, 3, 4, 5, 6, 9, 10))
    assert ratio == pytest.approx(speed.ratio, abs=0.006)
    assert tokens * plain_ms / step_ms == pytest.approx(speed.ratio, rel=0.05)  # the shown numbers add up
    assert draft + verify + rest == pytest.approx(step_ms, rel=0.02)
    assert int(found.group(7)) == len(lab.run.session.records)
    assert "learn" not in speed.why and "keeps trees small" not in speed.why


def test_a_run_with_enough_plain_steps_of_its_own_compares_with_them_before_the_plain_run(tiny_runtime):
    """Its own plain steps were timed under the same load as its tree steps (a browser drawing on the
    same cores, the page streaming); the plain run of the prompt is timed later, alone. From
    OWN_PLAIN_FIRST of them on they are the yardstick; fewer, the plain run; a step that built a tree
    and verified its root alone is not plain decoding."""
    from labstate.plain import OWN_PLAIN_FIRST, compute_check, speed_vs_plain
    auto = labstate.parse_settings({**SETTINGS, "strategy": "dynamic:auto", "max_new_tokens": 40})
    lab = labstate.LabState()
    labstate.step_once(lab, PROMPT, auto)
    compute_check(lab, lab.run)  # the plain run of the prompt, timed
    assert speed_vs_plain(lab, lab.run).basis == "measured plain run"
    while not lab.run.session.finished:
        labstate.step_once(lab, PROMPT, auto)
        plain = [r for r in lab.run.session.records if r.kind == StepKind.PLAIN and r.times.tree == 0]
        speed = speed_vs_plain(lab, lab.run)
        expected = (f"measured: {len(plain)} plain steps of this run" if len(plain) >= OWN_PLAIN_FIRST
                    else "measured plain run")
        assert speed.basis == expected
    assert len(plain) >= OWN_PLAIN_FIRST


def test_what_the_page_records_beside_a_run_follows_its_boxes():
    """The comparison box verifies the fixed tree beside the families the table draws it beside; the
    compare-heads box brings the rival family's weights (sized families only); nothing of it is in
    the DecodeConfig, which says only how the text is decoded."""
    from tests.tiny import tiny_hydra
    base = tiny_base("llama")
    hydra = tiny_hydra(base)
    rt = Runtime(base=base, weights={"medusa": tiny_heads(base), "hydra": hydra}, heads_description="tiny")
    views = labstate.page_views(labstate.parse_settings({"strategy": "dynamic", "compare_fixed": True,
                                                          "compare_heads": True, "precision": "fp32"}), rt)
    assert views.fixed and views.rival is hydra and views.texts
    views = labstate.page_views(labstate.parse_settings({"strategy": "hydra", "compare_fixed": True,
                                                          "precision": "fp32"}), rt)
    assert not views.fixed and views.rival is None  # no fixed tree over grown guesses; the box was unticked
    assert labstate.page_views(labstate.parse_settings({"strategy": "fixed", "compare_heads": True,
                                                        "precision": "fp32"}), rt).rival is None


def test_any_two_drafter_families_can_be_drawn_side_by_side():
    """Issue 45: the two-drafters view takes any pair: the run's family and any other shipped one
    ("auto" is the table's usual rival, true/false as the old check box); its own family beside itself
    draws nothing; a made-up family is refused with the choices' check."""
    from tests.tiny import tiny_eagle, tiny_hydra
    base = tiny_base("llama")
    medusa, hydra, eagle = tiny_heads(base), tiny_hydra(base), tiny_eagle(base)
    rt = Runtime(base=base, weights={"medusa": medusa, "hydra": hydra, "eagle": eagle}, heads_description="tiny")

    def rival(strategy: str, choice: object) -> object:
        settings = labstate.parse_settings({"strategy": strategy, "compare_heads": choice, "precision": "fp32"})
        return labstate.page_views(settings, rt).rival

    assert rival("dynamic", "eagle") is eagle and rival("eagle", "dynamic") is medusa
    assert rival("hydra", "eagle") is eagle and rival("eagle", "auto") is hydra and rival("dynamic", True) is hydra
    assert rival("dynamic", "dynamic") is None and rival("dynamic", "") is None and rival("dynamic", False) is None
    with pytest.raises(labstate.LabInputError, match="drawn beside"):
        labstate.parse_settings({"compare_heads": "gumiho"})
    from page import rivals
    assert tuple(value for _, value in rivals()) == labstate.rival_choices()  # the page offers exactly these


def test_time_a_step_waits_for_its_turn_is_never_decoding_time(tiny_runtime):
    """Issue 48: queued clicks (a step waiting for the one in flight) do not slow the speed card: its
    tokens/s is the emitted tokens over the steps' own decoding time."""
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    labstate.step_once(lab, PROMPT, settings)
    lab.lock.acquire()  # the step in flight holds the session
    waiting = threading.Thread(target=labstate.step_once, args=(lab, PROMPT, settings))
    waiting.start()
    threading.Event().wait(0.6)  # the queued step waits this long for its turn
    lab.lock.release()
    waiting.join(timeout=30)
    records = lab.run.session.records
    assert len(records) == 2
    decoding = sum(r.times.total for r in records)
    assert decoding < 0.6
    stats = labstate.facts_of(lab, lab.run).stats
    assert stats.tokens_per_s == pytest.approx((len(lab.run.session.output_ids) - 1) / decoding)


def _tensor_bytes() -> int:
    """Bytes of every live CPU tensor storage (each storage once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.slow
def test_three_hundred_live_steps_keep_the_server_memory_bounded(tiny_runtime):
    """A lecture's run on the server (300 live steps of a dynamic tree with the fixed comparison):
    no tensor is kept per step (the cache and weights only), and each step's record (tokens, the
    trees' nodes, texts, times) stays small (about 28 KB a step, flat tensors). A run
    ends at its token limit and sessions are capped (SessionRegistry), so the server's memory is
    bounded by those two."""
    settings = labstate.parse_settings({**SETTINGS, "max_new_tokens": 1024})
    lab = labstate.LabState()
    labstate.start_fresh(lab, PROMPT, settings)
    for _ in range(20):
        labstate.step_once(lab, PROMPT, settings)
    tensors_at_20 = _tensor_bytes()
    tracemalloc.start()
    try:
        for _ in range(280):
            labstate.step_once(lab, PROMPT, settings)
        gc.collect()
        python_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(lab.run.session.records) == 300
    assert _tensor_bytes() - tensors_at_20 < 512 * 1024
    assert python_bytes / 280 < 64 * 1024, f"{python_bytes / 280 / 1024:.0f} KB a step"


def test_the_page_time_is_shown_apart_from_decoding(tiny_runtime):
    """The time the page takes to draw a run (issue 46: node texts, figures, tables) is its time over the
    run's steps (a Run to end draws once for many steps), beside the speed and never inside tokens / s."""
    from viz.text_html import stats_html
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    labstate.start_fresh(lab, PROMPT, settings)
    labstate.step_once(lab, PROMPT, settings)
    before = labstate.facts_of(lab, lab.run).stats
    assert before.page_ms is None
    for seconds in (0.030, 0.050, 0.040):
        labstate.note_page_time(lab, seconds)
    stats = labstate.facts_of(lab, lab.run).stats
    assert stats.page_ms == pytest.approx(120.0) and stats.tokens_per_s == before.tokens_per_s
    assert "page: 120 ms a step, apart" in stats_html(stats)
    labstate.step_once(lab, PROMPT, settings)
    assert labstate.facts_of(lab, lab.run).stats.page_ms == pytest.approx(60.0)  # the same time over two steps
    labstate.note_page_time(None, 1.0)  # no run: nothing to note, no error


def test_run_to_end_in_bursts_shows_the_first_step_then_steps_back_to_back(tiny_runtime):
    """With `burst_s` Run to end yields after its first step, then after each burst of steps (run back
    to back on the tensor thread); the text is plain greedy's all the same, and a Stop during a burst
    (the epoch bumped) ends it after the step in flight."""
    settings = labstate.parse_settings(SETTINGS)
    lab = labstate.LabState()
    messages = list(labstate.run_to_end(lab, PROMPT, settings, alive=lambda: True, burst_s=3600.0))
    steps = len(lab.run.session.records)
    assert steps > 3 and len(messages) == 3  # the first step, one burst to the end, the check
    prompt_ids = tiny_runtime.base.chat_ids(PROMPT)
    assert lab.run.session.output_ids == greedy_reference(tiny_runtime.base, prompt_ids, 20)

    lab = labstate.LabState()
    labstate.start_fresh(lab, PROMPT, settings)
    session = lab.run.session
    real_step = session.step

    def step_then_stop_at_the_third():
        record = real_step()
        if len(session.records) == 3:
            lab.stop()  # what the Stop button does first, from another request
        return record

    session.step = step_then_stop_at_the_third
    list(labstate.run_to_end(lab, PROMPT, settings, alive=lambda: True, burst_s=3600.0))
    assert len(session.records) == 3 and not session.finished and lab.run.mode == labstate.STOPPED


def test_the_run_pacer_draws_the_first_progress_whatever_the_clock_reads():
    """Issue 70: the first redraw is due by construction; on a clock that starts at 0 (a machine booted a
    moment ago) a zero start would have held it back for a whole interval."""
    now = [0.0]
    pacer = labstate.RedrawPacer(3600.0, clock=lambda: now[0])
    assert pacer.due()  # the first step's progress, at clock 0
    now[0] = 3599.0
    assert not pacer.due()
    now[0] = 3600.0
    assert pacer.due() and not pacer.due()
    assert labstate.RedrawPacer(0.0, clock=lambda: 0.0).due()


def test_a_finished_run_opens_on_the_step_that_emitted_the_most_tokens(tiny_runtime):
    """Issue 69: after Run to end the page shows the step with the most accepted tokens (the first of
    them), not the run's last step, often a lone root; a run still going shows its latest."""
    lookup = labstate.parse_settings({**SETTINGS, "strategy": "dynamic:auto+lookup", "max_new_tokens": 24})
    lab = labstate.LabState()
    labstate.step_once(lab, PROMPT, lookup)
    assert labstate.most_accepted_step(lab.run) is None  # not finished
    while not lab.run.session.finished:
        labstate.step_once(lab, PROMPT, lookup)
    emitted = [len(r.new_tokens) for r in lab.run.session.records]
    assert labstate.most_accepted_step(lab.run) == emitted.index(max(emitted))
    assert labstate.most_accepted_step(None) is None


def test_a_run_loop_ended_by_stop_ends_with_stops_own_words(tiny_runtime):
    """The Run loop's last redraw and Stop's answer race to the page: when a Stop ended the loop both say
    "Stopped.", so the page says it whichever lands last; a paused or finished run keeps the loop's words."""
    settings = labstate.parse_settings({**SETTINGS, "max_new_tokens": 12})
    lab = labstate.LabState()
    labstate.step_once(lab, PROMPT, settings)
    assert labstate.run_end_message(lab, "latest") == "latest"  # paused
    assert labstate.stop(lab) == labstate.STOPPED_MESSAGE
    assert labstate.run_end_message(lab, "latest") == labstate.STOPPED_MESSAGE
    while not lab.run.session.finished:
        labstate.step_once(lab, PROMPT, settings)
    assert labstate.run_end_message(lab, "latest") == "latest"
    assert labstate.run_end_message(labstate.LabState(), "latest") == "latest"


def test_the_depth_a_run_may_ask_for_is_its_own_drafters():
    """Each family's weights say how deep they draft (Medusa's and Hydra's heads, EAGLE's deepest draft):
    an EAGLE run may go deeper than the Medusa heads' count, a fixed tree never."""
    from types import SimpleNamespace
    from core.drafters.eagle import EAGLE_DEPTH
    from core.families import MEDUSA
    from core.limits import MAX_DEPTH
    from core.strategy import parse_strategy
    from labstate.shared import Runtime
    rt = Runtime(base=None, weights={MEDUSA: SimpleNamespace(max_depth=4), "eagle": SimpleNamespace(max_depth=EAGLE_DEPTH),
                                     "hydra": None}, heads_description="")
    assert (rt.max_depth("dynamic"), rt.max_depth("eagle"), rt.fixed_depth) == (4, EAGLE_DEPTH, 4)
    assert rt.max_depth("hydra") == rt.max_depth("autoregressive") == MAX_DEPTH  # not shipped / no drafter
    deep = labstate.parse_settings({"strategy": "eagle:auto", "depth": 6, "precision": "fp32"})
    config, _ = labstate.decode_config(deep, rt.max_depth("eagle"), rt.fixed_depth)
    assert config.depth == 6
    with pytest.raises(labstate.LabInputError, match="depth 6 exceeds the 4 heads loaded"):
        labstate.decode_config(dataclasses.replace(deep, spec=parse_strategy("dynamic:auto")), rt.max_depth("dynamic"))
