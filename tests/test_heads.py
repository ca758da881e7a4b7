"""Medusa heads: project format and both official Medusa layouts round-trip to the same outputs."""
from __future__ import annotations

import pytest
import safetensors.torch
import torch

from core.strategy import StrategySpec
from core.drafters.medusa import MIN_DEPTH_VOCAB, HeadsConfig, MedusaHeads, load_heads, load_official_medusa


def random_heads(config: HeadsConfig) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(config)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return heads.eval()


@pytest.fixture
def own_projection() -> MedusaHeads:
    return random_heads(HeadsConfig(num_heads=5, num_layers=1, hidden_size=32, vocab_size=100, own_lm_head=True))


def test_official_pt_layout(own_projection, tmp_path):
    state = own_projection.heads.state_dict()
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "4.1.weight"} <= set(state)
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    loaded = load_official_medusa(tmp_path / "medusa_lm_head.pt")
    assert loaded.config.num_heads == 5 and loaded.config.own_lm_head and loaded.config.vocab_size == 100
    hidden = torch.randn(3, 32)
    assert torch.allclose(loaded(hidden), own_projection(hidden))


def test_official_safetensors_layout_with_prefix(own_projection, tmp_path):
    state = {f"medusa_head.{k}": v.contiguous() for k, v in own_projection.heads.state_dict().items()}
    safetensors.torch.save_file(state, tmp_path / "medusa_lm_head.safetensors")
    loaded = load_official_medusa(tmp_path / "medusa_lm_head.safetensors")
    hidden = torch.randn(2, 7, 32)
    assert loaded(hidden).shape == (5, 2, 7, 100)
    assert torch.allclose(loaded(hidden), own_projection(hidden))


def test_shared_lm_head_layout_and_project_format(tmp_path):
    heads = random_heads(HeadsConfig(num_heads=3, num_layers=2, hidden_size=32, vocab_size=100))
    lm_head = torch.nn.Linear(32, 100, bias=False)
    safetensors.torch.save_file({k: v.contiguous() for k, v in heads.heads.state_dict().items()},
                                tmp_path / "medusa_lm_head.safetensors")
    official = load_official_medusa(tmp_path / "medusa_lm_head.safetensors")
    assert official.config.num_layers == 2 and not official.config.own_lm_head
    heads.save(tmp_path / "ours")
    ours = load_heads(tmp_path / "ours")
    hidden = torch.randn(4, 32)
    expected = heads(hidden, lm_head)
    assert torch.allclose(official(hidden, lm_head), expected) and torch.allclose(ours(hidden, lm_head), expected)
    with pytest.raises(ValueError, match="lm_head"):
        ours(hidden)


def test_pickled_code_is_refused(tmp_path):
    """weights_only loading: a checkpoint that carries code objects is not executed."""
    class Payload:
        def __reduce__(self):
            return (print, ("owned",))
    torch.save({"0.0.linear.weight": Payload()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_official_medusa(tmp_path / "medusa_lm_head.pt")


def test_unknown_layout_is_rejected(tmp_path):
    torch.save({"model.layers.0.weight": torch.zeros(2)}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="Medusa head layout"):
        load_official_medusa(tmp_path / "medusa_lm_head.pt")


def test_zero_initialised_heads_start_as_identity():
    heads = MedusaHeads(HeadsConfig(num_heads=2, hidden_size=8, vocab_size=10))
    hidden = torch.randn(3, 8)
    assert torch.equal(heads.head_states(hidden), torch.stack([hidden, hidden]))


def test_draft_vocabulary_round_trips_and_restricts_proposals(tmp_path):
    """Heads with a draft vocabulary rank only those tokens, with the full lm_head's logits for them."""
    config = HeadsConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=100, draft_vocab_size=10)
    heads = random_heads(config)
    heads.draft_vocab.copy_(torch.tensor([7, 3, 99, 0, 42, 11, 5, 64, 8, 21]))
    heads.save(tmp_path / "draft")
    loaded = load_heads(tmp_path / "draft")
    assert torch.equal(loaded.draft_vocab, heads.draft_vocab)
    lm_head = torch.nn.Linear(32, 100, bias=False)
    hidden = torch.randn(6, 32)
    probs, ids = loaded.propose(hidden, 4, loaded.draft_projection(lm_head))  # [3, 6, 4]
    assert probs.shape == ids.shape == (3, 6, 4)
    assert torch.isin(ids, heads.draft_vocab).all()
    # the same ranking as the full projection restricted to the draft rows
    full = heads(hidden, lm_head)[..., heads.draft_vocab]  # [3, 6, 10]
    expected = heads.draft_vocab[torch.topk(full, 4, dim=-1).indices]
    assert torch.equal(ids, expected)
    assert torch.allclose(probs, torch.topk(torch.softmax(full, -1), 4, dim=-1).values, atol=1e-6)
    # without a draft vocabulary the heads rank everything
    plain = random_heads(HeadsConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=100))
    _, all_ids = plain.propose(hidden, 4, plain.draft_projection(lm_head))
    assert torch.equal(all_ids, torch.topk(plain(hidden, lm_head), 4, dim=-1).indices)


