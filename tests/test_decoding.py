"""The decoder on the real shipped model: greedy losslessness, KV commit, phases, limits."""
from __future__ import annotations

import pytest
import torch

from core.decoder import DecodeConfig, PageViews, decode, start_session
from core.exactness import divergence_from_margins, explain_divergence, plain_margins
from core.kvcache import cache_length, truncate
from core.records import StepKind

FP32_NEAR_TIE = 1e-4  # a tree forward and single-token forwards differ by ~5e-5 in fp32
BF16_NEAR_TIE = 0.25  # bf16 logits of magnitude ~10-30 have a rounding step of 0.0625-0.125
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def plain_fp32(base_fp32, mt_bench_prompts):
    """Plain greedy via transformers' generate, first 5 MT-Bench prompts."""
    out = []
    for prompt in mt_bench_prompts[:5]:
        ids = base_fp32.chat_ids(prompt)
        with torch.inference_mode():
            generated = base_fp32.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                                 eos_token_id=sorted(base_fp32.eos_token_ids))
        out.append((ids, generated[0, len(ids):].tolist()))
    return out


def assert_lossless(base, prompt_ids, plain, speculative, bound):
    divergence = explain_divergence(base, prompt_ids, plain, speculative)
    if divergence is not None:  # allowed only at a floating-point near-tie of the plain run
        assert divergence.logit_gap < bound, f"divergence at {divergence} is not a near-tie"
    else:
        assert len(plain) == len(speculative)


@pytest.mark.parametrize("strategy", ["autoregressive", "fixed", "dynamic"])
def test_greedy_fp32_equals_plain_generate(base_fp32, shipped_heads, plain_fp32, strategy):
    for prompt_ids, plain in plain_fp32:
        session = decode(base_fp32, shipped_heads, prompt_ids, DecodeConfig(spec=strategy, max_new_tokens=NEW_TOKENS))
        assert_lossless(base_fp32, prompt_ids, plain, session.output_ids, FP32_NEAR_TIE)
        assert sum(len(r.new_tokens) for r in session.records) + 1 == len(session.output_ids)


def test_greedy_fp32_with_every_drafter_equals_plain_generate(base_fp32, shipped_heads, plain_fp32):
    """Heads, two prompt-lookup chains and datastore branches in one auto-sized tree: same text."""
    config = DecodeConfig(spec="dynamic:auto+lookup+store", lookup_chains=2, max_new_tokens=NEW_TOKENS)
    sources = set()
    for prompt_ids, plain in plain_fp32[:3]:
        session = decode(base_fp32, shipped_heads, prompt_ids, config)
        assert_lossless(base_fp32, prompt_ids, plain, session.output_ids, FP32_NEAR_TIE)
        sources |= {r.outcome.node_source(n) for r in session.records for n in r.outcome.accepted_nodes[1:]}
    assert "store" in sources  # the datastore's branches were accepted somewhere


@pytest.mark.parametrize("spec, min_deepest", [("hydra:63", 4), ("hydra:auto+lookup", None)],
                         ids=["64", "auto+lookup"])
def test_hydra_greedy_fp32_equals_plain_generate(base_fp32, shipped_hydra, plain_fp32, spec, min_deepest):
    """The shipped Hydra heads' grown trees (and the auto-sized one with a lookup chain): same text.
    At a fixed 64-node budget the heads are right often enough that paths of 4 or more tokens are
    accepted; the auto budget sizes its trees by this machine's measured costs (a fresh-clone CI run
    once kept them small enough that the deepest accepted path was 3), so only its text is pinned."""
    deepest = 0
    for prompt_ids, plain in plain_fp32:
        session = decode(base_fp32, shipped_hydra, prompt_ids, DecodeConfig(spec=spec, max_new_tokens=NEW_TOKENS))
        assert_lossless(base_fp32, prompt_ids, plain, session.output_ids, FP32_NEAR_TIE)
        deepest = max([deepest] + [r.outcome.accepted_length for r in session.records if r.kind == StepKind.TREE])
    if min_deepest is not None:
        assert deepest >= min_deepest


