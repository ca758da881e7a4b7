"""Training: a tiny run lowers the loss and writes a loadable checkpoint; the calibrated tree is valid."""
from __future__ import annotations

import json

import pytest
import torch

from core.drafters.eagle import EagleConfig, EagleLayer, load_eagle
from core.drafters.hydra import HydraConfig, HydraHeads, load_hydra_heads
from core.drafters.medusa import HeadsConfig, MedusaHeads, load_heads
from offline.train import (Augment, Features, TrainConfig, calibrated_choices, depth_vocabs, extract_features,
                           frequency_vocab, head_loss, start_heads, train_heads, train_vocab)
from core.tree import fixed_tree, load_named_trees
from tests.test_tree import check_invariants


@pytest.fixture(scope="module")
def tiny_features(base_bf16) -> Features:
    rows = []
    for prompt in ["Name three colours.", "What is the capital of France?", "Write a haiku about rain."]:
        ids = base_bf16.chat_ids(prompt)
        with torch.inference_mode():
            out = base_bf16.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        rows.append({"prompt_ids": ids, "answer_ids": out[0, len(ids):].tolist()})
    return extract_features(base_bf16, rows)


def test_tiny_training_lowers_loss_and_saves(base_bf16, tiny_features, tmp_path):
    index = torch.arange(tiny_features.hidden.shape[0])
    config = TrainConfig(num_heads=3, epochs=40, batch_size=64, lr=1e-2)
    torch.manual_seed(0)
    fresh = MedusaHeads(HeadsConfig(num_heads=3))
    vocab = train_vocab(base_bf16.lm_head.weight, None)
    with torch.no_grad():
        before, _ = head_loss(fresh, [vocab] * 3, tiny_features, index, config.decay)
    heads = train_heads(base_bf16, tiny_features, config)
    with torch.no_grad():
        after, accuracy = head_loss(heads, [vocab] * 3, tiny_features, index, config.decay)
    assert after < 0.7 * before
    heads.save(tmp_path / "heads")
    loaded = load_heads(tmp_path / "heads")
    hidden = torch.randn(5, 576)
    assert torch.allclose(loaded.head_states(hidden), heads.head_states(hidden))
    assert json.loads((tmp_path / "heads" / "config.json").read_text())["num_heads"] == 3
    # the draft vocabulary: every answer token of the training data, most frequent first
    assert loaded.config.draft_vocab_size == config.draft_vocab
    assert len(set(loaded.draft_vocab.tolist())) == config.draft_vocab
    assert torch.isin(tiny_features.tokens, loaded.draft_vocab[: len(set(tiny_features.tokens.tolist()))]).all()


def test_frequency_vocab_orders_by_count_then_id():
    tokens = torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 7, 7])
    assert frequency_vocab(tokens, 6, 12).tolist() == [7, 5, 9, 2, 0, 1]


def test_calibrated_tree_is_valid_with_requested_size():
    accuracy = [[0.5, 0.6, 0.65, 0.7, 0.72], [0.3, 0.4, 0.45, 0.5, 0.52], [0.2, 0.28, 0.32, 0.35, 0.37]]
    for budget in (1, 8, 30):
        tree = fixed_tree(calibrated_choices(accuracy, budget))
        assert tree.num_nodes == budget
        check_invariants(tree)
    assert calibrated_choices(accuracy, 3) == [[0], [0, 0], [1]]


def test_shipped_calibrated_tree():
    trees = load_named_trees()
    if "calibrated" not in trees:
        pytest.fail("assets/trees.json has no calibrated tree")
    tree = fixed_tree(trees["calibrated"])
    assert tree.num_nodes == 63
    check_invariants(tree)


def _held_out_rows(base, prompts: list[str]) -> list[dict]:
    """Plain greedy answers (48 tokens) to four MT-Bench prompts: the shipped-heads guards' text."""
    rows = []
    for prompt in prompts[40:44]:
        ids = base.chat_ids(prompt)
        with torch.inference_mode():
            out = base.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
        rows.append({"prompt_ids": ids, "answer_ids": out[0, len(ids):].tolist()})
    return rows


def test_shipped_heads_load_by_default_and_predict(base_fp32, mt_bench_prompts):
    """Guard against shipping broken or mismatched weights (random heads score ~0)."""
    from core.drafters.medusa import DEFAULT_HEADS_DIR, default_heads
    from offline.train import head_accuracy
    assert (DEFAULT_HEADS_DIR / "heads.safetensors").exists(), "assets/heads is not shipped"
    heads, description = default_heads(base_fp32.model.config.hidden_size, base_fp32.model.config.vocab_size)
    assert description.startswith("trained")
    rows = _held_out_rows(base_fp32, mt_bench_prompts)
    accuracy = head_accuracy(base_fp32, heads, rows)
    assert accuracy[0][0] > 0.45, accuracy  # the shipped heads: .511 here; weaker ones scored .37-.42