def test_depth_vocabulary_ranks_a_prefix_per_head(tmp_path):
    """With `depth_vocab`, head d ranks the first n_d draft tokens only (softmax over those), in
    the same order as the full projection restricted to them; the sizes round-trip on disk."""
    sizes = (160, 96, MIN_DEPTH_VOCAB)
    heads = random_heads(HeadsConfig(num_heads=3, hidden_size=32, vocab_size=200, draft_vocab_size=160, depth_vocab=sizes))
    heads.draft_vocab.copy_(torch.randperm(200, generator=torch.Generator().manual_seed(1))[:160])
    heads.save(tmp_path / "d")
    loaded = load_heads(tmp_path / "d")
    assert loaded.config.depth_vocab == sizes and loaded.config == heads.config
    lm_head = torch.nn.Linear(32, 200, bias=False)
    hidden = torch.randn(6, 32)
    for projection in (loaded.draft_projection(lm_head), loaded.draft_projection(lm_head).with_measured_kernels()):
        probs, ids = loaded.propose(hidden, 8, projection)  # [3, 6, 8] each
        full = heads(hidden, lm_head)  # [3, 6, 200]
        for d, rows in enumerate(sizes):
            allowed = heads.draft_vocab[:rows]
            mine = full[d][..., allowed]  # [6, rows]
            assert torch.equal(ids[d], allowed[torch.topk(mine, 8, dim=-1).indices])
            assert torch.allclose(probs[d], torch.topk(torch.softmax(mine, -1), 8, dim=-1).values, atol=1e-5)


@pytest.mark.parametrize("num_layers, depth", [(1, None), (2, None), (3, 2), (0, None)])
def test_the_stacked_first_blocks_propose_what_each_head_proposes(num_layers, depth):
    """Every head's first ResBlock as one product (what a drafting session builds once) proposes the
    same tokens with the same probabilities as the heads run one by one, for any depth prefix."""
    heads = random_heads(HeadsConfig(num_heads=4, num_layers=num_layers, hidden_size=32, vocab_size=200))
    projection = heads.draft_projection(torch.nn.Linear(32, 200, bias=False))
    products = heads.residual_products()
    assert (products is None) == (num_layers == 0)
    if products is not None:
        assert len(products.first) == 4
        assert all(len(later) == num_layers - 1 for later in products.later)
    for hidden in (torch.randn(32), torch.randn(5, 32)):
        probs, ids = heads.propose(hidden, 8, projection, depth=depth)
        stacked_probs, stacked_ids = heads.propose(hidden, 8, projection, depth=depth, products=products)
        assert ids.shape[0] == (depth or 4) and torch.equal(stacked_ids, ids)
        assert torch.allclose(stacked_probs, probs, atol=1e-6)


@pytest.mark.parametrize("sizes,draft,match", [((100, 100), 100, "per head"), ((100, 100, 101), 100, "per head"),
                                               ((100, 100, MIN_DEPTH_VOCAB - 1), 100, "per head"),
                                               ((100, 100, 100), 0, "needs a draft vocabulary")])
def test_depth_vocabulary_is_checked(sizes, draft, match):
    with pytest.raises(ValueError, match=match):
        HeadsConfig(num_heads=3, hidden_size=8, vocab_size=200, draft_vocab_size=draft, depth_vocab=sizes)


