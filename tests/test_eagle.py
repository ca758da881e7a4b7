"""The EAGLE-style drafter and the family table: training-time test is what drafting sees, tapping
features changes no number, every family in the table round-trips the grammar and decodes greedily
equal to plain decoding, the grown tree's invariants, the on-disk format and the views (tiny models)."""
from __future__ import annotations

import pytest
import torch

from core.decoder import DecodeConfig, decode, strategy_config
import core.drafters.eagle as eagle_module
from core.drafters.eagle import EagleConfig, EagleLayer, grow_eagle_tree, load_eagle
from core.drafters.grown import GrownNode, best_first, grow_parallel
from core.drafters.medusa import ranked
from core.families import FAMILIES, MEDUSA
from core.strategy import StrategySpec, parse_strategy
from core.verify import forward_tokens
from tests.tiny import greedy_reference, tiny_base, tiny_eagle, tiny_heads, tiny_hydra

PROMPT = list(b"the cat sat on the mat and the cat sat on the")


@pytest.fixture(scope="module")
def base():
    return tiny_base("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def eagle(base):
    return tiny_eagle(base)


def _double_layer(seed: int = 0) -> EagleLayer:
    torch.manual_seed(seed)
    layer = EagleLayer(EagleConfig(hidden_size=32, num_heads=4, kv_heads=2, head_dim=8, intermediate=48,
                                   vocab_size=50, draft_vocab_size=50, taps=(1, 2))).double()
    for weight in layer.parameters():
        torch.nn.init.normal_(weight, std=0.3)
    return layer


@pytest.mark.parametrize("anchor", [0, 3, 6])
def test_training_time_test_is_what_drafting_sees(anchor):
    """Step j of `ttt_states` at row t equals drafting depth j-1 below the layer's output at t:
    extending the cache with rows 0..t, then feeding its own states down the true path."""
    layer = _double_layer()
    length = 7
    features = torch.randn(1, length, 96, dtype=torch.double)
    embeds = torch.randn(length + 3, 32, dtype=torch.double)
    steps = layer.ttt_states(features, torch.tensor([length]), 3, lambda j, _: embeds[None, j - 1:j - 1 + length])
    out, cache = layer.extend(None, features[0, :anchor + 1], embeds[:anchor + 1])
    assert torch.allclose(out[-1], steps[0][0, anchor], atol=1e-12)
    first, keys, values = layer.draft(cache, out[-1:], embeds[anchor + 1:anchor + 2], 1, None,
                                      torch.zeros(1, 0, dtype=torch.bool))
    assert torch.allclose(first[0], steps[1][0, anchor], atol=1e-12)
    second, _, _ = layer.draft(cache, first, embeds[anchor + 2:anchor + 3], 2, (keys, values),
                               torch.ones(1, 1, dtype=torch.bool))
    assert torch.allclose(second[0], steps[2][0, anchor], atol=1e-12)


def test_a_cache_extended_step_by_step_equals_one_pass():
    layer = _double_layer(1)
    features, embeds = torch.randn(9, 96, dtype=torch.double), torch.randn(9, 32, dtype=torch.double)
    whole, _ = layer.extend(None, features, embeds)
    first, cache = layer.extend(None, features[:4], embeds[:4])
    rest, cache = layer.extend(cache, features[4:], embeds[4:])
    assert cache.length == 9
    assert torch.allclose(torch.cat([first, rest]), whole, atol=1e-12)
    last, last_cache = layer.extend(None, features[:4], embeds[:4], last_only=True)  # what drafting reads
    last, last_cache = layer.extend(last_cache, features[4:], embeds[4:], last_only=True)
    assert last.shape == (1, 32) and torch.allclose(last, whole[-1:], atol=1e-12)
    assert torch.equal(last_cache.keys, cache.keys) and torch.equal(last_cache.values, cache.values)


@pytest.mark.parametrize("engine", ["exact", "lean", "hf"])
def test_tapping_changes_no_number(engine):
    """The hidden states with taps are bitwise those without; the taps are the residual streams
    transformers reports as hidden_states[i] (within rounding)."""
    base = tiny_base("llama", num_hidden_layers=4, engine=engine)
    ids = torch.tensor(PROMPT[:12])
    plain = forward_tokens(base, base.new_cache(32), ids, torch.arange(12))
    tapped = forward_tokens(base, base.new_cache(32), ids, torch.arange(12), taps=(0, 2))
    assert plain.tapped is None and torch.equal(plain.hidden, tapped.hidden)
    with torch.inference_mode():
        reference = base.model.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    for row, layer in enumerate((0, 2)):
        torch.testing.assert_close(tapped.tapped[row], reference[layer][0], atol=1e-5, rtol=1e-5)


def test_every_family_round_trips_the_grammar_and_decodes_like_plain(base):
    """Every entry of the family table: its text parses back to itself, its drafter builds on a tiny
    model, and greedy decoding with it equals plain greedy decoding token for token."""
    weights = {MEDUSA: tiny_heads(base), "hydra": tiny_hydra(base), "eagle": tiny_eagle(base)}
    expected = greedy_reference(base, PROMPT, 40)
    for name, entry in FAMILIES.items():
        text = "ar" if not entry.drafts else f"{name}:12" if entry.sized else name
        spec = parse_strategy(text)
        assert spec.family == name and parse_strategy(spec.text) == spec
        assert entry.label in spec.label or not entry.sized
        config = strategy_config(spec, DecodeConfig(max_new_tokens=40, top_m=6))
        if entry.drafts:
            assert entry.weights_key in weights, f"no tiny weights for the {name} family's {entry.weights_key}"
        session = decode(base, weights.get(entry.weights_key), PROMPT, config)
        assert session.output_ids == expected, name
        if entry.sized:
            assert max(r.outcome.tree.num_nodes for r in session.records) > 1, name


@pytest.mark.parametrize("spec", [StrategySpec("eagle", budget=20), StrategySpec("eagle", budget=40, auto=True, lookup=True)])
def test_eagle_greedy_equals_plain_and_reads_the_whole_answer(base, eagle, spec):
    expected = greedy_reference(base, PROMPT, 48)
    session = decode(base, eagle, PROMPT, DecodeConfig(spec=spec, max_new_tokens=48, top_m=8, lookup_tokens=8))
    assert session.output_ids == expected
    # one feature row per emitted token, each low | mid | high
    assert sum(len(chunk) for chunk in session.feature_history) == len(session.output_ids)
    assert session.feature_history[0].shape[-1] == 3 * base.model.config.hidden_size


def test_eagle_grown_tree_is_a_best_first_tree(base, eagle):
    hidden = base.model.config.hidden_size
    features, embeds = torch.randn(5, 3 * hidden), torch.randn(5, hidden)
    _, cache = eagle.extend(None, features, embeds)
    state = torch.randn(hidden)
    grown = grow_eagle_tree(eagle, base.model.get_input_embeddings(), eagle.draft_projection(base.lm_head),
                            cache, state, budget=30, width=6, beam=4, depth=4)
    tree = grown.tree
    assert tree.num_nodes == 30 and tree.kind == "eagle"
    assert tree.scores == sorted(tree.scores, reverse=True)
    seen = set()
    for path in tree.paths:
        assert len(path) == 1 or path[:-1] in seen  # parents first
        seen.add(path)
    table = grown.token_table.tolist()
    pairs = [(p[:-1], table[len(p) - 1][p[-1]]) for p in tree.paths]
    assert len(pairs) == len(set(pairs))  # no token twice under one parent


def _alone(layer, cache, root_state, embed, projection, tokens: tuple[int, ...], count: int) -> list[tuple[float, int]]:
    """Brute force: the node reached by `tokens` drafted on its own (a chain of one-row draft calls
    down its path, each seeing the cache and its ancestors only), and its top `count` children."""
    state, keys, values = root_state, None, None
    for depth, token in enumerate(tokens, start=1):
        out, k, v = layer.draft(cache, state[None], embed(torch.tensor([token])), depth,
                                None if keys is None else (keys, values), torch.ones(1, depth - 1, dtype=torch.bool))
        keys = k if keys is None else torch.cat([keys, k], dim=1)
        values = v if values is None else torch.cat([values, v], dim=1)
        state = out[0]
    logits = projection.logits(layer.draft_states(state[None]), len(tokens) + 1)  # [1, rows at the children's depth]
    probs, ids = ranked(logits, count, projection)
    return list(zip(probs[0].tolist(), ids[0].tolist()))


def eagle2_reference(children, *, budget: int, width: int, beam: int, depth: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2's expansion and rerank written out by token paths: the root's `width` children; at
    each depth the `beam` best nodes by joint probability each get their `min(width, beam)` best
    children; then the `budget` best nodes of all (ties to the shallower)."""
    level = {(token,): p for p, token in children((), width)}
    every = dict(level)
    for _ in range(1, depth):
        frontier = sorted(level, key=lambda path: -level[path])[:min(beam, budget)]
        level = {path + (token,): level[path] * p for path in frontier for p, token in children(path, min(width, beam))}
        every.update(level)
    return dict(sorted(every.items(), key=lambda item: (-item[1], len(item[0])))[:budget])


def _growth_inputs():
    """A double-precision draft layer over a 50-token vocabulary (most frequent first), its embedding,
    projection, a 6-position cache and a root state: what a growth reads."""
    layer = _double_layer(3)
    torch.manual_seed(4)
    embed = torch.nn.Embedding.from_pretrained(torch.randn(50, 32, dtype=torch.double))
    lm_head = torch.nn.Linear(32, 50, bias=False).double()
    torch.nn.init.normal_(lm_head.weight, std=2.0)
    layer.draft_vocab.copy_(torch.arange(50))
    projection = layer.draft_projection(lm_head)
    _, cache = layer.extend(None, torch.randn(6, 96, dtype=torch.double), torch.randn(6, 32, dtype=torch.double))
    root = torch.randn(32, dtype=torch.double)
    return layer, embed, projection, cache, root


@pytest.mark.parametrize("budget, width, beam, depth, deep_rows", [(30, 6, 4, 4, 50), (24, 5, 3, 5, 50),
                                                                    (40, 8, 8, 3, 50), (30, 6, 4, 5, 12)])
def test_eagle_grown_tree_equals_a_brute_force_eagle2(budget, width, beam, depth, deep_rows, monkeypatch):
    """The batched growth (one draft call per depth, ancestor masks) keeps exactly the nodes, with
    their joint probabilities, that EAGLE-2's expansion and rerank over nodes drafted one by one keep;
    below EAGLE_FULL_DEPTHS a node's children come from the `deep_rows` most frequent draft tokens."""
    monkeypatch.setattr(eagle_module, "EAGLE_DEEP_ROWS", deep_rows)
    layer, embed, projection, cache, root = _growth_inputs()
    grown = grow_eagle_tree(layer, embed, projection, cache, root, budget=budget, width=width, beam=beam, depth=depth)
    table = grown.token_table.tolist()
    got = {tuple(table[d][c] for d, c in enumerate(path)): score for path, score in zip(grown.tree.paths, grown.tree.scores)}
    expected = eagle2_reference(lambda tokens, count: _alone(layer, cache, root, embed, projection, tokens, count),
                                budget=budget, width=width, beam=beam, depth=depth)
    assert got.keys() == expected.keys()
    assert max(len(path) for path in got) == depth  # the deepest depth kept: every ancestor mask mattered
    frequent = set(layer.draft_vocab[:deep_rows].tolist())
    deep_tokens = {path[-1] for path in got if len(path) > eagle_module.EAGLE_FULL_DEPTHS}
    assert deep_tokens <= frequent
    for path, score in expected.items():
        assert got[path] == pytest.approx(score, rel=1e-9), path


def test_gumiho_hands_the_later_depths_to_parallel_heads():
    """Below the `beam` best nodes of the serial depths, every parent gets head d's same top guesses,
    scored by the parent's joint score times the head's probability; serial nodes stay as they were."""
    serial = [GrownNode(path=(0,), tokens=(5,), score=0.5), GrownNode(path=(1,), tokens=(6,), score=0.3),
              GrownNode(path=(0, 0), tokens=(5, 7), score=0.4), GrownNode(path=(0, 1), tokens=(5, 8), score=0.05),
              GrownNode(path=(1, 0), tokens=(6, 9), score=0.2)]
    head_probs = torch.tensor([[0.9, 0.1, 0.0], [0.8, 0.1, 0.05], [0.6, 0.3, 0.1], [0.5, 0.4, 0.1]])  # [D, m]
    head_ids = torch.tensor([[1, 2, 3], [4, 5, 6], [11, 12, 13], [21, 22, 23]])
    nodes = grow_parallel(serial, head_probs, head_ids, first_depth=3, beam=2, children=2)
    assert nodes[:len(serial)] == serial
    depth3 = {n.tokens: n.score for n in nodes if len(n.path) == 3}
    assert depth3 == pytest.approx({(5, 7, 11): 0.4 * 0.6, (5, 7, 12): 0.4 * 0.3, (6, 9, 11): 0.2 * 0.6,
                                    (6, 9, 12): 0.2 * 0.3})
    depth4 = {n.tokens: n.score for n in nodes if len(n.path) == 4}
    assert depth4 == pytest.approx({(5, 7, 11, 21): 0.24 * 0.5, (5, 7, 11, 22): 0.24 * 0.4,
                                    (5, 7, 12, 21): 0.12 * 0.5, (5, 7, 12, 22): 0.12 * 0.4})
    assert not any(len(n.path) > 4 for n in nodes)
    tree = best_first(nodes, 6, head_probs, head_ids, kind="eagle").tree
    assert tree.num_nodes == 6 and tree.scores == sorted(tree.scores, reverse=True)


def test_the_draft_layers_cache_is_one_causal_pass_over_what_was_accepted(base, eagle):
    """After steps that accepted several tokens and steps that rejected every draft node, the
    session's draft-layer cache equals one causal pass over the accepted rows: no rejected node
    entered it, no accepted row is missing."""
    session = decode(base, eagle, PROMPT, DecodeConfig(spec="eagle:12+lookup", max_new_tokens=40, top_m=6,
                                                       lookup_tokens=6))
    drafter = session.heads_drafter
    accepted = [len(r.outcome.accepted_tokens) for r in session.records if r.outcome is not None]
    assert max(accepted) >= 2 and min(accepted) == 0  # steps that accepted and steps that rejected
    rows = drafter.seen_rows
    features = torch.cat(session.feature_history)[:rows].to(drafter.dtype)  # [rows, 3H]
    following = torch.tensor(session.output_ids[:rows])  # history row i is followed by output token i
    _, whole = drafter.layer.extend(None, features, drafter.embed(following))
    assert drafter.cache.length == rows > 20
    assert torch.allclose(drafter.cache.keys, whole.keys, atol=1e-5)
    assert torch.allclose(drafter.cache.values, whole.values, atol=1e-5)


def test_eagle_saves_loads_and_refuses_other_weights(eagle, tmp_path):
    eagle.save(tmp_path / "eagle")
    loaded = load_eagle(tmp_path / "eagle")
    assert loaded.config == eagle.config
    for key, value in eagle.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    tiny_hydra(tiny_base("llama")).save(tmp_path / "hydra")
    with pytest.raises(ValueError, match="does not hold eagle weights"):
        load_eagle(tmp_path / "hydra")


def test_eagle_refuses_medusa_heads(base):
    with pytest.raises(ValueError, match="needs an EAGLE draft layer"):
        decode(base, tiny_heads(base), PROMPT, DecodeConfig(spec="eagle", max_new_tokens=4))


def test_eagle_steps_draw_in_every_view(base, eagle):
    from viz.text_html import heads_html
    from viz.tree_plot import tree_figure
    from viz.verify_view import verification_html
    session = decode(base, eagle, PROMPT, DecodeConfig(spec="eagle:20", top_m=6, max_new_tokens=12))
    record = max(session.records, key=lambda r: r.outcome.tree.num_nodes)
    assert record.outcome.grown and record.outcome.tree.num_nodes == 20
    assert len(tree_figure(record.outcome, "EAGLE", "", None).data) > 0
    assert "EAGLE draft step 1, child" in verification_html(record, greedy=True)
    assert "EAGLE draft layer reads the base model" in heads_html(record)


def test_training_time_test_loss_learns():
    """A few optimiser steps of the training loss on synthetic answers lower it."""
    from offline.eagle_features import FusedFeatures
    from offline.train import train_vocab
    from offline.train_eagle import ttt_loss
    torch.manual_seed(0)
    hidden, vocab_size, answers, length = 32, 40, 6, 10
    count = answers * length
    tokens = torch.randint(0, vocab_size, (count,))
    features = FusedFeatures(low=torch.randn(count, hidden).bfloat16(), mid=torch.randn(count, hidden).bfloat16(),
                             high=torch.randn(count, hidden).bfloat16(), tokens=tokens,
                             remaining=torch.arange(length - 1, -1, -1).repeat(answers),
                             teacher_ids=torch.stack([torch.roll(torch.arange(vocab_size), -int(t))[:32] for t in tokens]).int(),
                             teacher_probs=torch.full((count, 32), 1 / 32).half())
    layer = EagleLayer(EagleConfig(hidden_size=hidden, num_heads=4, kv_heads=2, head_dim=8, intermediate=48,
                                   vocab_size=vocab_size, draft_vocab_size=vocab_size, taps=(1, 2)))
    layer.draft_vocab.copy_(torch.arange(vocab_size))
    vocab = train_vocab(torch.randn(vocab_size, hidden), layer.draft_vocab)
    embed = torch.randn(vocab_size, hidden)
    starts = features.starts
    lengths = features.remaining[starts] + 1
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss, accuracy = ttt_loss(layer, embed, vocab, features, starts, lengths, torch.arange(answers), 3, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(accuracy) == 3
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("budget", [2, 3, 5])
def test_growth_stops_where_no_deeper_node_can_enter_the_cut(budget):
    """A small budget stops the growth early (fewer draft calls than depths) and keeps exactly the
    tree EAGLE-2's full expansion and rerank keep."""
    layer, embed, projection, cache, root = _growth_inputs()
    calls = []
    drafted = layer.draft
    layer.draft = lambda *args: calls.append(1) or drafted(*args)
    grown = grow_eagle_tree(layer, embed, projection, cache, root, budget=budget, width=4, beam=4, depth=6)
    layer.draft = drafted
    table = grown.token_table.tolist()
    got = {tuple(table[d][c] for d, c in enumerate(path)) for path in grown.tree.paths}
    expected = eagle2_reference(lambda tokens, count: _alone(layer, cache, root, embed, projection, tokens, count),
                                budget=budget, width=4, beam=4, depth=6)
    assert got == expected.keys()
    assert len(calls) < 5  # the full growth drafts 5 depths below the root's children


def _report(own: list[float], steps: dict[str, float]) -> dict:
    """A held-out report as offline.train_eagle writes it, the same figures on both sets."""
    held = {"given_path": {"top1": [o + 0.1 for o in own]}, "own_guesses": {"top1": own}, "tokens_per_step": steps}
    return {"held_out": {"mt_bench": held, "second_set": held}}


def test_a_candidate_ships_only_if_its_held_out_figures_beat_the_shipped_ones():
    """The shipping rule (offline.eagle_verdict): tokens per step at every size and the mean top-1 on its own
    guesses, each at least the shipped layer's, on every held-out set; the given-path figures are shown only."""
    from offline.eagle_verdict import compare
    shipped = _report([0.38, 0.21, 0.13], {"eagle:16": 2.02, "eagle:64": 2.31})
    better = _report([0.40, 0.22, 0.14], {"eagle:16": 2.05, "eagle:64": 2.35})
    assert compare(better, shipped).ships
    assert not compare(shipped, better).ships
    assert compare(shipped, shipped).ships  # a tie keeps the rule's "at least"
    one_size_worse = _report([0.40, 0.22, 0.14], {"eagle:16": 2.05, "eagle:64": 2.30})
    assert not compare(one_size_worse, shipped).ships
    own_worse = _report([0.38, 0.20, 0.12], {"eagle:16": 2.05, "eagle:64": 2.35})
    assert not compare(own_worse, shipped).ships
    verdict = compare(better, shipped)
    assert {f.held_out for f in verdict.figures} == {"mt_bench", "second_set"}
    assert sum(f.decides for f in verdict.figures) == 2 * 3  # the own-guesses mean and two sizes, per set
    assert "tokens per step, eagle:64 (decides) | 2.350 | 2.310 | +0.040" in verdict.table()


def test_eagle_drafts_in_fp32_on_the_kernels_where_the_heads_take_bf16(monkeypatch):
    """Where torch's bf16 products measure fast (`fast_bf16_batched`), Medusa's and Hydra's heads draft in
    bf16, but EAGLE's layer on the exact engine keeps fp32: its products run in the kernels, which
    multiply in fp32 anyway, so bf16 activations only added casts (a 16-node propose 10.2-10.9 ms
    against 6.9-7.2 on a 2-core Zen 4 with AVX512-BF16). Off the kernels it drafts as the heads do."""
    import core.drafters.interface as interface
    from core.drafters.eagle import EagleDrafter
    from core.engine.build import load_kernels
    from core.model import CACHE_DIR
    from tests.tiny import tiny_gguf_base
    if load_kernels(CACHE_DIR) is None:
        pytest.skip("the exact kernels could not be built on this machine")
    monkeypatch.setattr(interface, "fast_bf16_batched", lambda: True)
    exact = tiny_gguf_base("gguf-q8")
    config = strategy_config(parse_strategy("eagle:8"), DecodeConfig())
    on_kernels = EagleDrafter.for_session(tiny_eagle(exact), exact, config)
    assert exact.exact and on_kernels.dtype == torch.float32
    assert interface.heads_for_drafting(tiny_heads(exact), exact)[2] == torch.bfloat16
    lean = tiny_base("llama", engine="lean")
    assert not lean.exact and EagleDrafter.for_session(tiny_eagle(lean), lean, config).dtype == torch.bfloat16
