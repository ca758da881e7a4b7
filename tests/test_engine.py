"""The lean forward (core.engine): the same maths as transformers' forward, on tiny random models.

Hidden states equal transformers' within float rounding for a prefill, a plain step and a tree
verify; every projection kernel gives the same result; the static cache after accept, reject
and context-limit pruning equals transformers' DynamicCache after the same steps; greedy tree
decoding on it equals `generate`; continuous batching answers what one-by-one greedy decoding
answers, whatever the order rows finish and are refilled in.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from offline.datagen import ContinuousBatcher
from core.decoder import DecodeConfig, decode, start_session
from core.strategy import StrategySpec
from core.engine import (BUCKET_TIMING_ROWS, LEAN_MODEL_TYPES, ROW_BUCKETS, LeanLlama, Matmul, StaticCache, fastest,
                         time_kernels)
from core.kvcache import keep_accepted, truncate
from core.model import ModelConfig
from core.tree import dynamic_tree
from tests.tiny import greedy_reference, tiny_base, tiny_heads, tiny_model, wrap

PROMPT = list(range(10, 40))
ATOL = 2e-5  # fp32 rounding of a differently ordered sum, on activations of order 1-10


def _pair(arch: str = "llama", **overrides):
    """The same tiny model on both forwards."""
    model = tiny_model(arch, **overrides)
    return wrap(model, engine="lean", name=f"lean-{arch}"), wrap(model, engine="hf", name=f"hf-{arch}")


def _tree_mask(size: int, seed: int) -> torch.Tensor:
    """The attention mask of a random dynamic tree of `size` nodes with the root."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(3, 6, generator=generator).sort(descending=True).values
    return dynamic_tree(probs / probs.sum(-1, keepdim=True), size - 1).buffers()


@pytest.mark.parametrize("arch", sorted(LEAN_MODEL_TYPES))
def test_hidden_states_equal_transformers(arch: str):
    lean, hf = _pair(arch)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        reference = hf.model.model(input_ids=ids[None]).last_hidden_state[0]  # [T, H]
        cache = lean.new_cache()
        prefill = lean.engine.forward(ids[:-1], torch.arange(len(ids) - 1), cache)
        step = lean.engine.forward(ids[-1:], torch.tensor([len(ids) - 1]), cache)
    assert isinstance(cache, StaticCache) and cache.get_seq_length() == len(ids)
    assert torch.allclose(prefill, reference[:-1], atol=ATOL)
    assert torch.allclose(step[0], reference[-1], atol=ATOL)


@pytest.mark.parametrize("size", [2, 7, 16, 40])
def test_tree_verify_equals_transformers_tree_verify(size: int):
    from core.verify import verify_tree
    lean, hf = _pair()
    buffers = _tree_mask(size, seed=size)
    tokens = torch.arange(50, 50 + buffers.attn_mask.shape[0])
    outputs = []
    for base in (lean, hf):
        cache = base.new_cache()
        with torch.inference_mode():
            from core.verify import forward_tokens
            forward_tokens(base, cache, torch.tensor(PROMPT), torch.arange(len(PROMPT)))
            out = verify_tree(base, cache, tokens, buffers.attn_mask, buffers.position_ids)
            outputs.append(out.logits(list(range(len(tokens)))))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-4)


def test_every_kernel_gives_the_same_result():
    lean, _ = _pair()
    engine: LeanLlama = lean.engine
    ids = torch.arange(5, 5 + 40)
    results = {}
    for kernel in ("linear", "wxt", "mkldnn"):
        if kernel == "mkldnn" and not torch.backends.mkldnn.is_available():
            continue
        engine.apply_kernels({bucket: kernel for bucket in ROW_BUCKETS})
        with torch.inference_mode():
            cache = engine.new_cache()
            hidden = engine.forward(ids, torch.arange(len(ids)), cache)  # 40 rows: the largest bucket
            step = engine.forward(ids[:1], torch.tensor([len(ids)]), cache)  # 1 row
            tree = engine.forward(ids[:5], torch.arange(41, 46), cache)  # 5 rows
        results[kernel] = torch.cat([hidden, step, tree])
    first = next(iter(results.values()))
    assert len(results) >= 3
    assert all(torch.allclose(first, other, atol=ATOL) for other in results.values())


