"""Hydra heads: on-disk format, the grown tree's invariants, the path really conditions the
guess, greedy exactness of `hydra` strategies, and the training loss (tiny in-process models)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from core.decoder import DecodeConfig, decode
from core.strategy import StrategySpec
from core.drafters.hydra import HydraConfig, HydraHeads, grow_tree, load_hydra_heads
from core.records import StepKind
from offline.train import Features, draft_loss, train_vocab
from offline.train_hydra import hydra_loss
from tests.tiny import greedy_reference, tiny_base, tiny_heads, tiny_hydra

PROMPT = list(b"the cat sat on the mat and the cat sat on the")


@pytest.fixture(scope="module")
def base():
    return tiny_base("llama")


@pytest.fixture(scope="module")
def hydra(base):
    return tiny_hydra(base)


def test_save_and_load_round_trip(hydra, tmp_path):
    hydra.save(tmp_path)
    loaded = load_hydra_heads(tmp_path)
    assert loaded.config == hydra.config
    assert torch.equal(loaded.draft_vocab, hydra.draft_vocab)
    for mine, theirs in zip(hydra.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(mine, theirs)


def test_medusa_folder_is_not_hydra(base, tmp_path):
    tiny_heads(base).save(tmp_path)
    with pytest.raises(ValueError, match="hydra weights"):
        load_hydra_heads(tmp_path)


def test_fresh_head_ignores_the_path():
    """Zero-initialised mixing: a fresh Hydra head is the identity, whatever the path."""
    heads = HydraHeads(HydraConfig(num_heads=2, hidden_size=8, vocab_size=16, draft_vocab_size=0))
    hidden = torch.randn(3, 8)
    for depth in (1, 2):
        out = heads.head_state(depth, hidden, torch.randn(3, depth, 8))
        assert torch.equal(out, hidden)


@pytest.mark.parametrize("budget,beam", [(1, 1), (10, 4), (40, 8), (63, 16)])
def test_grown_tree_is_a_best_first_tree(base, hydra, budget, beam):
    hidden = torch.randn(base.model.config.hidden_size)
    grown = grow_tree(hydra, base.model.get_input_embeddings(), hydra.draft_projection(base.lm_head), hidden, 65,
                      budget=budget, width=8, beam=beam, depth=4)
    tree = grown.tree
    assert tree.num_nodes == budget
    assert tree.scores == sorted(tree.scores, reverse=True)
    seen = set()
    for path, score in zip(tree.paths, tree.scores):
        assert len(path) == 1 or path[:-1] in seen  # parents first
        seen.add(path)
    # each (parent, token) appears once: no token is verified twice under one parent
    table = grown.token_table.tolist()
    pairs = [(p[:-1], table[len(p) - 1][p[-1]]) for p in tree.paths]
    assert len(pairs) == len(set(pairs))
    assert grown.token_ids.shape[0] == 4


def test_children_depend_on_the_path(base):
    """Siblings' subtrees differ: the guesses after a node read that node's token."""
    hydra = tiny_hydra(base, std=0.5)
    hidden = torch.randn(base.model.config.hidden_size)
    grown = grow_tree(hydra, base.model.get_input_embeddings(), hydra.draft_projection(base.lm_head), hidden, 65,
                      budget=200, width=4, beam=4, depth=2)
    table = grown.token_table.tolist()
    children: dict[tuple, list[int]] = {}
    for path in grown.tree.paths:
        if len(path) == 2:
            children.setdefault(path[:1], []).append(table[1][path[1]])
    assert len(children) >= 2
    assert len({tuple(sorted(c)) for c in children.values()}) > 1


@pytest.mark.parametrize("spec", [StrategySpec("hydra", budget=12), StrategySpec("hydra", budget=40, auto=True),
                                  StrategySpec("hydra", budget=20, lookup=True)])
def test_hydra_greedy_fp32_equals_generate(base, hydra, spec):
    expected = greedy_reference(base, PROMPT, 48)
    session = decode(base, hydra, PROMPT, DecodeConfig(spec=spec, max_new_tokens=48, top_m=8, lookup_tokens=8))
    assert session.output_ids == expected
    assert all(r.family == "hydra" for r in session.records) and any(r.kind == StepKind.TREE for r in session.records)


def test_depth_vocabulary_limits_each_depth_and_stays_exact(base, hydra):
    """Hydra heads with `depth_vocab` grow nodes at depth d from the first n_d draft tokens only,
    and decoding with them still equals plain greedy."""
    sizes = (256, 128, 96, 64)
    limited = tiny_hydra(base)
    limited.config = dataclasses.replace(limited.config, depth_vocab=sizes)
    grown = grow_tree(limited, base.model.get_input_embeddings(), limited.draft_projection(base.lm_head),
                      torch.randn(base.model.config.hidden_size), 65, budget=60, width=3, beam=3, depth=4)
    table = grown.token_table.tolist()
    for path in grown.tree.paths:
        assert table[len(path) - 1][path[-1]] in limited.draft_vocab[: sizes[len(path) - 1]].tolist()
    assert max(len(p) for p in grown.tree.paths) == 4
    expected = greedy_reference(base, PROMPT, 32)
    session = decode(base, limited, PROMPT, DecodeConfig(spec="hydra:24", top_m=8, max_new_tokens=32))
    assert session.output_ids == expected


def test_hydra_strategy_refuses_medusa_heads(base):
    with pytest.raises(ValueError, match="Hydra heads"):
        decode(base, tiny_heads(base), PROMPT, DecodeConfig(spec="hydra", max_new_tokens=4))


def test_hydra_loss_reads_the_true_path():
    """Head k at j learns answer[j+k] from the embeddings of answer[j..j+k-1]; positions
    whose target lies past the answer's end are not trained on."""
    torch.manual_seed(0)
    hidden_size, vocab_size = 8, 20
    heads = HydraHeads(HydraConfig(num_heads=2, hidden_size=hidden_size, vocab_size=vocab_size, draft_vocab_size=0))
    for head in heads.heads:
        torch.nn.init.normal_(head.mix.weight, std=0.3)
    weight = torch.randn(vocab_size, hidden_size)
    embed = torch.randn(vocab_size, hidden_size)
    vocab = train_vocab(weight, None)
    tokens = torch.tensor([5, 6, 7, 8])
    features = Features(hidden=torch.randn(4, hidden_size).bfloat16(), remaining=torch.tensor([3, 2, 1, 0]),
                        tokens=tokens, teacher_ids=tokens[:, None].int(), teacher_probs=torch.ones(4, 1).half())
    index = torch.tensor([0, 1, 2, 3])
    loss, _ = hydra_loss(heads, [vocab] * 2, embed, features, index, decay=0.5)
    by_hand = torch.zeros(())
    for k, decay in ((1, 1.0), (2, 0.5)):
        rows = torch.tensor([j for j in range(4) if j + k <= 3])
        path = torch.stack([tokens[rows + i] for i in range(k)], dim=-1)  # [b, k]
        states = heads.head_state(k, features.hidden[rows].float(), embed[path])
        part, _ = draft_loss(states, vocab, features, rows + k)
        by_hand = by_hand + decay * part
    assert torch.allclose(loss, by_hand)
    # the targets by hand: head 2 at j=0 predicts token 7 from the path (5, 6)
    states = heads.head_state(2, features.hidden[:1].float(), embed[torch.tensor([[5, 6]])])
    logits = states @ weight.T
    manual = -torch.log_softmax(logits, -1)[0, 7]
    part, _ = draft_loss(states, vocab, features, torch.tensor([2]))
    assert torch.allclose(part, manual, atol=1e-5)


