"""The lab's trained drafters in the layouts serving engines load.

    python -m offline.export --family medusa --out exports/medusa    # Medusa's medusa_lm_head checkpoint
    python -m offline.export --family eagle --out exports/eagle3     # EAGLE-3's draft model (vLLM, SGLang)

Medusa (FasterDecoding/Medusa): `medusa_lm_head.safetensors` holds a ModuleList state dict, keys
`{head}.{layer}.linear.weight` / `.bias` for each ResBlock and `{head}.{num_layers}.weight` for the
head's own projection; `config.json` names `medusa_num_heads`, `medusa_num_layers` and the base
model. The lab's heads read the base model's frozen lm_head (ranked over a draft vocabulary); the
export writes that lm_head as every head's own projection, over the whole vocabulary, as Medusa's
heads have it (so an engine ranks all tokens where the lab ranks its draft vocabulary).

EAGLE-3 (SafeAILab/EAGLE; vLLM's `Eagle3LlamaForCausalLM`, SGLang's `LlamaForCausalLMEagle3`):
`model.safetensors` with `fc.weight` [H, 3H] (the fusion), `midlayer.input_layernorm` (the token
embedding's norm), `midlayer.hidden_norm` (the state's norm), `midlayer.self_attn.{q,k,v,o}_proj`
(q/k/v read [norm(embedding); norm(state)], 2H wide), `midlayer.post_attention_layernorm`,
`midlayer.mlp.{gate,up,down}_proj`, `norm`, `lm_head.weight` [draft vocab, H] (the base model's rows),
`d2t` (draft id -> target id offset: target = draft + d2t[draft]) and `t2d` (a vocabulary mask);
`config.json` is a one-layer Llama config with `draft_vocab_size`. The layer's math is EAGLE-3's, so
the export is a renaming, the key/value and gate/up products split in two. Two differences an
engine must know (docs/DATA.md): the third fused feature here is the base model's final normed
hidden state (EAGLE-3 taps the residual entering layer N-3), and the lab's layer attends over the
answer's positions only (an engine's draft cache also holds the prompt's).

`import_eagle3` reads such a folder back into an `EagleLayer` (the round trip the tests pin, and a
way to try a compatible checkpoint trained elsewhere).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import safetensors.torch
import torch

from core.drafters.eagle import EagleConfig, EagleLayer, load_eagle
from core.drafters.medusa import MedusaHeads, load_heads
from core.model import DEFAULT_MODEL, BaseModel, ModelConfig, load_base_model
from offline.train import repo_path

MEDUSA_FILE = "medusa_lm_head.safetensors"
EAGLE3_FILE = "model.safetensors"
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the shipped GGUF quantises


def export_medusa(heads: MedusaHeads, base: BaseModel, folder: Path) -> Path:
    """`heads` in Medusa's layout, each head projecting with the base model's lm_head."""
    config = heads.config
    tensors = {name: t.detach().float().contiguous() for name, t in heads.heads.state_dict().items()}
    if not config.own_lm_head:
        projection = base.lm_head.weight.detach().float()  # [V, H]
        for head in range(config.num_heads):
            tensors[f"{head}.{config.num_layers}.weight"] = projection.clone()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, folder / MEDUSA_FILE)
    (folder / "config.json").write_text(json.dumps({
        "medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
        "base_model_name_or_path": BASE_MODEL_ID, "hidden_size": config.hidden_size,
        "vocab_size": int(tensors[f"0.{config.num_layers}.weight"].shape[0])}, indent=2) + "\n")
    return folder


def eagle3_tensors(layer: EagleLayer, base: BaseModel) -> dict[str, torch.Tensor]:
    """The layer's weights under EAGLE-3's names (see the module docstring)."""
    c = layer.config
    kv_width = c.kv_heads * c.head_dim
    key, value = layer.kv.weight.detach().split(kv_width, dim=0)  # [kvh*d, 2H] each
    gate, up = layer.gate_up.weight.detach().split(c.intermediate, dim=0)  # [I, H] each
    vocab = layer.draft_vocab.long()  # [D] target ids, draft order
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    named = {
        "fc.weight": layer.fuse.weight, "midlayer.input_layernorm.weight": layer.embed_norm.weight,
        "midlayer.hidden_norm.weight": layer.attn_norm.weight, "midlayer.self_attn.q_proj.weight": layer.q.weight,
        "midlayer.self_attn.k_proj.weight": key, "midlayer.self_attn.v_proj.weight": value,
        "midlayer.self_attn.o_proj.weight": layer.o.weight,
        "midlayer.post_attention_layernorm.weight": layer.mlp_norm.weight,
        "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": layer.down.weight, "norm.weight": layer.out_norm.weight,
        "lm_head.weight": base.lm_head.weight.detach()[vocab],
    }
    tensors = {name: t.detach().float().contiguous() for name, t in named.items()}
    tensors["d2t"] = (vocab - torch.arange(len(vocab))).contiguous()  # [D] target = draft + d2t
    tensors["t2d"] = t2d
    return tensors


def export_eagle3(layer: EagleLayer, base: BaseModel, folder: Path) -> Path:
    """`layer` as an EAGLE-3 draft model folder (safetensors and a one-layer Llama config)."""
    c = layer.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(eagle3_tensors(layer, base), folder / EAGLE3_FILE)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": c.eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size, "max_position_embeddings": base.max_positions,
        "tie_word_embeddings": False, "torch_dtype": "float32", "target_model": BASE_MODEL_ID,
        "lab": {"taps": list(c.taps), "third_feature": "the base model's final normed hidden state",
                "attends": "the answer's positions only"},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def import_eagle3(folder: Path, taps: tuple[int, ...] = (2, 15)) -> EagleLayer:
    """An EAGLE-3 draft model folder as the lab's layer (ValueError when its shape is not one layer
    of the lab's kind). `taps`: the base layers whose entering residual streams are the first two
    fused features (the folder's own `lab.taps` when it was exported here)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{folder}: {config['num_hidden_layers']} draft layers; the lab's EAGLE layer is one")
    tensors = safetensors.torch.load_file(folder / EAGLE3_FILE)
    hidden = config["hidden_size"]
    layer = EagleLayer(EagleConfig(
        hidden_size=hidden, num_heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim", hidden // config["num_attention_heads"]),
        intermediate=config["intermediate_size"], vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], taps=tuple(config.get("lab", {}).get("taps", taps)),
        rope_theta=float(config["rope_theta"]), eps=float(config["rms_norm_eps"])))
    draft = torch.arange(config["draft_vocab_size"])
    state = {
        "fuse.weight": tensors["fc.weight"], "embed_norm.weight": tensors["midlayer.input_layernorm.weight"],
        "attn_norm.weight": tensors["midlayer.hidden_norm.weight"], "q.weight": tensors["midlayer.self_attn.q_proj.weight"],
        "kv.weight": torch.cat([tensors["midlayer.self_attn.k_proj.weight"], tensors["midlayer.self_attn.v_proj.weight"]]),
        "o.weight": tensors["midlayer.self_attn.o_proj.weight"],
        "mlp_norm.weight": tensors["midlayer.post_attention_layernorm.weight"],
        "gate_up.weight": torch.cat([tensors["midlayer.mlp.gate_proj.weight"], tensors["midlayer.mlp.up_proj.weight"]]),
        "down.weight": tensors["midlayer.mlp.down_proj.weight"], "out_norm.weight": tensors["norm.weight"],
        "draft_vocab": draft + tensors["d2t"].long(),
    }
    layer.load_state_dict(state)
    return layer.eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("medusa", "eagle"), required=True)
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--weights", default="", help="the lab's weights folder (default: the shipped ones)")
    args = parser.parse_args()
    base = load_base_model(ModelConfig(name=DEFAULT_MODEL, dtype="fp32", device="cpu"))
    if args.family == "medusa":
        heads = load_heads(repo_path(args.weights or "assets/heads"))
        folder = export_medusa(heads, base, repo_path(args.out))
    else:
        layer = load_eagle(repo_path(args.weights or "assets/eagle"))
        folder = export_eagle3(layer, base, repo_path(args.out))
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")


if __name__ == "__main__":
    main()
