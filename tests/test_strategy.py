"""The one strategy grammar: every form the UI, the benchmark and the simulator use parses and prints back."""
import subprocess
import sys

import pytest

import labstate
from core.decoder import DecodeConfig, strategy_config
from core.strategy import (AUTOREGRESSIVE, DYNAMIC, FIXED, HF, HYDRA, LLAMACPP, LOOKUP_TOKENS, MAX_BUDGET,
                           STORE_TOKENS, StrategyError, StrategySpec, parse_strategy)
from offline.bench import parse_strategy as bench_config
from offline.simulate import parse_tree_spec

BENCH_FORMS = ["ar", "fixed", "fixed:mc_sim_7b_63", "dynamic", "dynamic:63", "dynamic:auto", "dynamic:auto+lookup",
               "dynamic:auto+lookup+store", "dynamic:32+store", "hydra", "hydra:40", "hydra:auto+lookup",
               "hf:greedy", "hf:prompt_lookup", "ar@hf", "dynamic:auto+lookup@lean", "hf:prompt_lookup@hf"]


@pytest.mark.parametrize("text", BENCH_FORMS)
def test_canonical_forms_print_back_as_themselves(text):
    spec = parse_strategy(text)
    assert spec.text == text and str(spec) == text and parse_strategy(spec.text) == spec


def test_every_strategy_the_ui_offers_parses_in_the_benchmark_grammar_and_back():
    for text in labstate.ui_strategies():
        spec = parse_strategy(text)
        assert spec.text == text and labstate.strategy_labels()[text] == spec.label
        settings = labstate.parse_settings({"strategy": text})
        assert settings.spec == spec and settings.raw()["strategy"] == text
        ui_config, _ = labstate.decode_config(settings, max_depth=4)
        bench = bench_config(text, DecodeConfig())
        assert ui_config.spec == bench.spec.with_budget(settings.budget), text


def test_aliases_and_addition_order_normalise():
    assert parse_strategy("autoregressive").text == "ar"
    assert parse_strategy(" dynamic:auto+store+lookup ").text == "dynamic:auto+lookup+store"
    assert parse_strategy("hydra+lookup") == parse_strategy("hydra:+lookup") == StrategySpec(HYDRA, lookup=True)
    assert labstate.parse_settings({"strategy": "autoregressive"}).ui_strategy == "ar"


@pytest.mark.parametrize("text, message", [
    ("", "non-empty"), ("beam", "unknown strategy"), ("dynamic:auto+magic", "addition"),
    ("dynamic:+lookup+lookup", "repeated"), ("dynamic:12x", "whole number or auto"), ("dynamic:0", "from 1 to"),
    (f"dynamic:{MAX_BUDGET + 1}", "from 1 to"), ("ar@fast", "@lean or @hf"), ("hf:beam", "peers"), ("hf", "peers"),
    ("fixed:auto+lookup", None), ("ar:5", "unknown strategy"), ("fixed+lookup", "take \\+lookup"),
    ("ar+store", "take \\+lookup"),
])
def test_malformed_strategies_say_what_the_grammar_is(text, message):
    if message is None:  # a fixed tree name is free text; it fails where the tree is looked up
        with pytest.raises(ValueError, match="unknown tree"):
            strategy_config(parse_strategy(text))
        return
    with pytest.raises(StrategyError, match=message):
        parse_strategy(text)


def test_specs_refuse_what_their_family_does_not_take():
    with pytest.raises(StrategyError):
        StrategySpec(AUTOREGRESSIVE, lookup=True)
    with pytest.raises(StrategyError):
        StrategySpec(FIXED, budget=8)
    with pytest.raises(StrategyError):
        StrategySpec(DYNAMIC, tree="mc_sim_7b_63")


def test_decode_configs_follow_the_spec():
    config = strategy_config(parse_strategy("hydra:40+lookup+store"))
    assert config.spec == parse_strategy("hydra:40+lookup+store") == DecodeConfig(spec="hydra:40+lookup+store").spec
    assert (config.strategy, config.budget, config.auto_budget) == (HYDRA, 40, False)
    assert (config.lookup_tokens, config.store_tokens) == (LOOKUP_TOKENS, STORE_TOKENS)
    assert strategy_config(parse_strategy("fixed:calibrated")).fixed_tree == "calibrated"
    with pytest.raises(StrategyError, match="another program"):
        strategy_config(parse_strategy("hf:greedy"))
    assert parse_strategy("hf:greedy").family == HF


def test_llama_cpp_is_a_peer_without_a_forward_of_ours():
    spec = parse_strategy("llamacpp:greedy")
    assert (spec.family, spec.peer, spec.text, spec.drafts) == (LLAMACPP, "greedy", "llamacpp:greedy", False)
    assert "llama.cpp" in spec.label
    with pytest.raises(StrategyError, match="another program"):
        strategy_config(spec)
    for text in ("llamacpp", "llamacpp:prompt_lookup", "llamacpp:greedy@exact", "hf:llamacpp"):
        with pytest.raises(StrategyError):
            parse_strategy(text)


def test_labels_name_the_budget_and_the_forward():
    assert parse_strategy("dynamic:auto+lookup").with_budget(48).label == "dynamic (auto budget ≤ 48) + prompt lookup"
    assert parse_strategy("ar@hf").label == "autoregressive on transformers' forward"
    assert parse_strategy("ar").with_budget(9) == parse_strategy("ar")


def test_the_simulator_reads_the_same_grammar():
    assert parse_tree_spec("dynamic:16").budget == 16 and parse_tree_spec("dynamic").budget == 63
    assert parse_tree_spec("fixed").label == "fixed" and parse_tree_spec("fixed").fixed is not None
    with pytest.raises(StrategyError, match="simulator"):
        parse_tree_spec("dynamic:auto+lookup")


def test_the_grammar_imports_nothing_heavy():
    code = "import sys, core.strategy; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