def test_greedy_fp32_random_heads_small_budget(base_fp32, random_heads, plain_fp32):
    """Wrong guesses everywhere, a small dynamic tree and top-m 4: still the same text."""
    prompt_ids, plain = plain_fp32[0]
    config = DecodeConfig(spec="dynamic:7", top_m=4, depth=3, max_new_tokens=NEW_TOKENS)
    session = decode(base_fp32, random_heads, prompt_ids, config)
    assert_lossless(base_fp32, prompt_ids, plain, session.output_ids, FP32_NEAR_TIE)


def test_bf16_divergences_are_near_ties(base_bf16, mt_bench_prompts):
    """Every bf16 divergence sits where the plain run's own top-2 logits were at most two bf16
    rounding steps apart (read from the logits the plain run chose by, not recomputed)."""
    from core.drafters.medusa import default_heads
    heads, _ = default_heads(base_bf16.model.config.hidden_size, base_bf16.model.config.vocab_size, dtype=torch.bfloat16)
    configs = [DecodeConfig(spec="dynamic:15", max_new_tokens=48),
               DecodeConfig(spec="dynamic:auto+lookup", max_new_tokens=48)]
    outcomes = []
    for prompt in mt_bench_prompts[5:9]:
        ids = base_bf16.chat_ids(prompt)
        plain = decode(base_bf16, None, ids, DecodeConfig(spec="ar", max_new_tokens=48))
        margins = plain_margins(plain)
        assert len(margins) == len(plain.output_ids)
        for config in configs:
            tree = decode(base_bf16, heads, ids, config).output_ids
            divergence = divergence_from_margins(plain.output_ids, margins, tree)
            outcomes.append(divergence)
            if divergence is None:
                assert tree == plain.output_ids
            else:
                assert divergence.bf16_steps <= 2, divergence
    assert len(outcomes) == 8


def test_plain_margins_are_the_logits_a_fresh_forward_gives(base_fp32, mt_bench_prompts):
    ids = base_fp32.chat_ids(mt_bench_prompts[3])
    plain = decode(base_fp32, None, ids, DecodeConfig(spec="ar", max_new_tokens=12))
    margins = plain_margins(plain)
    for position in (0, 5, 11):
        with torch.inference_mode():
            logits = base_fp32.model(input_ids=torch.tensor([ids + plain.output_ids[:position]])).logits[0, -1]
        top = torch.topk(logits.float(), 2).values.tolist()
        assert margins[position] == pytest.approx(tuple(top), abs=1e-3)


def test_commit_leaves_plain_cache(base_fp32, shipped_heads, mt_bench_prompts):
    """After each step the cache holds prompt + accepted tokens, and the next logits match plain decoding."""
    session = start_session(base_fp32, shipped_heads, mt_bench_prompts[10], DecodeConfig(spec="dynamic", max_new_tokens=40))
    for _ in range(4):
        session.step()
        emitted = session.output_ids
        assert cache_length(session.cache) == len(session.prompt_ids) + len(emitted) - 1  # last root not yet in cache
        with torch.inference_mode():
            ids = torch.tensor([session.prompt_ids + emitted[:-1]])
            plain = base_fp32.model(input_ids=ids)
            plain_keys = plain.past_key_values.layers[5].keys
            # hidden of the last committed token -> next root logits
            step_logits = base_fp32.lm_head(session.last_hidden).float()
        assert torch.allclose(step_logits, plain.logits[0, -1].float(), atol=1e-4)
        cache = session.cache  # the lean forward's static cache (the shipped model is a Llama)
        assert torch.allclose(cache.keys[5, :, :, :cache.get_seq_length()], plain_keys, atol=1e-4)
        assert session.root_token == emitted[-1]