def test_hydra_steps_draw_in_every_view(base, hydra):
    """A Hydra step's tree, verification table and heads table render, naming Hydra's nodes as
    children of their parent (not as ranks of a shared head table)."""
    from viz.text_html import heads_html
    from viz.tree_plot import tree_figure
    from viz.verify_view import verification_html
    session = decode(base, hydra, PROMPT, DecodeConfig(spec="hydra:20", top_m=6, max_new_tokens=12))
    record = max(session.records, key=lambda r: r.outcome.tree.num_nodes)
    assert record.outcome.grown and record.outcome.tree.num_nodes == 20
    ranks = record.outcome.sibling_ranks()
    parents = record.outcome.tree.parents
    for node in range(1, len(ranks)):  # sibling ranks follow the scores under each parent
        siblings = [n for n in range(1, len(ranks)) if parents[n] == parents[node]]
        assert sorted(ranks[n] for n in siblings) == list(range(len(siblings)))
    figure = tree_figure(record.outcome, "Hydra", "", None)
    assert len(figure.data) > 0
    assert "Hydra head 1, child" in verification_html(record, greedy=True)
    assert "Hydra heads read the path" in heads_html(record)


# -- Hydra++'s prefix layer ---------------------------------------------------------------------

def test_fresh_prefix_layer_is_the_identity():
    heads = HydraHeads(HydraConfig(num_heads=2, hidden_size=8, vocab_size=16, draft_vocab_size=0,
                                   prefix_layer=True, prefix_heads=2, prefix_mlp=16))
    hidden = torch.randn(5, 8)
    assert torch.equal(heads.context_states(hidden), hidden)
    out, cache = heads.prefix.extend(None, hidden)
    assert torch.equal(out, hidden) and cache.length == 5


