"""The drafters exported in serving engines' layouts (`offline.export`): Medusa's medusa_lm_head
checkpoint and EAGLE-3's draft model, each read back and recomputed from the exported tensors alone."""
from __future__ import annotations

import json
import math

import safetensors.torch
import torch
import torch.nn.functional as F

from core.drafters.medusa import load_official_medusa
from offline.export import EAGLE3_FILE, MEDUSA_FILE, export_eagle3, export_medusa, import_eagle3
from tests.tiny import tiny_base, tiny_eagle, tiny_heads


def test_exported_medusa_heads_load_as_official_heads_and_compute_the_same_logits(tmp_path):
    base = tiny_base("llama")
    heads = tiny_heads(base, num_heads=3, num_layers=2)
    folder = export_medusa(heads, base, tmp_path / "medusa")
    config = json.loads((folder / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
    official = load_official_medusa(folder / MEDUSA_FILE)
    assert official.config.own_lm_head and official.config.num_heads == 3
    hidden = torch.randn(5, base.model.config.hidden_size, generator=torch.Generator().manual_seed(1))  # [5, H]
    with torch.no_grad():
        assert torch.allclose(official(hidden), heads(hidden, base.lm_head), atol=1e-6)  # [K, 5, V]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, d] rotated at positions 0..n-1 (Llama's rotate-half convention)."""
    n, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv  # [n, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def eagle3_reference(folder, features: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's draft layer computed from an exported folder alone (as vLLM's Eagle3 Llama layer does
    it: fused features, [norm(embedding); norm(state)] into attention, residual from the fused
    state): the output states [n, H] and the logits over the target vocabulary [n, V] (-inf off the
    draft vocabulary)."""
    config = json.loads((folder / "config.json").read_text())
    t = safetensors.torch.load_file(folder / EAGLE3_FILE)
    eps, heads, kv_heads, d = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    g = features @ t["fc.weight"].T  # [n, H]
    x = torch.cat([_rms(embeds, t["midlayer.input_layernorm.weight"], eps),
                   _rms(g, t["midlayer.hidden_norm.weight"], eps)], dim=-1)  # [n, 2H]
    n = x.shape[0]
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), config["rope_theta"])
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, d), config["rope_theta"])
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    k, v = (a.repeat_interleave(heads // kv_heads, dim=1) for a in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # [heads, n, n]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    r = g + attended @ t["midlayer.self_attn.o_proj.weight"].T
    m = _rms(r, t["midlayer.post_attention_layernorm.weight"], eps)
    out = r + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) \
        @ t["midlayer.mlp.down_proj.weight"].T
    draft_logits = _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T  # [n, D]
    targets = torch.arange(config["draft_vocab_size"]) + t["d2t"]
    logits = torch.full((n, config["vocab_size"]), float("-inf"))
    logits[:, targets] = draft_logits
    assert bool(t["t2d"][targets].all()) and int(t["t2d"].sum()) == len(targets)
    return out, logits


def test_exported_eagle_layer_is_eagle3s_layer_and_reads_back(tmp_path):
    base = tiny_base("llama")
    layer = tiny_eagle(base, std=0.2)
    with torch.no_grad():  # a draft vocabulary that is not the identity, in frequency (not id) order
        layer.draft_vocab.copy_(torch.randperm(base.model.config.vocab_size, generator=torch.Generator().manual_seed(3)))
    folder = export_eagle3(layer, base, tmp_path / "eagle3")
    hidden = base.model.config.hidden_size
    generator = torch.Generator().manual_seed(2)
    features, embeds = torch.randn(7, 3 * hidden, generator=generator), torch.randn(7, hidden, generator=generator)
    with torch.no_grad():
        ours, _ = layer.extend(None, features, embeds)  # [7, H]
        our_logits = torch.full((7, base.model.config.vocab_size), float("-inf"))
        our_logits[:, layer.draft_vocab] = layer.draft_states(ours) @ base.lm_head.weight[layer.draft_vocab].T
    reference, logits = eagle3_reference(folder, features, embeds)
    assert torch.allclose(ours, reference, atol=1e-5)
    assert torch.allclose(our_logits, logits, atol=1e-4)
    back = import_eagle3(folder)
    assert back.config == layer.config.__class__(**{**layer.config.__dict__, "base_model": back.config.base_model})
    for name, value in layer.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
