"""Benchmark bookkeeping: strided prompt subsets and merging runs over disjoint prompts."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from offline.bench import BenchRow, merge_results, read_prompts, summarise


def fake_result(prompt_ids: list[str], ar_seconds: float, tree_seconds: float) -> dict:
    rows = []
    for pid in prompt_ids:
        for spec, seconds, steps in (("ar", ar_seconds, 10), ("dynamic:auto", tree_seconds, 5)):
            rows.append(BenchRow(prompt_id=pid, strategy=spec, new_tokens=10, steps=steps,
                                 mean_accepted=10 / steps, seconds=seconds, tokens_per_s=10 / seconds,
                                 phase_seconds={"verify": seconds}, output_ids=list(range(10))))
    config = {"strategies": ["ar", "dynamic:auto"], "dtype": "fp32", "max_new_tokens": 10,
              "temperature": 0.0, "rule": "greedy"}
    return {"config": config, "summary": summarise(rows, config["strategies"]), "rows": [asdict(r) for r in rows]}


def test_stride_and_offset_pick_disjoint_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": 81 + i, "turns": [f"q{i}"]}) + "\n" for i in range(8)))
    even, odd = read_prompts(path, None, 2, 0), read_prompts(path, None, 2, 1)
    assert [p.id for p in even] == ["81", "83", "85", "87"] and [p.id for p in odd] == ["82", "84", "86", "88"]
    assert [p.text for p in read_prompts(path, 2, 3, 1)] == ["q1", "q4"]


def test_merge_recomputes_the_summary_from_all_rows():
    merged = merge_results([fake_result(["1", "2"], 1.0, 0.5), fake_result(["3"], 1.0, 1.0)])
    auto = merged["summary"]["dynamic:auto"]
    assert merged["config"]["prompt_count"] == 3 and len(merged["rows"]) == 6
    assert auto["tokens_per_s"] == pytest.approx(30 / 2.0)
    assert auto["speedup_vs_ar"] == pytest.approx((30 / 2.0) / (30 / 3.0))
    with pytest.raises(ValueError, match="share prompts"):
        merge_results([fake_result(["1"], 1.0, 1.0), fake_result(["1"], 1.0, 1.0)])
    other = fake_result(["9"], 1.0, 1.0)
    other["config"]["dtype"] = "bf16"
    with pytest.raises(ValueError, match="dtype"):
        merge_results([fake_result(["1"], 1.0, 1.0), other])


def test_cli_saves_after_every_prompt_and_marks_the_run_complete(tmp_path, monkeypatch, base_fp32, shipped_heads):
    """A run cut off mid-way keeps its finished prompts: the output file is rewritten after each one."""
    import sys

    import offline.bench as bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n"
                               for i, t in enumerate(["Name a colour.", "Count to three."])))
    out = tmp_path / "result.json"
    seen: list[dict] = []
    real_benchmark = bench.benchmark

    def spy(*args, on_prompt=None, **kwargs):
        def record(rows):
            on_prompt(rows)
            seen.append(json.loads(out.read_text()))
        return real_benchmark(*args, on_prompt=record, **kwargs)

    monkeypatch.setattr(bench, "benchmark", spy)
    monkeypatch.setattr(sys, "argv", ["bench", "--prompts", str(prompts), "--max-new-tokens", "6", "--device", "cpu",
                                      "--strategies", "ar,dynamic:auto", "--out", str(out)])
    bench.main()
    assert [s["config"]["prompt_count"] for s in seen] == [1, 2]
    assert [s["complete"] for s in seen] == [False, False]
    final = json.loads(out.read_text())
    assert final["complete"] is True and final["config"]["prompts_planned"] == 2
    assert final["summary"]["dynamic:auto"]["identical_to_ar"] == 1.0


def test_summary_gives_the_worst_prompt_and_each_category():
    rows = []
    for pid, category, ar_s, tree_s in (("1", "math", 1.0, 0.5), ("2", "math", 1.0, 2.0), ("3", "qa", 2.0, 1.0)):
        for spec, seconds in (("ar", ar_s), ("dynamic:auto", tree_s)):
            rows.append(BenchRow(prompt_id=pid, strategy=spec, new_tokens=10, steps=5, mean_accepted=2.0,
                                 seconds=seconds, tokens_per_s=10 / seconds, phase_seconds={}, output_ids=[],
                                 category=category))
    auto = summarise(rows, ["ar", "dynamic:auto"])["dynamic:auto"]
    assert auto["min_prompt_speedup"] == pytest.approx(0.5)  # prompt 2: 5 tokens/s against 10
    assert auto["median_prompt_speedup"] == pytest.approx(2.0)
    math = auto["by_category"]["math"]
    assert math["speedup_vs_ar"] == pytest.approx((20 / 2.5) / (20 / 2.0)) and math["min_prompt_speedup"] == 0.5
    assert auto["by_category"]["qa"]["speedup_vs_ar"] == pytest.approx(2.0)
    from viz.bench_plot import category_table
    table = category_table({"summary": summarise(rows, ["ar", "dynamic:auto"])})
    assert "| dynamic:auto | 0.80x (0.50x) | 2.00x (2.00x) |" in table


def test_store_and_lookup_specs_parse():
    from offline.bench import parse_strategy
    from core.decoder import DecodeConfig

    config = parse_strategy("dynamic:auto+lookup+store", DecodeConfig())
    assert config.auto_budget and config.spec.lookup and config.spec.store
    assert not parse_strategy("dynamic:32+store", DecodeConfig()).spec.lookup
    with pytest.raises(ValueError, match="only \\+lookup and \\+store"):
        parse_strategy("dynamic:auto+magic", DecodeConfig())


def test_hydra_specs_parse_and_pick_hydra_heads():
    from offline.bench import HeadSet, parse_strategy
    from core.decoder import DecodeConfig
    from tests.tiny import tiny_base, tiny_heads, tiny_hydra

    config = parse_strategy("hydra:auto+lookup", DecodeConfig())
    assert config.strategy == "hydra" and config.auto_budget and config.spec.lookup
    assert parse_strategy("hydra:40", DecodeConfig()).budget == 40
    base = tiny_base("llama")
    medusa, hydra = tiny_heads(base), tiny_hydra(base)
    assert HeadSet(medusa, {"hydra": hydra}).for_strategy(config) is hydra
    assert HeadSet(medusa, {"hydra": hydra}).for_strategy(parse_strategy("dynamic:auto", DecodeConfig())) is medusa
    with pytest.raises(ValueError, match="Hydra heads"):
        HeadSet(medusa).for_strategy(config)


def test_forward_suffix_runs_a_strategy_on_the_other_forward():
    """`ar@hf` runs plain decoding on transformers' forward beside `ar` on the lean one: same
    tokens (fp32), two rows, the ratio of the two is the engine's speed-up in one run."""
    from offline.bench import Prompt, benchmark, engine_of, parse_strategy
    from core.decoder import DecodeConfig
    from core.strategy import AUTOREGRESSIVE
    from tests.tiny import tiny_base, tiny_heads

    assert engine_of("dynamic:auto+lookup@hf") == "hf" and engine_of("ar") is None
    assert parse_strategy("dynamic:auto+lookup@hf", DecodeConfig()).spec.lookup
    assert parse_strategy("ar@lean", DecodeConfig()).strategy == AUTOREGRESSIVE
    with pytest.raises(ValueError, match="@lean or @hf"):
        parse_strategy("ar@fast", DecodeConfig())
    lean, hf = tiny_base("llama", engine="lean"), tiny_base("llama", engine="hf")
    assert (lean.engine_name, hf.engine_name) == ("lean", "hf")
    from offline.bench import HeadSet
    rows = benchmark(lean, HeadSet(medusa=tiny_heads(lean)), [Prompt(id="p", text="hello there")],
                     ["ar", "ar@hf", "dynamic:8@hf"], DecodeConfig(max_new_tokens=12),
                     other_forwards={"lean": lean, "hf": hf})
    by_spec = {row.strategy: row for row in rows}
    assert by_spec["ar@hf"].output_ids == by_spec["ar"].output_ids == by_spec["dynamic:8@hf"].output_ids
    assert by_spec["ar@hf"].identical_to_ar


