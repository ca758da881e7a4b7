"""Which models this project decodes exactly: the families proven token-for-token equal to plain greedy
under a tree mask, and the checks a loaded model must pass (`check_supported`, called on load)."""
from __future__ import annotations

from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs


# Families whose decoding with a tree mask is proven token-for-token equal to plain greedy
# (tests/test_architectures.py: tiny random models of each, fixed and dynamic trees, sdpa and eager).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "olmo2", "stablelm", "phi"})
# Attention implementations that apply the custom 4D float mask of core/verify.py as given
# (flash attention ignores it; flex attention expects a BlockMask).
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager"})
# Config fields that change the logits after `lm_head` (the decoder projects with `lm_head` alone)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_supported(model: PreTrainedModel) -> None:
    """Raise ValueError unless `model` decodes exactly with this project's tree attention and KV commit.

    Tree verification passes one additive 4D mask to every layer and the commit edits the keys
    and values of plain DynamicCache layers in place. So a model must be of a family proven exact
    (SUPPORTED_MODEL_TYPES), attend to every committed position in every layer (no sliding or
    chunked windows), use an attention implementation that honours a custom mask, and produce
    its logits by `lm_head` alone.
    """
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported: tree decoding is proven exact only for "
                         f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no inner decoder at `.model`, which tree verification calls")
    attention = model.config._attn_implementation
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(f"attention implementation {attention!r} is not supported: the tree mask is honoured only "
                         f"by {', '.join(sorted(SUPPORTED_ATTENTION))} (load the model with attn_implementation='sdpa')")
    _check_full_attention(config)
    _check_rope(config)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise ValueError(f"{name}={value} is not supported: the decoder's logits are lm_head(hidden) alone")


# RoPE types whose frequencies are fixed (not a function of the longest position in a forward):
# a tree verify and a plain step rotate a position identically. The tests decode each exactly.
EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


def _rope_types(config: PretrainedConfig) -> set[str]:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(parameters, dict) and parameters and all(isinstance(v, dict) for v in parameters.values()):
        return {str(v.get("rope_type", v.get("type", "default"))) for v in parameters.values()}  # per layer type
    if isinstance(parameters, dict):
        return {str(parameters.get("rope_type", parameters.get("type", "default")))}
    return {"default"}


def _check_rope(config: PretrainedConfig) -> None:
    """Refuse RoPE variants whose rotation depends on the forward's length (longrope, dynamic NTK,
    YaRN variants): a tree verify reaches other positions than a plain step and would rotate differently."""
    other = sorted(_rope_types(config) - EXACT_ROPE_TYPES)
    if other:
        raise ValueError(f"RoPE type {', '.join(other)} is not supported: its frequencies may depend on the longest "
                         f"position in a forward, so tree and plain steps could rotate a position differently; "
                         f"exact here: {', '.join(sorted(EXACT_ROPE_TYPES))}")


def _check_full_attention(config: PretrainedConfig) -> None:
    """Every layer must be plain full attention with a plain DynamicCache layer."""
    layer_types, _ = get_layer_types_and_kwargs(config)
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        window = getattr(config, "sliding_window", None)
        raise ValueError(f"layer types {other} (sliding_window={window}) are not supported: the tree mask covers the "
                         "whole context in every layer, so a windowed layer would attend too far; only full "
                         "attention decodes exactly")
    cache_layers = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if cache_layers - {DynamicLayer.__name__}:
        raise ValueError(f"cache layers {sorted(cache_layers)} are not supported: the KV commit edits plain "
                         "DynamicLayer keys and values")