def test_kernel_choice_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr("core.engine.lean.measured_quietly", lambda *ms: True)
    lean, _ = _pair()
    engine = lean.engine
    engine.load_or_choose_kernels(tmp_path)
    saved = list(tmp_path.glob("*.json"))
    assert len(saved) == 1
    chosen = [dict(m.kernels) for m in engine.matmuls()]
    assert set(engine.kernel_report) == {"qkv", "out", "gate_up", "down", "lm_head"}
    assert all(set(by_bucket) == set(ROW_BUCKETS) for by_bucket in engine.kernel_report.values())
    fresh = LeanLlama(lean.model)
    monkeypatch.setattr(LeanLlama, "choose_kernels", lambda self: pytest.fail("measured twice"))
    fresh.load_or_choose_kernels(tmp_path)  # read back, not re-measured
    assert [dict(m.kernels) for m in fresh.matmuls()] == chosen


def test_small_trees_get_the_kernel_timed_at_their_own_row_count(monkeypatch):
    """Each bucket is timed at its own rows: a 2-row verify must not run the 8-row winner (round
    18: on a Xeon with AMX the 8-row winners made a 2-row fp32 verify's products 1.6x `linear`'s)."""
    timed = []

    def fake_time(matmuls, kernel, bucket, rows, repeats):
        timed.append((bucket, rows))
        return {"linear": 1.0 if rows <= 2 else 3.0, "wxt": 2.0}.get(kernel, 9.0)

    monkeypatch.setattr("core.engine.lean._time_kernel", fake_time)
    lean, _ = _pair()
    lean.engine.choose_kernels()
    assert set(timed) == set(BUCKET_TIMING_ROWS.items())
    down = lean.engine.layers[0].down
    assert down.kernels[2] == "linear" and down.kernels[8] == "wxt"
    used = []
    monkeypatch.setattr(torch, "mm", lambda *args: used.append("wxt") or torch.ops.aten.mm(*args))
    with torch.inference_mode():
        down(torch.randn(2, down.weight.shape[1]))
        assert used == []
        down(torch.randn(5, down.weight.shape[1]))
        assert used == ["wxt"]


def test_a_kernel_choice_measured_on_a_busy_machine_is_used_but_not_cached(tmp_path, monkeypatch):
    monkeypatch.setattr("core.engine.lean.measured_quietly", lambda *ms: False)
    lean, _ = _pair()
    lean.engine.load_or_choose_kernels(tmp_path)
    assert not list(tmp_path.glob("*.json"))
    assert set(lean.engine.kernel_report) == {"qkv", "out", "gate_up", "down", "lm_head"}
    assert lean.engine.layers[0].down.kernels == fastest(lean.engine.kernel_report["down"])  # used all the same


def _dynamic_snapshot(cache: DynamicCache) -> torch.Tensor:
    return torch.stack([torch.stack([layer.keys, layer.values]) for layer in cache.layers])  # [L, 2, 1, kvh, S, d]


def _static_snapshot(cache: StaticCache) -> torch.Tensor:
    end = cache.get_seq_length()
    return torch.stack([cache.keys[:, :, :, :end], cache.values[:, :, :, :end]], dim=1)  # [L, 2, 1, kvh, S, d]


def test_static_cache_equals_dynamic_cache_after_accept_reject_and_pruning():
    """Same verifies and commits on both caches: equal contents (float rounding) at every point."""
    from core.verify import forward_tokens, verify_tree
    lean, hf = _pair()
    caches = [lean.new_cache(capacity=8), hf.new_cache()]  # a small capacity: the static one must grow
    bases = (lean, hf)
    with torch.inference_mode():
        for base, cache in zip(bases, caches):
            forward_tokens(base, cache, torch.tensor(PROMPT), torch.arange(len(PROMPT)))
        for seed, keep in ((1, [0, 1, 3]), (2, [0]), (3, [0, 2, 5, 9])):
            buffers = _tree_mask(12, seed)
            tokens = torch.arange(60, 60 + buffers.attn_mask.shape[0])
            context = caches[0].get_seq_length()
            for base, cache in zip(bases, caches):
                verify_tree(base, cache, tokens, buffers.attn_mask, buffers.position_ids)
            rejected = seed == 2  # a verify that is not committed (the fixed-tree comparison)
            for cache in caches:
                if rejected:
                    truncate(cache, context)
                else:
                    keep_accepted(cache, context, torch.tensor(keep))
            assert caches[0].get_seq_length() == caches[1].get_seq_length()
            assert torch.allclose(_static_snapshot(caches[0]), _dynamic_snapshot(caches[1]), atol=ATOL)
        for cache in caches:  # pruned back, as a run near the context limit does
            truncate(cache, len(PROMPT) + 2)
        assert torch.allclose(_static_snapshot(caches[0]), _dynamic_snapshot(caches[1]), atol=ATOL)