def test_per_step_records_round_trip_through_the_json(monkeypatch):
    """Each row keeps, per step, the nodes verified, the tokens emitted, the verify time and the
    controller's state; they survive the JSON file and a merge."""
    from offline.bench import HeadSet, Prompt, benchmark
    from core.decoder import DecodeConfig
    from core.budget.cost_profile import CostProfile
    import core.decoder
    from tests.tiny import tiny_base, tiny_heads

    base = tiny_base("llama")
    profile = CostProfile(sizes=[1, 2, 64], ms=[20.0, 22.0, 46.8])
    monkeypatch.setattr(core.decoder, "verify_profile", lambda base: profile)
    rows = benchmark(base, HeadSet(medusa=tiny_heads(base)), [Prompt(id="p", text="hello there")],
                     ["ar", "dynamic:auto"], DecodeConfig(max_new_tokens=20))
    auto = next(r for r in rows if r.strategy == "dynamic:auto")
    assert len(auto.step_nodes) == len(auto.step_tokens) == len(auto.step_verify_ms) == len(auto.step_state) \
        == auto.steps
    assert sum(auto.step_tokens) + 1 == auto.new_tokens  # the prefill emits the first token
    assert set(auto.step_state) <= {"probing", "backing off", "exploring", "normal"} and "probing" in auto.step_state
    assert all(s == "" for s in next(r for r in rows if r.strategy == "ar").step_state)
    payload = json.loads(json.dumps({"config": {"strategies": ["ar", "dynamic:auto"], "dtype": "fp32",
                                                "max_new_tokens": 20, "temperature": 0.0, "rule": "greedy"},
                                     "rows": [asdict(r) for r in rows]}))
    back = [BenchRow(**row) for row in payload["rows"]]
    assert back == rows