def test_prefix_cache_extended_step_by_step_equals_one_causal_pass(base):
    """What decoding computes (the cache extended by each step's accepted positions) is what
    training and evaluation compute (one causal pass over the answer), and padding changes nothing."""
    prefix = tiny_hydra(base, prefix_layer=True).prefix
    hidden = torch.randn(11, base.model.config.hidden_size)
    whole = prefix(hidden[None])[0]  # [11, H]
    cache, pieces = None, []
    for start, end in ((0, 1), (1, 4), (4, 5), (5, 11)):
        out, cache = prefix.extend(cache, hidden[start:end])
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-5)
    assert not torch.allclose(whole[5:], hidden[5:], atol=1e-3)  # a random layer really mixes the past
    padded = torch.zeros(2, 14, hidden.shape[1])
    padded[0, :11], padded[1, :6] = hidden, hidden[:6]
    rows = prefix(padded, torch.tensor([11, 6]))
    assert torch.allclose(rows[0, :11], whole, atol=1e-5) and torch.allclose(rows[1, :6], whole[:6], atol=1e-5)


def test_prefix_layer_saves_loads_and_refuses_a_mismatch(base, tmp_path):
    heads = tiny_hydra(base, prefix_layer=True)
    heads.save(tmp_path / "with")
    loaded = load_hydra_heads(tmp_path / "with")
    assert loaded.config.prefix_layer and loaded.config == heads.config
    for mine, theirs in zip(heads.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(mine, theirs)
    import json
    config = json.loads((tmp_path / "with" / "config.json").read_text())
    config["prefix_layer"] = False
    (tmp_path / "with" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="prefix"):
        load_hydra_heads(tmp_path / "with")


@pytest.mark.parametrize("spec", [StrategySpec("hydra", budget=12), StrategySpec("hydra", budget=40, auto=True),
                                  StrategySpec("hydra", budget=20, lookup=True)])
def test_hydra_with_a_prefix_layer_stays_exact_and_reads_the_whole_answer(base, spec):
    """fp32 greedy with prefix-layer heads equals plain greedy; the drafter's prefix cache holds
    one position per answer token so far (the prefill's last, then every accepted one), and the
    heads' trees differ from those of the same heads without the layer."""
    heads = tiny_hydra(base, prefix_layer=True)
    expected = greedy_reference(base, PROMPT, 40)
    session = decode(base, heads, PROMPT, DecodeConfig(spec=spec, max_new_tokens=40, top_m=8, lookup_tokens=8))
    assert session.output_ids == expected
    drafter = session.heads_drafter
    assert sum(len(chunk) for chunk in session.hidden_history) == len(session.output_ids)
    assert drafter.prefix_cache is not None and drafter.prefix_cache.length <= len(session.output_ids)
    plain = tiny_hydra(base)  # the same heads (same seed) without the prefix layer
    without = decode(base, plain, PROMPT, DecodeConfig(spec=spec, max_new_tokens=40, top_m=8, lookup_tokens=8))
    assert without.output_ids == expected
    trees = lambda s: [r.outcome.node_tokens for r in s.records]  # noqa: E731
    assert trees(session) != trees(without)


def test_sessions_without_a_prefix_layer_keep_no_hidden_states(base, hydra):
    session = decode(base, hydra, PROMPT, DecodeConfig(spec="hydra", max_new_tokens=8, top_m=8))
    assert not session.keeps_history and session.hidden_history == []


def test_hydra_loss_trains_the_prefix_layer():
    """With a prefix layer the loss runs the layer causally over each answer in the batch and
    its gradient reaches the layer (zero-initialised outputs get it first)."""
    heads = HydraHeads(HydraConfig(num_heads=2, hidden_size=8, vocab_size=16, draft_vocab_size=0,
                                   prefix_layer=True, prefix_heads=2, prefix_mlp=16))
    count = 12  # two answers of 7 and 5 positions
    remaining = torch.cat([torch.arange(6, -1, -1), torch.arange(4, -1, -1)])
    features = Features(hidden=torch.randn(count, 8).to(torch.bfloat16), remaining=remaining,
                        tokens=torch.randint(0, 16, (count,)), teacher_ids=torch.randint(0, 16, (count, 4)).int(),
                        teacher_probs=torch.full((count, 4), 0.25).half())
    vocab = train_vocab(torch.randn(16, 8), None)
    loss, _ = hydra_loss(heads, [vocab, vocab], torch.randn(16, 8), features, torch.arange(count), 0.8)
    loss.backward()
    assert heads.prefix.out.weight.grad is not None and heads.prefix.out.weight.grad.abs().sum() > 0
    assert heads.prefix.down.weight.grad.abs().sum() > 0


def test_training_with_a_prefix_layer_learns_saves_and_evaluates(base, tmp_path):
    """A few steps of `train_hydra` with the prefix layer on a tiny model's own answers: batches
    follow whole answers or stretches of 5 positions of them, the loss falls, the layer moves off
    the identity, and the saved heads load and evaluate through it."""
    from offline.train import TrainConfig, extract_features
    from offline.train_hydra import answer_order, hydra_accuracy, train_hydra
    generator = torch.Generator().manual_seed(3)
    rows = [{"prompt_ids": torch.randint(0, 200, (6,), generator=generator).tolist(),
             "answer_ids": torch.randint(0, 200, (24,), generator=generator).tolist()} for _ in range(6)]
    features = extract_features(base, rows)
    order = answer_order(features.remaining, seed=0)
    assert sorted(order.tolist()) == list(range(len(order)))
    assert all(features.remaining[order[i]] == 0 or order[i + 1] == order[i] + 1 for i in range(len(order) - 1))
    stretches = answer_order(features.remaining, seed=0, stretch=5)
    assert sorted(stretches.tolist()) == list(range(len(order)))
    answer_length = 24  # every answer's positions: 5, 5, 5, 5 and 4 per stretch
    ends = [int(p) for i, p in enumerate(stretches[:-1]) if stretches[i + 1] != p + 1]
    assert all(p % answer_length in (4, 9, 14, 19, 23) for p in ends)  # jumps only where a stretch ends
    assert len({int(p) // answer_length for p in stretches[:48]}) >= 4  # a batch mixes answers
    config = TrainConfig(family="hydra", num_heads=2, epochs=6, batch_size=48, lr=1e-2, draft_vocab=0,
                         prefix_layer=True, prefix_stretch=5)
    heads = train_hydra(base, features, config)
    assert heads.prefix is not None and heads.prefix.out.weight.abs().sum() > 0
    fresh = HydraHeads(heads.config)
    vocab = train_vocab(base.lm_head.weight, None)
    embed = base.model.get_input_embeddings().weight
    index = torch.arange(len(order))
    with torch.no_grad():
        trained_loss, _ = hydra_loss(heads, [vocab, vocab], embed, features, index, config.decay)
        fresh_loss, _ = hydra_loss(fresh, [vocab, vocab], embed, features, index, config.decay)
    assert trained_loss < 0.95 * fresh_loss
    heads.save(tmp_path)
    loaded = load_hydra_heads(tmp_path)
    accuracy, own = hydra_accuracy(base, loaded, rows[:2])
    assert len(accuracy) == 2 and all(0.0 <= a[0] <= 1.0 for a in accuracy)


def test_features_extracted_under_bf16_autocast_match_fp32():
    """Off the exact engine (transformers' forward), the faster extraction (bf16 autocast, where bf16
    is fast) yields the same positions and targets, hidden states within bf16 rounding, and mostly the
    same teacher top-1."""
    from offline.train import extract_features
    base = tiny_base("llama", engine="hf")
    assert not base.exact
    generator = torch.Generator().manual_seed(5)
    rows = [{"prompt_ids": torch.randint(0, 200, (5,), generator=generator).tolist(),
             "answer_ids": torch.randint(0, 200, (12,), generator=generator).tolist()} for _ in range(3)]
    exact, fast = extract_features(base, rows), extract_features(base, rows, bf16=True)
    assert torch.equal(exact.tokens, fast.tokens) and torch.equal(exact.remaining, fast.remaining)
    error = (exact.hidden.float() - fast.hidden.float()).norm() / exact.hidden.float().norm()
    assert 0 < error < 0.05
    assert (exact.teacher_ids[:, 0] == fast.teacher_ids[:, 0]).float().mean() > 0.8


def test_a_batch_that_starts_inside_an_answer_sees_the_answer_before_it(base):
    """prefix_states on positions 3..9 of a 7- and a 5-position answer equals what one causal pass
    over each whole answer gives there (the earlier positions enter as context)."""
    from offline.train_hydra import prefix_states
    heads = tiny_hydra(base, prefix_layer=True)
    size = base.model.config.hidden_size
    hidden = torch.randn(12, size).to(torch.bfloat16)
    remaining = torch.cat([torch.arange(6, -1, -1), torch.arange(4, -1, -1)])
    features = Features(hidden=hidden, remaining=remaining, tokens=torch.zeros(12, dtype=torch.long),
                        teacher_ids=torch.zeros(12, 4).int(), teacher_probs=torch.zeros(12, 4).half())
    index = torch.arange(3, 10)
    with torch.no_grad():
        got = prefix_states(heads, hidden[index].float(), index, features)  # [7, H]
        first, second = heads.context_states(hidden[:7].float()), heads.context_states(hidden[7:].float())
    assert torch.allclose(got, torch.cat([first[3:], second[:3]]), atol=1e-5)


def _node_tokens(grown) -> list[tuple[tuple[int, ...], float]]:
    """Each node as (its tokens from the root, its score), best first."""
    table = grown.token_table.tolist()
    return [(tuple(table[d][path[d]] for d in range(len(path))), round(score, 6))
            for path, score in zip(grown.tree.paths, grown.tree.scores)]


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 9])
def test_a_draft_limit_grows_the_full_trees_best_nodes(base, limit):
    """`DraftContext.max_nodes` (the adaptive budget's draft limit) grows fewer, shallower
    levels, and the nodes are the full growth's best `limit`: the controller sees the same tree."""
    from core.drafters.hydra import HydraDrafter
    from core.drafters.interface import DraftContext
    drafter = HydraDrafter(tiny_hydra(base, std=0.5), base, width=8, beam=4, depth=4, budget=40)
    context = DraftContext(tokens=PROMPT, hidden=torch.randn(base.model.config.hidden_size))
    full = drafter.propose(context)
    limited = drafter.propose(dataclasses.replace(context, max_nodes=limit))
    assert limited.tree.num_nodes == limit
    assert _node_tokens(limited) == _node_tokens(full)[:limit]
    assert limited.token_ids.shape[0] == min(4, limit)  # depths beyond the limit are not asked


def test_prefix_layer_last_only_is_the_last_output_and_forks_keep_their_cache(base):
    """Drafting reads the last position's output alone (`last_only`): the same as the full extension's
    last row, the same cache; a cache another fork has appended past stays as it was, and extending
    it again gives what extending it the first time gave."""
    prefix = tiny_hydra(base, prefix_layer=True).prefix
    hidden = torch.randn(9, base.model.config.hidden_size)
    cache = None
    for start, end in ((0, 3), (3, 4), (4, 6)):
        full, full_cache = prefix.extend(cache, hidden[start:end])
        last, cache = prefix.extend(cache, hidden[start:end], last_only=True)
        assert last.shape == (1, hidden.shape[1]) and torch.allclose(last, full[-1:], atol=1e-5)
        assert torch.equal(cache.keys, full_cache.keys) and torch.equal(cache.values, full_cache.values)
    kept_keys = cache.keys.clone()
    one, one_cache = prefix.extend(cache, hidden[6:7], last_only=True)  # one fork goes on ...
    other, other_cache = prefix.extend(cache, hidden[7:9], last_only=True)  # ... another from the same place
    assert torch.equal(cache.keys, kept_keys) and cache.length == 6
    again, again_cache = prefix.extend(cache, hidden[6:7], last_only=True)
    assert torch.equal(again, one) and torch.equal(again_cache.keys, one_cache.keys)
    assert other_cache.length == 8 and torch.equal(other_cache.keys[:, :6], kept_keys)
    whole = prefix(hidden[None, :6])[0]
    assert torch.allclose(prefix.extend(None, hidden[:6], last_only=True)[0], whole[-1:], atol=1e-5)