def test_draft_training_vocab_matches_full_softmax_restricted():
    """Over the draft rows, the loss equals a full-vocabulary loss whose teacher drops undrafted tokens."""
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    draft = torch.tensor([3, 17, 4, 40, 0, 9])
    vocab = train_vocab(weight, draft)
    assert torch.equal(vocab.weight, weight[draft]) and vocab.index_of[40] == 3 and vocab.index_of[1] == -1
    features = Features(hidden=torch.randn(4, 8).bfloat16(), remaining=torch.tensor([3, 2, 1, 0]),
                        tokens=torch.tensor([3, 17, 4, 9]),
                        teacher_ids=torch.tensor([[3, 1], [17, 4], [4, 2], [9, 0]], dtype=torch.int32),
                        teacher_probs=torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.6, 0.4], [0.7, 0.3]]).half())
    from core.drafters.medusa import HeadsConfig, MedusaHeads
    heads = MedusaHeads(HeadsConfig(num_heads=1, hidden_size=8, vocab_size=50))
    loss, accuracy = head_loss(heads, [vocab], features, torch.tensor([0, 1, 2]), 0.8)
    # by hand: head 1 at j predicts token j+1, from the teacher at j+1
    hidden = features.hidden[:3].float()
    logits = hidden @ weight[draft].T  # [3, 6] fp32: bf16 autocast only where bf16 is fast
    log_probs = torch.log_softmax(logits, -1)
    targets = [[(1, 0.9), (2, 0.1)], [(2, 0.6)], [(5, 0.7), (4, 0.3)]]  # draft rows, token 2 is not drafted
    by_hand = []
    for row, pairs in enumerate(targets):
        mass = sum(p for _, p in pairs)
        by_hand.append(-sum(p / mass * log_probs[row, r] for r, p in pairs))
    assert torch.allclose(loss, torch.stack(by_hand).mean(), atol=1e-5)
    # accuracy: position 2's target (token 4, at row 2 of the draft) counts; an undrafted target
    # (index_of = -1) can never count as a hit, whatever the argmax
    argmax = logits.argmax(-1).tolist()
    expected_hits = [argmax[0] == 1, argmax[1] == 2, argmax[2] == 5]
    assert accuracy[0] == pytest.approx(sum(expected_hits) / 3)
    undrafted = Features(hidden=features.hidden, remaining=features.remaining, tokens=torch.tensor([3, 1, 1, 1]),
                         teacher_ids=features.teacher_ids, teacher_probs=features.teacher_probs)
    _, accuracy = head_loss(heads, [vocab], undrafted, torch.tensor([0, 1, 2]), 0.8)
    assert accuracy == [0.0]
    # a deeper head's prefix of the draft rows (`depth_vocab`): tokens past it are undrafted for it
    short = vocab.prefix(3)
    assert torch.equal(short.weight, weight[draft[:3]]) and short.index_of[4] == 2 and short.index_of[40] == -1
    loss, _ = head_loss(heads, [short], features, torch.tensor([0, 1, 2]), 0.8)
    log_probs = torch.log_softmax(hidden @ weight[draft[:3]].T, -1)  # [3, 3]
    targets = [[(1, 0.9), (2, 0.1)], [(2, 0.6)]]  # position 2's teacher (tokens 9, 0) lies past the prefix
    by_hand = [-sum(p / sum(q for _, q in pairs) * log_probs[row, r] for r, p in pairs) for row, pairs in enumerate(targets)]
    by_hand.append(torch.zeros(()))  # no teacher mass left: that row contributes nothing
    assert torch.allclose(loss, torch.stack(by_hand).mean(), atol=1e-5)
    assert depth_vocabs(vocab, (6, 3), 2)[1].weight.shape[0] == 3 and depth_vocabs(vocab, (), 2) == [vocab, vocab]


def test_shipped_hydra_heads_load_and_read_the_path(base_fp32, mt_bench_prompts):
    """Guard on the shipped Hydra heads: given the true path, depths 2-4 stay far above what
    Medusa heads reach (.18 / .12 / .09 on MT-Bench). On these four answers the shipped heads score
    .62 / .62 / .53 / .51; heads at .57 / .58 / .49 / .49 fail its depth-1 bound."""
    from core.drafters.hydra import default_hydra_heads
    from offline.train_hydra import hydra_accuracy
    heads = default_hydra_heads()
    assert heads is not None, "assets/hydra is not shipped"
    rows = _held_out_rows(base_fp32, mt_bench_prompts)
    accuracy, own = hydra_accuracy(base_fp32, heads, rows)
    top1 = [a[0] for a in accuracy]
    assert top1[0] > 0.59 and min(top1[1:]) > 0.47, top1
    assert own[0] == top1[0]  # depth 1 reads only the root: the same guess either way


def test_augment_is_off_at_zero_and_corrupts_by_the_amounts_asked():
    torch.manual_seed(0)
    inputs = torch.randn(4096, 64) * 3.0  # RMS 3
    assert torch.equal(Augment()(inputs), inputs)  # the default: training inputs untouched
    noisy = Augment(noise=0.1)(inputs)
    assert abs(float((noisy - inputs).pow(2).mean().sqrt()) - 0.3) < 0.01  # 0.1 x the inputs' RMS
    dropped = Augment(dropout=0.25)(inputs)
    zeroed = float((dropped == 0).float().mean())
    assert 0.23 < zeroed < 0.27
    kept = dropped != 0
    assert torch.allclose(dropped[kept], inputs[kept] / 0.75)  # inverted dropout: same expectation


