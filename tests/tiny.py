"""Tiny random base models and Medusa heads, built in-process (no download, no shipped weights).

    base = tiny_base("qwen2")               # a core.model.BaseModel, checked like load_base_model
    heads = tiny_heads(base, num_heads=4)   # random non-zero heads with the model's sizes
    plain = greedy_reference(base, prompt_ids, max_new_tokens=40)

Every architecture is a 2-layer, 64-wide decoder over a 256-token byte-level vocabulary. The
weights are drawn with a larger spread than transformers' default (initializer_range 0.1 instead
of 0.02) so that the logits are far from ties and greedy decoding is decisive in fp32. There is
no end-of-sequence token unless one is asked for, so a decode runs to its token limit.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from core.drafters.medusa import HeadsConfig, MedusaHeads
from core.model import DTYPES, BaseModel, ModelConfig, prepare_model

VOCAB_SIZE = 256
INIT_RANGE = 0.1
COMMON: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, vocab_size=VOCAB_SIZE, initializer_range=INIT_RANGE,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)

# model_type -> settings on top of COMMON that make the family tiny and plain (full attention only)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 16, "use_sliding_window": False},
    "phi3": {"sliding_window": None},
    "gemma": {"head_dim": 16, "initializer_range": 0.3},  # at 0.1 the tied, scaled embedding echoes its input
    "olmo2": {},
    "stablelm": {},
    "phi": {},
}


def tiny_config(arch: str = "llama", max_positions: int = 256, **overrides: Any) -> PretrainedConfig:
    """The config of a tiny `arch` model (a model_type; families outside ARCHITECTURES get COMMON only)."""
    settings = {**COMMON, **ARCHITECTURES.get(arch, {}), "max_position_embeddings": max_positions, **overrides}
    return AutoConfig.for_model(arch, **settings)


def tiny_model(arch: str = "llama", max_positions: int = 256, dtype: str = "fp32", *, seed: int = 0,
               attn_implementation: str | None = None, **overrides: Any) -> PreTrainedModel:
    """A random tiny causal LM in eval mode, NOT checked (refusal tests need unsupported ones too)."""
    config = tiny_config(arch, max_positions, **overrides)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    return model.to(DTYPES[dtype]).eval()


def tiny_tokenizer(vocab_size: int = VOCAB_SIZE, eos_token_id: int | None = None) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are the 256 bytes (GPT-2's printable alphabet), one token each;
    ids above 255 (a larger vocabulary) are `<extra_i>` tokens. No chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = [chr(c) for c in sorted(ord(ch) for ch in alphabet)]  # 256 symbols
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    if eos_token_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_token_id)
    return tokenizer


def wrap(model: PreTrainedModel, dtype: str = "fp32", name: str = "tiny", engine: str = "auto",
         device: str = "cpu") -> BaseModel:
    """A BaseModel around an already prepared model, with the byte tokenizer; `engine` as in ModelConfig
    (`auto`: the lean forward for the Llama family, transformers' forward elsewhere)."""
    tokenizer = tiny_tokenizer(max(model.config.vocab_size, VOCAB_SIZE), model.generation_config.eos_token_id)
    config = ModelConfig(name=name, dtype=dtype, device=device, engine=engine)
    return BaseModel(model=model, tokenizer=tokenizer, config=config, source=f"{name}, {dtype}, {device}")


def tiny_base(arch: str = "llama", max_positions: int = 256, dtype: str = "fp32", *, seed: int = 0,
              attn_implementation: str | None = None, engine: str = "auto", device: str = "cpu",
              **overrides: Any) -> BaseModel:
    """A tiny random `arch` model prepared exactly as `load_base_model` prepares a loaded one
    (supported-family check, eval, frozen, fp32 skinny linears) and wrapped as a BaseModel."""
    model = tiny_model(arch, max_positions, dtype, seed=seed, attn_implementation=attn_implementation,
                       **overrides).to(device)
    prepare_model(model, torch.device(device), DTYPES[dtype])
    return wrap(model, dtype, name=f"tiny-{arch}", engine=engine, device=device)


def tiny_heads(base: BaseModel, num_heads: int = 4, *, num_layers: int = 1, std: float = 0.05,
               seed: int = 0) -> MedusaHeads:
    """Random non-zero Medusa heads sharing `base`'s lm_head (its hidden and vocabulary sizes).

    Zero-initialised heads would all copy the base model's own guess; random ones propose varied,
    sometimes right tokens, so trees differ from step to step."""
    config = base.model.config
    heads = MedusaHeads(HeadsConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=config.hidden_size,
                                    vocab_size=config.vocab_size, base_model=base.source))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.heads:
            for layer in block[:num_layers]:
                layer.linear.weight.normal_(0.0, std, generator=generator)
    return heads.to(device=base.device, dtype=base.dtype).eval().requires_grad_(False)


def greedy_reference(base: BaseModel, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding by transformers' own `generate`: the new token ids."""
    ids = torch.tensor([list(prompt_ids)], device=base.device)  # [1, n]
    eos = sorted(base.eos_token_ids) or None
    with torch.inference_mode():
        out = base.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=eos)
    return out[0, ids.shape[1]:].tolist()


