"""Other base models: every accepted family decodes exactly, the rest are refused with a reason.

Tree verification passes one additive 4D mask to every layer and the KV commit edits plain
DynamicCache layers. For each family in `core.support.SUPPORTED_MODEL_TYPES` a tiny random model
(tests/tiny.py) must decode, with random Medusa heads and both tree strategies, exactly the
tokens that transformers' own greedy `generate` emits, under sdpa and eager attention.
Sliding windows, unsupported families, attention implementations that ignore the mask and
logit transforms after `lm_head` are refused by `check_supported`, which `load_base_model` runs.
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import core.model
import core.support
from core.decoder import DecodeConfig, DecodeSession, decode
from core.drafters.medusa import MedusaHeads
from core.model import BaseModel, ModelConfig, load_base_model
from core.support import SUPPORTED_MODEL_TYPES, check_supported
from tests.tiny import ARCHITECTURES, greedy_reference, tiny_base, tiny_heads, tiny_model, tiny_tokenizer, wrap

NEW_TOKENS = 40
PROMPT = list(range(10, 30))  # 20 byte tokens
# a small Medusa-style tree: two ranks at depths 1-2, a chain to depth 4 (7 nodes + root)
SMALL_TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))
STRATEGIES = {
    "dynamic": DecodeConfig(spec="dynamic:15", max_new_tokens=NEW_TOKENS),
    "fixed": DecodeConfig(spec="fixed", fixed_tree=SMALL_TREE, max_new_tokens=NEW_TOKENS),
}
# (family, extra config): the plain tiny model of each family, plus a Qwen2 whose sliding window
# is configured but applies to no layer (max_window_layers >= layers), which must stay accepted
ACCEPTED = [(arch, {}) for arch in ARCHITECTURES] + [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
]


@functools.lru_cache(maxsize=None)
def _case(arch: str, attention: str, extra: tuple) -> tuple[BaseModel, MedusaHeads, list[int]]:
    """Tiny base, random heads and the plain greedy reference (built once per family and attention)."""
    base = tiny_base(arch, attn_implementation=attention, **dict(extra))
    return base, tiny_heads(base), greedy_reference(base, PROMPT, NEW_TOKENS)


def _trees_vary(session: DecodeSession) -> bool:
    """Some step accepted a head token and the accepted paths were not always the first nodes."""
    accepted = [record.outcome.accepted_nodes for record in session.records]
    return any(len(nodes) > 1 for nodes in accepted) and any(nodes != list(range(len(nodes))) for nodes in accepted)


def test_every_tested_family_is_supported_and_vice_versa():
    assert {arch for arch, _ in ACCEPTED} == SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch, extra", ACCEPTED, ids=[a + ("-unused-window" if e else "") for a, e in ACCEPTED])
def test_fp32_tree_greedy_equals_plain_generate(arch: str, extra: dict[str, Any], attention: str, strategy: str):
    base, heads, plain = _case(arch, attention, tuple(sorted(extra.items())))
    assert base.model.config._attn_implementation == attention
    session = decode(base, heads, PROMPT, STRATEGIES[strategy])
    assert session.output_ids == plain
    assert len(set(plain)) > 5, "a degenerate tiny model (one repeated token) proves little"
    if strategy == "dynamic":
        assert _trees_vary(session)


# (family, config overrides, attention, words the refusal must contain)
REFUSED = [
    ("mistral", {"sliding_window": 4096}, None, "sliding_attention"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, None, "sliding_window=16"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, None, "sliding_attention"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, None, "sliding_attention"),
    ("phi3", {"sliding_window": 64}, None, "sliding_window=64"),
    ("gemma2", {"head_dim": 16}, None, "model type 'gemma2'"),
    ("gemma3_text", {"head_dim": 16}, None, "model type 'gemma3_text'"),
    ("gpt_neox", {}, None, "model type 'gpt_neox'"),
    ("cohere", {}, None, "model type 'cohere'"),
    ("llama", {}, "flex_attention", "attention implementation 'flex_attention'"),
    ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                               "original_max_position_embeddings": 64}}, None, "RoPE type longrope"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None, "RoPE type dynamic"),
]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("arch, overrides, attention, words", REFUSED,
                         ids=[f"{a}-{'-'.join(o) or attn}" for a, o, attn, _ in REFUSED])
def test_unsupported_configs_are_refused(arch: str, overrides: dict[str, Any], attention: str | None, words: str):
    model = tiny_model(arch, attn_implementation=attention, **overrides)
    with pytest.raises(ValueError, match="not supported") as error:
        check_supported(model)
    assert words in str(error.value)


def test_flash_attention_is_refused():
    """Flash attention ignores a custom 4D mask (not installed here: the config names it)."""
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2' is not supported"):
        check_supported(model)


@pytest.mark.parametrize("field", core.support.LOGIT_TRANSFORMS)
def test_logit_transforms_after_lm_head_are_refused(field: str):
    model = tiny_model("llama")
    setattr(model.config, field, 30.0)
    with pytest.raises(ValueError, match=f"{field}=30.0 is not supported"):
        check_supported(model)


def test_cache_layers_other_than_dynamic_layer_are_refused(monkeypatch: pytest.MonkeyPatch):
    """A config whose cache would not be plain DynamicLayers (here faked) is refused."""
    class WindowedCache:
        def __init__(self, config: Any) -> None:
            self.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=8)]

    monkeypatch.setattr(core.support, "DynamicCache", WindowedCache)
    with pytest.raises(ValueError, match="cache layers .*DynamicSlidingWindowLayer.* are not supported"):
        check_supported(tiny_model("llama"))


def test_load_base_model_runs_the_check(tmp_path):
    """A local checkpoint of a refused config fails to load; the same family without a window loads."""
    for name, window in (("windowed", 4096), ("plain", None)):
        model = tiny_model("mistral", sliding_window=window)
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match="sliding_window=4096"):
        load_base_model(ModelConfig(name=str(tmp_path / "windowed"), device="cpu"))
    assert load_base_model(ModelConfig(name=str(tmp_path / "plain"), device="cpu")).model.config.model_type == "mistral"


def test_tiny_base_refuses_like_load_base_model():
    with pytest.raises(ValueError, match="sliding"):
        tiny_base("mistral", sliding_window=4096)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, LLAMA3_ROPE], ids=["linear", "llama3"])
def test_static_rope_variants_are_accepted_and_exact(rope: dict[str, Any]):
    base = tiny_base("llama", rope_scaling=rope)
    plain = greedy_reference(base, PROMPT, NEW_TOKENS)
    assert decode(base, tiny_heads(base), PROMPT, STRATEGIES["dynamic"]).output_ids == plain


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
])
def test_sliding_window_would_decode_wrongly(arch: str, overrides: dict[str, Any]):
    """Why the refusal: past the window, the unchecked tree decode silently leaves plain greedy."""
    base = wrap(tiny_model(arch, **overrides))
    heads = tiny_heads(base)
    with torch.inference_mode():
        plain = greedy_reference(base, PROMPT, NEW_TOKENS)
    assert decode(base, None, PROMPT, DecodeConfig(spec="ar", max_new_tokens=NEW_TOKENS)).output_ids \
        == plain
    assert decode(base, heads, PROMPT, STRATEGIES["dynamic"]).output_ids != plain