@pytest.mark.parametrize("engine", ["lean", "hf"])
@pytest.mark.parametrize("strategy", ["autoregressive", "dynamic", "fixed"])
def test_greedy_decoding_on_either_forward_equals_generate(engine: str, strategy: str):
    base = tiny_base("llama", engine=engine)
    assert base.engine_name == engine
    heads = tiny_heads(base)
    plain = greedy_reference(base, PROMPT, 40)
    config = DecodeConfig(spec=StrategySpec(strategy).with_budget(15), max_new_tokens=40)
    assert decode(base, heads if strategy != "autoregressive" else None, PROMPT, config).output_ids == plain


def test_a_forked_session_keeps_its_own_static_cache():
    base = tiny_base("llama")
    session = start_session(base, tiny_heads(base), PROMPT, DecodeConfig(spec="dynamic", max_new_tokens=30))
    session.step()
    twin = session.fork(seed=1)
    for _ in range(3):
        twin.step()
    rest = list(session.run())
    assert rest and session.output_ids[: len(twin.output_ids)] == twin.output_ids


def test_lean_engine_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="lean"):
        wrap(tiny_model("phi3"), engine="lean").engine
    assert wrap(tiny_model("phi3")).engine is None  # auto: transformers' forward
    with pytest.raises(ValueError, match="engine"):
        ModelConfig(engine="fast")


def test_continuous_batching_answers_what_one_by_one_greedy_answers():
    """Two slots, seven prompts of different lengths, an EOS that ends some answers early: slots are
    refilled out of order and every answer equals plain greedy decoding of its prompt alone."""
    prompts = [list(range(20 + i, 26 + 3 * i)) for i in range(7)]
    model = tiny_model("llama")
    free = [greedy_reference(wrap(model), ids, 24) for ids in prompts]
    # EOS := a token that some answers write early and others late or never
    counts = torch.bincount(torch.tensor([t for answer in free for t in answer[2:20]]))
    eos = int(counts.argmax())
    model.generation_config.eos_token_id = eos
    base = wrap(model)
    assert base.eos_token_ids == {eos}
    batcher = ContinuousBatcher(base, 24, slots=2, max_prompt_tokens=40)
    finished = list(batcher.run(list(enumerate(prompts))))
    assert sorted(done.key for done in finished) == list(range(7))
    order = [done.key for done in finished]
    for done in finished:
        assert done.answer == greedy_reference(base, prompts[done.key], 24)
        assert len(done.features.hidden) == len(done.answer)
    lengths = [len(done.answer) for done in finished]
    assert len(set(lengths)) > 1 or order != sorted(order)  # rows really finished at different times