def tiny_hydra(base: BaseModel, num_heads: int = 4, *, std: float = 0.05, seed: int = 0,
               prefix_layer: bool = False) -> "HydraHeads":
    """Random non-zero Hydra heads over `base` (the whole vocabulary is their draft vocabulary),
    with a random non-zero prefix layer when asked."""
    from core.drafters.hydra import HydraConfig, HydraHeads
    config = base.model.config
    heads = HydraHeads(HydraConfig(num_heads=num_heads, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                                   draft_vocab_size=config.vocab_size, base_model=base.source,
                                   prefix_layer=prefix_layer, prefix_heads=4, prefix_mlp=2 * config.hidden_size))
    heads.draft_vocab.copy_(torch.arange(config.vocab_size))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in heads.heads:
            head.mix.weight.normal_(0.0, std, generator=generator)
            head.blocks[0].linear.weight.normal_(0.0, std, generator=generator)
        if heads.prefix is not None:
            for weight in (heads.prefix.qkv.weight, heads.prefix.out.weight, heads.prefix.gate_up.weight,
                           heads.prefix.down.weight):
                weight.normal_(0.0, 4 * std, generator=generator)
    return heads.to(device=base.device, dtype=base.dtype).eval().requires_grad_(False)


def tiny_eagle(base: BaseModel, *, std: float = 0.1, seed: int = 0) -> "EagleLayer":
    """A random non-zero EAGLE draft layer over `base` (its whole vocabulary drafted), reading the
    residual streams entering layer 0 (the embeddings) and the middle layer of a tiny model."""
    from core.drafters.eagle import EagleConfig, EagleLayer
    config = base.model.config
    heads = config.num_attention_heads
    layer = EagleLayer(EagleConfig(hidden_size=config.hidden_size, num_heads=heads,
                                   kv_heads=config.num_key_value_heads, head_dim=config.hidden_size // heads,
                                   intermediate=config.intermediate_size, vocab_size=config.vocab_size,
                                   draft_vocab_size=config.vocab_size, taps=(0, config.num_hidden_layers // 2),
                                   base_model=base.source))
    layer.draft_vocab.copy_(torch.arange(config.vocab_size))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in layer.named_parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, std, generator=generator)
    return layer.to(device=base.device, dtype=base.dtype).eval().requires_grad_(False)


def tiny_gguf_blocks(base: BaseModel) -> "GgufBlocks":
    """A tiny fp32 model's weights rounded to GGUF blocks as llama.cpp's converter writes them (Q4_1
    layers, a Q8_0 embedding), the model's weights set to the blocks' values in place, so the gguf
    modes of the exact engine run on it (`ExactLlama(..., blocks=...)`)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from core.engine.exact import GgufBlocks, Q4_1, Q8_0
    lean = base.engine.lean if hasattr(base.engine, "lean") else base.engine
    formats = {Q4_1: GGMLQuantizationType.Q4_1, Q8_0: GGMLQuantizationType.Q8_0}
    tensors = {}

    def rounded(name: str, weight: torch.Tensor, fmt: int) -> None:
        values = weight.detach().float().numpy()
        raw = quants.quantize(values, formats[fmt])  # [rows, row_bytes]
        with torch.no_grad():
            weight.copy_(torch.from_numpy(quants.dequantize(raw, formats[fmt]).astype(np.float32)))
        tensors[name] = (fmt, raw)

    q_rows, kv_rows = lean.num_heads * lean.head_dim, lean.kv_heads * lean.head_dim
    for i, layer in enumerate(lean.layers):
        qkv, gate_up = layer.qkv.weight, layer.gate_up.weight
        half = gate_up.shape[0] // 2
        parts = [("attn_q", qkv[:q_rows]), ("attn_k", qkv[q_rows:q_rows + kv_rows]),
                 ("attn_v", qkv[q_rows + kv_rows:]), ("attn_output", layer.out.weight),
                 ("ffn_gate", gate_up[:half]), ("ffn_up", gate_up[half:]), ("ffn_down", layer.down.weight)]
        for part, weight in parts:
            rounded(f"blk.{i}.{part}.weight", weight, Q4_1)
    rounded("token_embd.weight", lean.embed, Q8_0)
    if lean.lm_head.weight.data_ptr() != lean.embed.data_ptr():
        rounded("output.weight", lean.lm_head.weight, Q8_0)
    return GgufBlocks(tensors)


def tiny_gguf_base(mode: str, arch: str = "llama") -> BaseModel:
    """A tiny model whose exact engine runs in gguf mode `mode` ("gguf" or "gguf-q8") over its own
    weights rounded to GGUF blocks (`tiny_gguf_blocks`)."""
    from core.engine.build import load_kernels
    from core.engine.exact import ExactLlama
    from core.model import CACHE_DIR
    base = tiny_base(arch)
    engine = ExactLlama(base.engine.lean, load_kernels(CACHE_DIR), mode, blocks=tiny_gguf_blocks(base))
    object.__setattr__(base, "engine", engine)  # seeds the cached property (BaseModel is frozen)
    return base