def test_repeats_keep_the_median_run_and_every_time():
    """`repeats=3`: each row is the run of median time for its prompt and strategy, with all
    three times kept; the outputs (greedy, fp32) are those of a single run."""
    from offline.bench import HeadSet, Prompt, benchmark, median_run
    from core.decoder import DecodeConfig
    from tests.tiny import tiny_base, tiny_heads

    def row(seconds: float) -> BenchRow:
        return BenchRow(prompt_id="p", strategy="ar", new_tokens=1, steps=1, mean_accepted=1.0,
                        seconds=seconds, tokens_per_s=1 / seconds, phase_seconds={}, output_ids=[1])
    picked, _ = median_run([(row(3.0), None), (row(1.0), None), (row(2.0), None)])
    assert picked.seconds == 2.0 and picked.repeat_seconds == [3.0, 1.0, 2.0]
    assert median_run([(row(3.0), None), (row(1.0), None)])[0].seconds == 1.0  # the lower median
    base = tiny_base("llama")
    config = DecodeConfig(max_new_tokens=10)
    once = benchmark(base, HeadSet(medusa=tiny_heads(base)), [Prompt(id="p", text="hello there")], ["ar", "dynamic:8"], config)
    thrice = benchmark(base, HeadSet(medusa=tiny_heads(base)), [Prompt(id="p", text="hello there")], ["ar", "dynamic:8"],
                       config, repeats=3)
    assert [len(r.repeat_seconds) for r in thrice] == [3, 3]
    assert [r.output_ids for r in thrice] == [r.output_ids for r in once]
    assert all(round(r.seconds, 4) in r.repeat_seconds for r in thrice)


class FakeLlama:
    """Stands in for llama_cpp.Llama: yields a scripted token stream, remembering what it was given."""

    def __init__(self, stream: list[int]) -> None:
        self.stream, self.calls, self.resets = stream, [], 0

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens, **sampling):
        self.calls.append((list(tokens), sampling))
        yield from self.stream


def test_the_llama_cpp_peer_decodes_greedily_and_stops_as_our_decoder_does():
    """Greedy sampling settings (top-1, no penalty), the end token kept and the run stopped there,
    or stopped at the token limit; its row sits beside `ar` in one benchmark with its prefill apart."""
    from pathlib import Path
    from core.decoder import DecodeConfig
    from offline.bench import HeadSet, Prompt, benchmark
    from offline.llamacpp import LlamaCppPeer
    from tests.tiny import tiny_base, tiny_heads

    fake = FakeLlama([5, 6, 7, 2, 9, 9])
    peer = LlamaCppPeer(model=fake, threads=2, gguf=Path("model.gguf"))
    run = peer.decode([1, 4], max_new_tokens=10, eos_token_ids=frozenset({2}))
    assert run.output_ids == [5, 6, 7, 2] and 0 <= run.prefill_seconds <= run.seconds
    assert fake.calls[0][0] == [1, 4] and fake.resets == 1  # no prompt cache carried over from a previous run
    sampling = fake.calls[0][1]
    assert (sampling["top_k"], sampling["temp"], sampling["repeat_penalty"]) == (1, 0.0, 1.0)
    assert peer.decode([1], max_new_tokens=2, eos_token_ids=frozenset()).output_ids == [5, 6]

    base = tiny_base("llama")
    rows = benchmark(base, HeadSet(medusa=tiny_heads(base)), [Prompt(id="p", text="hello there")],
                     ["ar", "llamacpp:greedy"], DecodeConfig(max_new_tokens=3), llama=peer)
    row = next(r for r in rows if r.strategy == "llamacpp:greedy")
    assert row.output_ids == [5, 6, 7] and "prefill" in row.phase_seconds and row.identical_to_ar is not None
    with pytest.raises(ValueError, match="llama.cpp peer"):
        benchmark(base, HeadSet(medusa=tiny_heads(base)), [Prompt(id="p", text="hi")], ["llamacpp:greedy"],
                  DecodeConfig(max_new_tokens=3))


def test_the_llama_cpp_peer_says_how_to_install_it(monkeypatch):
    import sys
    from pathlib import Path
    from offline.llamacpp import LlamaCppPeer
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match="pip install llama-cpp-python"):
        LlamaCppPeer.load(Path("model.gguf"))