@pytest.mark.parametrize("build, load, other", [
    (lambda **kw: MedusaHeads(HeadsConfig(hidden_size=16, vocab_size=50, draft_vocab_size=20, **kw)), load_heads,
     {"num_layers": 2}),
    (lambda **kw: HydraHeads(HydraConfig(hidden_size=16, vocab_size=50, draft_vocab_size=20, prefix_layer=True,
                                         prefix_heads=2, prefix_mlp=32, **kw)), load_hydra_heads, {"num_heads": 3}),
    (lambda **kw: EagleLayer(EagleConfig(**{"hidden_size": 16, "num_heads": 2, "kv_heads": 1, "head_dim": 8,
                                            "intermediate": 32, "vocab_size": 50, "draft_vocab_size": 20, **kw})),
     load_eagle, {"intermediate": 48}),
])
def test_training_starts_from_trained_heads_or_fresh_and_refuses_other_settings(build, load, other, tmp_path):
    torch.manual_seed(0)
    trained = build()
    with torch.no_grad():
        for weight in trained.parameters():
            weight.normal_()
    trained.draft_vocab.copy_(torch.arange(20).flip(0))
    trained.save(tmp_path / "trained")
    continued = build()
    start_heads(continued, str(tmp_path / "trained"), load, fresh_vocab=torch.arange(20))
    for name, value in trained.state_dict().items():
        assert torch.equal(continued.state_dict()[name], value), name
    fresh = build()
    start_heads(fresh, "", load, fresh_vocab=torch.arange(20))
    assert torch.equal(fresh.draft_vocab, torch.arange(20))
    assert not all(torch.equal(w, trained.state_dict()[n]) for n, w in fresh.named_parameters())
    with pytest.raises(ValueError, match="other settings"):
        start_heads(build(**other), str(tmp_path / "trained"), load, fresh_vocab=torch.arange(20))


def test_shipped_eagle_layer_loads_and_drafts_on_its_own_outputs(base_fp32, mt_bench_prompts):
    """Guard against shipping a broken or mismatched EAGLE layer (random weights score about 0): fed
    its own guesses (every state after depth 1 its own), the shipped layer scores .53 / .38 / .29 on
    these four answers (.53 / .46 / .38 given the path)."""
    from core.drafters.eagle import default_eagle
    from offline.eagle_features import extract
    from offline.train_eagle import depth_accuracy
    layer = default_eagle()
    assert layer is not None, "assets/eagle is not shipped"
    features = extract(base_fp32, _held_out_rows(base_fp32, mt_bench_prompts))
    own = depth_accuracy(layer, base_fp32, features, 3, own_guesses=True)["top1"]
    assert own[0] > 0.45 and own[2] > 0.2, own


def test_ship_heads_copies_weights_sets_decode_rows_and_calibrated_tree(tmp_path):
    from offline.ship_heads import ship_heads
    torch.manual_seed(0)
    config = HeadsConfig(num_heads=3, num_layers=2, hidden_size=32, vocab_size=200, draft_vocab_size=160,
                         depth_vocab=(160, 64, 64))
    heads = MedusaHeads(config)
    heads.draft_vocab.copy_(torch.randperm(200)[:160])
    heads.save(tmp_path / "candidate")
    (tmp_path / "candidate" / "calibrated_tree.json").write_text(json.dumps([[0], [0, 0], [1]]))
    trees_file = tmp_path / "trees.json"
    trees_file.write_text(json.dumps({"trees": {"calibrated": [[0]], "other": [[0], [1]]}}))
    ship_heads(tmp_path / "candidate", (128, 64, 64), heads_dir=tmp_path / "shipped", trees_file=trees_file)
    shipped = load_heads(tmp_path / "shipped")
    assert shipped.config == HeadsConfig(**{**config.__dict__, "depth_vocab": (128, 64, 64)})
    assert torch.equal(shipped.draft_vocab, heads.draft_vocab)
    assert torch.equal(shipped.heads.state_dict()["0.0.linear.weight"], heads.heads.state_dict()["0.0.linear.weight"])
    assert load_named_trees(trees_file) == {"calibrated": [[0], [0, 0], [1]], "other": [[0], [1]]}
    # sizes the heads cannot rank, or no calibrated tree: nothing is written
    with pytest.raises(ValueError):
        ship_heads(tmp_path / "candidate", (64, 64, 999), heads_dir=tmp_path / "bad", trees_file=trees_file)
    (tmp_path / "candidate" / "calibrated_tree.json").unlink()
    with pytest.raises(ValueError, match="calibrated_tree"):
        ship_heads(tmp_path / "candidate", (), heads_dir=tmp_path / "bad", trees_file=trees_file)
    assert not (tmp_path / "bad").exists()