def test_step_record_contents(base_fp32, shipped_heads, mt_bench_prompts):
    config = DecodeConfig(spec="dynamic:20", max_new_tokens=30)
    session = start_session(base_fp32, shipped_heads, mt_bench_prompts[0], config, page=PageViews(fixed=True))
    record = session.step()
    outcome = record.outcome
    assert outcome.tree.num_nodes == 20 and len(outcome.node_tokens) == 21 and len(outcome.node_texts) == 21
    assert outcome.accepted_nodes[0] == 0 and record.new_tokens[-1] == outcome.bonus_token
    assert len(record.head_token_ids) == 4 and len(record.head_probs[0]) == 10
    assert record.comparison is not None and record.comparison.tree.num_nodes == 63
    assert record.times.verify > 0 and record.times.heads > 0 and record.times.compare > 0
    # the comparison is not committed: the cache grew by the accepted path only
    assert cache_length(session.cache) == record.context_length + outcome.accepted_length


def test_stops_at_limit_and_refuses_more(base_fp32, shipped_heads):
    session = decode(base_fp32, shipped_heads, "Count from one to fifty.", DecodeConfig(max_new_tokens=9))
    assert len(session.output_ids) == 9 and session.stop_reason == "max_new_tokens"
    with pytest.raises(RuntimeError, match="finished"):
        session.step()


@pytest.mark.parametrize("field, value, message", [
    ("spec", "dynamic:10000", "budget"), ("top_m", 0, "top_m"), ("depth", "4", "depth"),
    ("max_new_tokens", -1, "max_new_tokens"), ("spec", "beam", "strategy"), ("spec", "hf:greedy", "strategy"),
])
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**{field: value})


def test_bad_sessions(base_fp32, shipped_heads):
    with pytest.raises(ValueError, match="empty"):
        start_session(base_fp32, shipped_heads, "   ", DecodeConfig())
    with pytest.raises(ValueError, match="heads"):
        start_session(base_fp32, shipped_heads, "hi", DecodeConfig(depth=9))
    with pytest.raises(ValueError, match="context"):
        start_session(base_fp32, shipped_heads, list(range(9000)), DecodeConfig())
    with pytest.raises(ValueError, match="store"):
        DecodeConfig(spec="fixed+store")


def test_small_tree_greedy_acceptance_projects_once(base_fp32, shipped_heads, mt_bench_prompts):
    """A small tree's rows are projected in one lm_head call, so the bonus row costs no second read."""
    from core.accept import ALL_ROWS_UP_TO, accept_greedy
    from core.tree import dynamic_tree
    from core.verify import VerifyOutput, verify_tree

    calls = []

    class CountingHead(torch.nn.Module):
        def forward(self, hidden):
            calls.append(hidden.shape[0])
            return base_fp32.lm_head(hidden)

    session = start_session(base_fp32, shipped_heads, mt_bench_prompts[0], DecodeConfig(spec="dynamic:7"))
    from core.drafters.interface import DraftContext
    proposal = session.heads_drafter.propose(DraftContext(tokens=session.output_ids, hidden=session.last_hidden))
    probs, ids = proposal.probs, proposal.token_ids  # [K, m] each
    for budget in (7, ALL_ROWS_UP_TO + 8):
        tree = dynamic_tree(probs, budget)
        tokens = tree.node_tokens(session.root_token, ids)
        context = cache_length(session.cache)
        buffers = tree.buffers()
        out = verify_tree(base_fp32, session.cache, tokens, buffers.attn_mask, buffers.position_ids)
        calls.clear()
        result = accept_greedy(tree, tokens, VerifyOutput(out.hidden, CountingHead()))
        reference = accept_greedy(tree, tokens, out)
        assert result == reference
        if budget + 1 <= ALL_ROWS_UP_TO:
            assert calls == [budget + 1]
        else:
            assert calls[0] < budget + 1 and len(calls) <= 2
        truncate(session.cache, context)


COPY_PROMPT = ("Copy this list exactly, one item per line: apples, pears, plums, cherries, grapes, "
               "lemons, limes, melons, peaches, apricots.")


@pytest.mark.parametrize("auto", [False, True])
def test_lookup_branch_greedy_fp32_equals_plain(base_fp32, shipped_heads, plain_fp32, auto):
    """The prompt-lookup chain changes which tokens are verified, never which are emitted."""
    for prompt_ids, plain in plain_fp32[:3]:
        config = DecodeConfig(spec="dynamic:auto+lookup" if auto else "dynamic+lookup", max_new_tokens=NEW_TOKENS)
        session = decode(base_fp32, shipped_heads, prompt_ids, config)
        assert_lossless(base_fp32, prompt_ids, plain, session.output_ids, FP32_NEAR_TIE)