@pytest.mark.parametrize("rows", [1, 4, 9, 40])
def test_measured_kernels_compute_the_same_logits(rows):
    """The draft projection's kernel (chosen by timing) changes the speed, not the numbers."""
    heads = random_heads(HeadsConfig(num_heads=2, hidden_size=32, vocab_size=300, draft_vocab_size=250,
                                     depth_vocab=(250, 128)))
    heads.draft_vocab.copy_(torch.arange(250))
    projection = heads.draft_projection(torch.nn.Linear(32, 300, bias=False))
    measured = projection.with_measured_kernels()
    assert set(measured.products) == {250, 128}
    states = torch.randn(rows, 32)
    widest_only = projection.with_measured_kernels((250,))  # what Medusa asks: it projects once
    assert set(widest_only.products) == {250}
    for depth in (1, 2):
        assert torch.allclose(measured.logits(states, depth), projection.logits(states, depth), atol=1e-5)
        assert torch.allclose(widest_only.logits(states, depth), projection.logits(states, depth), atol=1e-5)


def test_draft_vocabulary_size_mismatch_is_refused(tmp_path):
    heads = random_heads(HeadsConfig(num_heads=2, hidden_size=8, vocab_size=20, draft_vocab_size=4))
    heads.save(tmp_path / "h")
    config = (tmp_path / "h" / "config.json")
    config.write_text(config.read_text().replace('"draft_vocab_size": 4', '"draft_vocab_size": 5'))
    with pytest.raises(ValueError, match="draft tokens"):
        load_heads(tmp_path / "h")


def test_int8_draft_products_stay_close_and_are_kept_only_when_faster(monkeypatch):
    """Weight-only int8 (bf16 drafts on a CPU): logits within int8 rounding of bf16's, the same
    top guesses; kept only when timing says so, never for fp32 weights."""
    import core.drafters.medusa as medusa
    weight = torch.randn(300, 64).to(torch.bfloat16)  # [out, in]
    states = torch.randn(4, 64).to(torch.bfloat16)
    int8 = medusa.Int8Product.of(weight)
    exact = states.float() @ weight.float().T  # [4, 300]
    assert int8(states).shape == (4, 300) and int8(states[0]).shape == (300,)
    assert (int8(states).float() - exact).abs().max() < 0.05 * exact.abs().max()
    assert torch.equal(int8(states).float().topk(3).indices, exact.topk(3).indices)
    product = medusa.Matmul(weight, None)
    monkeypatch.setattr(medusa, "INT8_GAIN", float("inf"))  # any time wins
    assert isinstance(medusa.faster_int8(product, measured_ms=1.0), medusa.Int8Product)
    monkeypatch.setattr(medusa, "INT8_GAIN", 0.0)  # no time wins
    assert medusa.faster_int8(product, measured_ms=1.0) is product
    monkeypatch.setattr(medusa, "INT8_GAIN", float("inf"))
    fp32 = medusa.Matmul(weight.float(), None)
    assert medusa.faster_int8(fp32, measured_ms=1.0) is fp32


def test_greedy_with_int8_bf16_drafts_stays_exact(monkeypatch):
    """fp32 decoding whose heads draft in bf16 through int8 products still equals plain greedy (the lean
    forward's drafts; on the exact engine drafts go through its kernels, tests/test_exact.py)."""
    import core.drafters.interface as interface
    import core.drafters.medusa as medusa
    from core.decoder import DecodeConfig, decode
    from tests.tiny import greedy_reference, tiny_base, tiny_heads, tiny_hydra
    monkeypatch.setattr(interface, "drafting_dtype", lambda base, **how: torch.bfloat16)
    monkeypatch.setattr(medusa, "INT8_GAIN", float("inf"))
    base = tiny_base("llama", engine="lean")
    prompt = list(b"the cat sat on the mat and the cat sat on the")
    expected = greedy_reference(base, prompt, 32)
    for heads, strategy in ((tiny_heads(base, seed=3), "dynamic"), (tiny_hydra(base, seed=3), "hydra")):
        session = decode(base, heads, prompt, DecodeConfig(spec=StrategySpec(strategy).with_budget(16), max_new_tokens=32, top_m=8))
        assert session.output_ids == expected
        products = session.heads_drafter.projection.products.values()
        assert products and all(isinstance(p, medusa.Int8Product) for p in products)
