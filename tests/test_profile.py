"""Adaptive budget: the choice is the arg-max of expected tokens per ms; the profile is cached."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import core.budget.cost_profile as profile_module
from core.decoder import DecodeConfig, decode
from core.budget.cost_profile import CostProfile, DepthCalibration, best_prefix, verify_profile
from core.records import StepKind
from tests.tiny import tiny_base

FLAT = CostProfile(sizes=[1, 128], ms=[20.0, 20.0])
STEEP = CostProfile(sizes=[1, 2, 4, 8, 16, 32, 64], ms=[40, 64, 60, 59, 73, 91, 147])


def brute_force(scores, profile, overhead):
    rates = [(1 + sum(scores[:n])) / (profile.cost(n + 1) + overhead) for n in range(len(scores) + 1)]
    return max(range(len(rates)), key=lambda n: (rates[n], -n))


@pytest.mark.parametrize("profile", [FLAT, STEEP])
@pytest.mark.parametrize("scores", [[0.9, 0.5, 0.2, 0.1, 0.05, 0.01], [0.01] * 40, [0.6] * 10 + [0.001] * 50])
def test_best_prefix_is_the_argmax(profile, scores):
    depths = [1] * len(scores)
    assert best_prefix(scores, depths, profile, 2.0)[0] == brute_force(scores, profile, 2.0)


def test_flat_cost_takes_everything_and_steep_cost_falls_back():
    scores = [0.3] * 63
    assert best_prefix(scores, [1] * 63, FLAT, 1.0)[0] == 63
    assert best_prefix([0.01] * 63, [1] * 63, STEEP, 1.0)[0] == 0  # speculation cannot pay: root only


def test_cost_interpolates_and_extrapolates():
    assert STEEP.cost(1) == 40 and STEEP.cost(3) == pytest.approx(62)
    assert STEEP.cost(128) > STEEP.cost(64)


def test_calibration_scales_overconfident_depths():
    calibration = DepthCalibration()
    for _ in range(50):  # depth-2 nodes predicted at 0.8 but never accepted
        calibration.update([1, 2], [0.9, 0.8], accepted_depth=1)
    assert calibration.factor(1) > 0.9 and calibration.factor(2) < 0.1


def test_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(profile_module, "measured_quietly", lambda *ms: True)
    base_fp32 = tiny_base("llama")
    verify_profile.cache_clear()
    profile = verify_profile(base_fp32, tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["sizes"] == profile.sizes
    assert all(a <= b for a, b in zip(profile.ms, profile.ms[1:])) and profile.ms[0] > 0
    verify_profile.cache_clear()
    assert verify_profile(base_fp32, tmp_path) == profile  # read back, not re-measured
    verify_profile.cache_clear()


def test_a_busy_measurement_is_used_but_never_cached(tmp_path, monkeypatch):
    """One-token costs before and after the profile disagree (something else ran): not kept."""
    times = iter([[10.0], [19.0]])
    monkeypatch.setattr(profile_module, "_measure_row", lambda *args, **kwargs: next(times))
    monkeypatch.setattr(profile_module, "measure_profile", lambda base, **how: CostProfile(sizes=[1, 2], ms=[12.0, 14.0]))
    profile = profile_module._load_or_measure(tiny_base("llama"), tmp_path)
    assert profile.ms == [12.0, 14.0] and not list(tmp_path.glob("*.json"))
    assert profile_module.measured_quietly(10.0, 11.0, 10.5) and not profile_module.measured_quietly(10.0, 19.0)


def test_profile_key_knows_the_machine_and_the_software(monkeypatch):
    base = tiny_base("llama")
    first = profile_module.profile_key(base)
    changes = {"cpu_fingerprint": lambda: "Other CPU|avx512_bf16", "_verify_code_hash": lambda: "0123456789ab"}
    for name, replacement in changes.items():
        with monkeypatch.context() as patch:
            patch.setattr(profile_module, name, replacement)
            assert profile_module.profile_key(base).digest() != first.digest(), name
    with monkeypatch.context() as patch:
        patch.setattr(profile_module.transformers, "__version__", "0.0.1")
        assert profile_module.profile_key(base).digest() != first.digest()
    with monkeypatch.context() as patch:
        patch.setattr(profile_module.torch, "get_num_threads", lambda: 64)
        assert profile_module.profile_key(base).digest() != first.digest()
    assert profile_module.profile_key(base) == first  # and it is stable


def test_auto_budget_stays_lossless(base_fp32, shipped_heads, mt_bench_prompts):
    for prompt in mt_bench_prompts[20:22]:
        plain = decode(base_fp32, None, prompt, DecodeConfig(spec="ar", max_new_tokens=32))
        for profile in (FLAT, STEEP):
            auto = decode(base_fp32, shipped_heads, prompt,
                          DecodeConfig(spec="dynamic:auto", max_new_tokens=32), profile=profile)
            assert auto.output_ids == plain.output_ids


def test_auto_falls_back_to_plain_steps_when_speculation_cannot_pay(base_fp32, shipped_heads, mt_bench_prompts):
    """A verify that costs 20x a single token: the session runs plain steps and stays lossless (the loss
    allowance sees that no tree could fit it and never pays for drafting at all)."""
    hopeless = CostProfile(sizes=[1, 2, 128], ms=[40.0, 800.0, 1000.0])
    prompt = mt_bench_prompts[3]
    plain = decode(base_fp32, None, prompt, DecodeConfig(spec="ar", max_new_tokens=24))
    auto = decode(base_fp32, shipped_heads, prompt, DecodeConfig(spec="dynamic:auto", max_new_tokens=24), profile=hopeless)
    kinds = [r.kind for r in auto.records]
    assert auto.output_ids == plain.output_ids
    assert kinds == [StepKind.PLAIN] * len(kinds)
    assert {r.controller for r in auto.records} <= {"backing off", "probing"}
    assert auto.records[0].controller == "backing off"  # the budget, not a probe, kept it plain


ascending_sizes = st.lists(st.integers(1, 200), min_size=1, max_size=8, unique=True).map(sorted)


@settings(max_examples=150, deadline=None)
@given(sizes=ascending_sizes, data=st.data())
def test_costs_are_each_cost_bitwise(sizes, data):
    """The costs of every size at once (what a step's choice reads) are `cost`'s own numbers, in and
    between profiled sizes and contexts, below them and extended past them."""
    ms_value = st.floats(0.5, 500.0, allow_nan=False)
    ms = data.draw(st.lists(ms_value, min_size=len(sizes), max_size=len(sizes)))
    contexts = data.draw(st.lists(st.integers(1, 3000), min_size=1, max_size=4, unique=True).map(sorted))
    rows = data.draw(st.lists(st.lists(ms_value, min_size=len(sizes), max_size=len(sizes)),
                              min_size=len(contexts) - 1, max_size=len(contexts) - 1))
    profile = CostProfile(sizes=sizes, ms=ms, contexts=contexts, ms_by_context=rows)
    count = data.draw(st.integers(1, 260))
    for context in (None, 0, *contexts, contexts[-1] + 700, data.draw(st.integers(0, 4000))):
        assert profile.costs(count, context) == [profile.cost(n, context) for n in range(1, count + 1)]
    assert profile.costs(count) == [one_point(sizes, ms, n) for n in range(1, count + 1)]


def one_point(xs, ys, x):
    """Piecewise-linear y(x), extended by the last slope, by a search of every segment (the reference)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


def test_cost_knows_the_context():
    profile = CostProfile(sizes=[1, 64], ms=[20.0, 40.0], contexts=[100, 1500], ms_by_context=[[34.0, 82.0]])
    assert profile.cost(1) == 20.0 and profile.cost(1, context=100) == 20.0
    assert profile.cost(1, context=1500) == 34.0
    assert profile.cost(64, context=800) == pytest.approx(61.0)  # halfway in context: (40 + 82) / 2
    assert profile.cost(32, context=50) == profile.cost(32)  # shorter than profiled: the first row
    assert profile.cost(64, context=2900) == pytest.approx(124.0)  # extended by the last slope
    # a long context makes a big tree relatively cheaper or dearer: the choice follows the cost
    scores = [0.5] * 8 + [0.05] * 56
    short = best_prefix(scores, [1] * 64, profile, 1.0, context=100)
    long = best_prefix(scores, [1] * 64, profile, 1.0, context=1500)
    assert short[1] > long[1]  # fewer tokens per ms over the longer context