def test_lookup_nodes_carry_copied_text(base_fp32, shipped_heads):
    """On a copying task the chain's nodes are accepted, and they hold the copied tokens."""
    plain = decode(base_fp32, None, COPY_PROMPT, DecodeConfig(spec="ar", max_new_tokens=40))
    config = DecodeConfig(spec="dynamic:15+lookup", lookup_tokens=8, max_new_tokens=40)
    session = decode(base_fp32, shipped_heads, COPY_PROMPT, config)
    assert session.output_ids == plain.output_ids
    accepted_lookup = 0
    for record in session.records:
        outcome = record.outcome
        assert outcome.lookup_rank == (32 if any(32 in p for p in outcome.tree.paths) else None)
        for node in outcome.accepted_nodes[1:]:
            accepted_lookup += node in outcome.lookup_nodes
    assert accepted_lookup >= 5
    assert session.tokens_per_step > decode(base_fp32, shipped_heads, COPY_PROMPT,
                                            DecodeConfig(spec="dynamic:15", max_new_tokens=40)).tokens_per_step


def test_steps_without_heads_still_verify_the_lookup_chain(base_fp32, shipped_heads):
    """While auto backs off from the heads, each step verifies the lookup chain alone; still exact."""
    from core.budget.cost_profile import CostProfile

    plain = decode(base_fp32, None, COPY_PROMPT, DecodeConfig(spec="ar", max_new_tokens=40))
    config = DecodeConfig(spec="dynamic:auto+lookup", lookup_tokens=8, max_new_tokens=40)
    session = start_session(base_fp32, shipped_heads, COPY_PROMPT, config,
                            profile=CostProfile(sizes=[1, 128], ms=[20.0, 20.0]))
    session.controller.plain_until = 10 ** 6  # as if the heads had stopped paying for good
    records = list(session.run())
    assert session.output_ids == plain.output_ids
    assert {r.kind for r in records} <= {StepKind.CHAINS, StepKind.PLAIN}
    lookup_steps = [r for r in records if r.kind == StepKind.CHAINS]
    assert len(lookup_steps) >= 3 and all(r.head_token_ids == [] for r in lookup_steps)
    assert sum(len(r.new_tokens) for r in lookup_steps) >= 2 * len(lookup_steps)  # the copy is accepted


def test_lookup_needs_the_dynamic_strategy():
    with pytest.raises(ValueError, match="dynamic"):
        DecodeConfig(spec="fixed+lookup", lookup_tokens=4)
    with pytest.raises(ValueError, match="lookup_tokens"):
        DecodeConfig(spec="dynamic+lookup", lookup_tokens=99)


@pytest.mark.parametrize("engine", ["exact", "lean"])
def test_the_greedy_fixed_tree_comparison_equals_verifying_the_whole_fixed_tree(engine):
    """Under greedy decoding the page's fixed-tree comparison is judged from the greedy tokens the
    step verified, and only the fixed tree's subtree below them is verified (tiny models): every
    step's accepted nodes and bonus equal a full verify of the 63-node fixed tree on the same
    context, the base model's top tokens agree wherever both know them, and steps where the fixed
    tree went deeper than the step's own tree are among them."""
    import dataclasses

    from tests.tiny import tiny_base, tiny_heads
    base = tiny_base("llama", num_hidden_layers=4, engine=engine)
    heads = tiny_heads(base, std=0.5)
    prompt = list(b"the cat sat on the mat and the cat sat on the")

    def comparisons(full_verify: bool) -> list:
        session = start_session(base, heads, prompt, DecodeConfig(spec="dynamic:6", max_new_tokens=40, top_m=6),
                                page=PageViews(fixed=True))
        if full_verify:
            asides = session.observer.asides

            def verified(*args):
                found = asides(*args)
                if found.fixed_to_judge is None:
                    return found
                return dataclasses.replace(found, comparison=session.observer._verify_aside(found.fixed_to_judge),
                                           fixed_to_judge=None)
            session.observer.asides = verified
        while not session.finished:
            session.step()
        return [(r.comparison, r.outcome) for r in session.records]

    judged, full = comparisons(False), comparisons(True)
    assert len(judged) == len(full) > 10
    deeper = 0
    for (ours, step), (theirs, _) in zip(judged, full):
        assert (ours is None) == (theirs is None)
        if ours is None:
            continue
        assert ours.accepted_nodes == theirs.accepted_nodes and ours.bonus_token == theirs.bonus_token
        assert all(a == b for a, b in zip(ours.base_top_tokens, theirs.base_top_tokens) if a >= 0 and b >= 0)
        deeper += len(ours.accepted_nodes) > len(step.accepted_nodes)
    assert deeper >= 2