@pytest.mark.parametrize("fp32_ms, bf16_ms, tree_ratio, expected", [
    (10.0, 5.0, 1.5, "bf16"), (10.0, 9.0, 1.5, "fp32"), (10.0, 50.0, 1.5, "fp32"),
    (10.0, 5.0, 0.4, "fp32"),  # a faster plain step but slower trees (AVX2 without bf16 instructions)
    (10.0, 5.0, 1.19, "fp32"),  # trees only a little faster: not clearly, so the exact precision stays
])
def test_default_precision_is_decided_by_measurement_and_cached(tmp_path, monkeypatch, fp32_ms, bf16_ms, tree_ratio,
                                                                 expected):
    import core.precision
    timings = {(torch.float32, 1): fp32_ms, (torch.bfloat16, 1): bf16_ms,
               (torch.float32, 8): 20.0, (torch.bfloat16, 8): 20.0 / tree_ratio}
    monkeypatch.setattr(core.precision.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(core.precision, "_exact_kernels", lambda: None)  # the rule without the exact kernels
    monkeypatch.setattr(core.precision, "_time_products", lambda dtype, rows=1: timings[dtype, rows])
    choice = core.precision.precision_choice.__wrapped__(tmp_path)
    assert choice.dtype == expected and expected in choice.describe()
    monkeypatch.setattr(core.precision, "_time_products", lambda dtype, rows=1: pytest.fail("measured twice"))
    assert core.precision.precision_choice.__wrapped__(tmp_path) == choice  # read back from the cache


def test_a_precision_measured_on_a_busy_machine_is_used_but_not_cached(tmp_path, monkeypatch):
    """Two timings of the same fp32 products that disagree say something competed for the cores."""
    import core.precision
    fp32_samples = iter([10.0, 18.0])  # the plain step's products, then the same products again
    timings = {(torch.bfloat16, 1): 140.0, (torch.float32, 8): 20.0, (torch.bfloat16, 8): 10.0}
    monkeypatch.setattr(core.precision.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(core.precision, "_exact_kernels", lambda: None)
    monkeypatch.setattr(core.precision, "_time_products",
                        lambda dtype, rows=1: next(fp32_samples) if (dtype, rows) == (torch.float32, 1)
                        else timings[dtype, rows])
    choice = core.precision.precision_choice.__wrapped__(tmp_path)
    assert choice.dtype == "fp32" and not list(tmp_path.rglob("*.json"))  # this run decides; nothing is kept


@pytest.mark.parametrize("times, expected", [
    ({"fp32": (5.0, 9.0), "bf16": (4.6, 9.0), "gguf": (4.4, 8.7), "gguf-q8": (4.5, 9.0)}, "gguf"),
    ({"fp32": (5.0, 9.0), "bf16": (14.6, 21.0), "gguf": (7.0, 12.0), "gguf-q8": (6.0, 12.0)}, "fp32"),
    ({"fp32": (9.0, 12.0), "bf16": (5.0, 7.0), "gguf": (6.0, 9.0), "gguf-q8": (5.5, 8.0)}, "bf16"),
    ({"fp32": (25.6, 30.0), "bf16": (12.6, 17.6), "gguf": (8.9, 22.3), "gguf-q8": (4.9, 16.9)}, "gguf-q8"),
])
def test_with_exact_kernels_the_fastest_precision_is_the_default(tmp_path, monkeypatch, times, expected):
    """Every precision is exact on the kernels, so the one whose plain step plus small tree costs least wins."""
    import core.precision
    monkeypatch.setattr(core.precision.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(core.precision, "_exact_kernels", lambda: object())
    monkeypatch.setattr("core.engine.exact.time_modes",
                        lambda kernels, shapes, **options: {mode: {1: one, 8: eight} for mode, (one, eight) in times.items()})
    choice = core.precision.precision_choice.__wrapped__(tmp_path)
    assert choice.exact and choice.dtype == expected and "every precision is exact" in choice.describe()


@pytest.mark.parametrize("fp32_ms, bf16_ms, tree_ratio, lab, batched", [
    (12.2, 13.2, 1.90, "fp32", True),  # a Xeon with AMX: a plain step memory bound, many rows fast
    (10.0, 5.0, 1.5, "bf16", True), (10.0, 5.0, 0.4, "fp32", False),  # AVX2 without bf16 instructions
])
def test_batched_work_takes_bf16_where_many_row_products_are_fast(monkeypatch, fp32_ms, bf16_ms, tree_ratio, lab,
                                                                  batched):
    """Feature extraction and training follow the 8-row products, the lab's default both."""
    import core.precision
    choice = core.precision.PrecisionChoice(dtype=lab, fp32_ms=fp32_ms, bf16_ms=bf16_ms, device="cpu",
                                        fp32_tree_ms=20.0, bf16_tree_ms=20.0 / tree_ratio)
    monkeypatch.setattr(core.precision, "precision_choice", lambda: choice)
    assert core.precision.fast_bf16() == (lab == "bf16")
    assert core.precision.fast_bf16_batched() == batched


@pytest.mark.parametrize("torch_ratio, batched", [(0.34, False), (1.9, True)])
def test_batched_torch_work_follows_torchs_own_products_where_the_kernels_decided(monkeypatch, torch_ratio, batched):
    """With the exact kernels the lab's precision comes from the kernels, but drafters' layers, feature
    extraction and training multiply in torch: they take bf16 by torch's own 8-row products (on an AVX2
    EPYC the kernels' bf16 ran 2x fp32, torch's 0.34x), never by the kernels'."""
    import core.precision
    choice = core.precision.PrecisionChoice(dtype="gguf-q8", fp32_ms=4.8, bf16_ms=3.0, device="cpu", exact=True,
                                        fp32_tree_ms=9.8, bf16_tree_ms=4.7, torch_fp32_tree_ms=10.0,
                                        torch_bf16_tree_ms=10.0 / torch_ratio)
    monkeypatch.setattr(core.precision, "precision_choice", lambda: choice)
    assert choice.tree_speedup > core.precision.BF16_MIN_SPEEDUP  # the kernels' bf16 is fast either way
    assert core.precision.fast_bf16_batched() == batched


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_bf16_drafting_under_an_fp32_base_stays_exact(monkeypatch, family: str):
    """Where bf16 is fast the heads draft in bf16 even for an fp32 run: the drafts change, the
    fp32 verify keeps the output equal to plain greedy."""
    import core.drafters.interface
    from tests.tiny import tiny_hydra
    monkeypatch.setattr(core.drafters.interface, "fast_bf16_batched", lambda: True)
    base = tiny_base("llama")
    heads = tiny_heads(base) if family == "medusa" else tiny_hydra(base)
    drafting, _, dtype = core.drafters.interface.heads_for_drafting(heads, base)
    assert dtype == torch.bfloat16 and next(drafting.parameters()).dtype == torch.bfloat16
    assert next(heads.parameters()).dtype == torch.float32  # the shared heads are never changed
    strategy = "dynamic" if family == "medusa" else "hydra"
    session = decode(base, heads, PROMPT, DecodeConfig(spec=StrategySpec(strategy).with_budget(15), max_new_tokens=40))
    assert session.output_ids == greedy_reference(base, PROMPT, 40)
    assert any(len(r.outcome.accepted_nodes) > 1 for r in session.records) or family == "hydra"


def test_no_kernel_is_timed_or_run_on_a_worker_thread():
    """A product on a worker thread opens a second OpenMP team, after which every forward of the
    process ran about 1.8x slower (bf16 on an AMD EPYC, fp32 on an Intel Xeon): the split GEMV is never a candidate, and an older cached choice of it runs as linear."""
    import threading
    for weight in (torch.randn(64, 16), torch.randn(64, 16).bfloat16()):
        matmul = Matmul(weight, None)
        before = threading.active_count()
        assert "split" not in time_kernels([matmul], {1: 1, 8: 8}, repeats=1)[1]
        assert threading.active_count() == before
        matmul.use_kernels({1: "split"})
        assert matmul.kernels[1] == "linear"


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 1, 3, 5], [0, 2], [0, 4, 5]])
def test_static_cache_keep_equals_a_gather_of_the_kept_rows(keep):
    """The commit copies only rows out of place (a root-only or first-children path stays put), and the
    cache then holds the prefix and the kept tree rows in order, as a full gather would."""
    prefix, nodes = 10, 6
    cache = StaticCache(2, 2, 4, dtype=torch.float32, device=torch.device("cpu"), limit=64, capacity=32)
    with torch.inference_mode():  # the cache's tensors are inference tensors, as a forward writes them
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=torch.Generator().manual_seed(0)))
        cache.values.copy_(torch.randn(cache.values.shape, generator=torch.Generator().manual_seed(1)))
    cache.length = prefix + nodes
    rows = list(range(prefix)) + [prefix + node for node in keep]
    expected_keys, expected_values = cache.keys[:, :, :, rows].clone(), cache.values[:, :, :, rows].clone()
    cache.keep(prefix, torch.tensor(keep))
    assert cache.get_seq_length() == prefix + len(keep)
    assert torch.equal(cache.keys[:, :, :, :prefix + len(keep)], expected_keys)
    assert torch.equal(cache.values[:, :, :, :prefix + len(keep)], expected_values)