@pytest.mark.parametrize("engine", ["exact", "lean"])
def test_a_sampled_runs_comparisons_walk_only_the_rows_they_read(engine):
    """Under speculative sampling the page's fixed-tree comparison computes only the rows of the path
    the rule walks (one token at a time, `WalkedRows`): every step's accepted nodes, bonus and sampled
    text equal a full verify of the fixed tree on the same context and random state, each walked row is
    that verify's row (bitwise on the exact kernels), and the walks read far fewer rows than the trees
    hold (tiny models)."""
    from core.accept import AcceptConfig
    from core.kvcache import truncate
    from core.sampling import SamplingConfig
    from tests.tiny import tiny_base, tiny_heads
    import core.page_views as page_views

    base = tiny_base("llama", num_hidden_layers=4, engine=engine)
    heads = tiny_heads(base, std=0.5)
    prompt = list(b"the cat sat on the mat and the cat sat on the")
    config = DecodeConfig(spec="dynamic:6", max_new_tokens=30, top_m=6, seed=3,
                          accept=AcceptConfig(rule="speculative", sampling=SamplingConfig(temperature=0.7)))
    rows_of = {True: [], False: []}  # per comparison: {node: its row's logits} of the nodes walked

    class RecordedWalk(page_views.WalkedRows):
        def __init__(self, *args):
            super().__init__(*args)
            rows_of[True].append(self._rows)

    def full_verify_aside(session, draft):
        context = page_views.cache_length(session.cache)
        twin = torch.Generator()
        twin.set_state(session.generator.get_state())
        verified = session._verify(draft)
        with session._page_texts():
            outcome = session._dressed(session._accept(draft, verified, twin), verified)
        rows_of[False].append({node: verified.row(node) for node in outcome.accepted_nodes})
        truncate(session.cache, context)
        return outcome

    def run(walk: bool) -> tuple[list, list[int]]:
        session = start_session(base, heads, prompt, config, page=PageViews(fixed=True))
        if not walk:
            session.observer._verify_aside = lambda draft: full_verify_aside(session, draft)
        while not session.finished:
            session.step()
        return [r.comparison for r in session.records if r.comparison is not None], session.output_ids

    original = page_views.WalkedRows
    page_views.WalkedRows = RecordedWalk
    try:
        walked, walked_text = run(True)
    finally:
        page_views.WalkedRows = original
    full, full_text = run(False)
    assert walked_text == full_text  # the comparison never touches the sampled text
    assert len(walked) == len(full) == len(rows_of[True]) == len(rows_of[False]) > 5
    for ours, theirs, our_rows, their_rows in zip(walked, full, rows_of[True], rows_of[False]):
        assert ours.accepted_nodes == theirs.accepted_nodes and ours.bonus_token == theirs.bonus_token
        assert list(our_rows) == ours.accepted_nodes  # the walk computed the accepted path's rows alone
        for node, row in our_rows.items():
            if engine == "exact":
                assert torch.equal(row, their_rows[node])
            else:
                assert torch.allclose(row, their_rows[node], atol=1e-4)
    walked_count = sum(len(rows) for rows in rows_of[True])
    assert walked_count < sum(c.tree.num_nodes + 1 for c in walked) / 3  # against a full verify's rows
