"""Tree speculative sampling preserves the base model's sampling distribution exactly."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.accept import AcceptConfig
from core.decoder import DecodeConfig, PageViews, start_session
from core.strategy import StrategySpec
from core.drafters.medusa import HeadsConfig, MedusaHeads
from core.drafters.datastore import TokenStore
from core.drafters.eagle import EagleLayer
from core.drafters.hydra import HydraConfig, HydraHeads
from core.model import BaseModel, ModelConfig
from core.sampling import SamplingConfig, sampling_probs
from tests.tiny import tiny_eagle

VOCAB = 6
DRAWS = 10_000  # 2.5x the draws that already expose typical acceptance's bias (the control below)
PROMPT = [1, 4, 2, 5]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny forwards: one thread avoids thread hand-off overhead (and leaves a core free)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> tuple[BaseModel, MedusaHeads]:
    return make_tiny()


def make_tiny() -> tuple[BaseModel, MedusaHeads]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked, varied next-token distributions
    model.generation_config.eos_token_id = [VOCAB + 100]  # never emitted: always 3 tokens
    base = BaseModel(model=model, tokenizer=None, config=ModelConfig(), source="tiny random llama")
    heads = MedusaHeads(HeadsConfig(num_heads=3, hidden_size=32, vocab_size=VOCAB))
    for block in heads.heads:
        torch.nn.init.normal_(block[0].linear.weight, std=1.0)
    return base, heads.eval().requires_grad_(False)


@torch.inference_mode()
def exact_three_token_distribution(base: BaseModel, sampling: SamplingConfig) -> torch.Tensor:
    """P(x1, x2, x3) of plain sampling, by enumeration: [VOCAB**3]."""
    sequences = torch.tensor([PROMPT + list(t) for t in itertools.product(range(VOCAB), repeat=3)])
    logits = base.model(input_ids=sequences).logits  # [V^3, T, V]
    probs = sampling_probs(logits[:, len(PROMPT) - 1: len(PROMPT) + 2], sampling)  # [V^3, 3, V]
    picked = probs.gather(2, sequences[:, len(PROMPT):, None])[..., 0]  # [V^3, 3]
    return picked.prod(dim=1).double()


def draw_counts(base: BaseModel, heads: MedusaHeads | HydraHeads | EagleLayer, rule: str, sampling: SamplingConfig,
                draws: int = DRAWS, store: TokenStore | None = None) -> torch.Tensor:
    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    strategy = heads.family  # the family these weights draft for: dynamic (Medusa), hydra or eagle
    spec = StrategySpec(strategy, budget=10, lookup=store is not None, store=store is not None)
    config = DecodeConfig(spec=spec, top_m=3, depth=3, max_new_tokens=3,
                          accept=AcceptConfig(rule=rule, sampling=sampling), beam=3, lookup_tokens=3, store_tokens=3)
    root_session = start_session(base, heads, PROMPT, config, store=store, page=PageViews(texts=False))
    first_token_probs = sampling_probs(base.model(input_ids=torch.tensor([PROMPT])).logits[0, -1], sampling)
    generator = torch.Generator().manual_seed(1234)
    for seed in range(draws):
        session = root_session.fork(seed)
        # the first token comes from the prefill distribution: redraw it per sample
        session.root_token = int(torch.multinomial(first_token_probs, 1, generator=generator))
        session.output_ids = [session.root_token]
        while not session.finished:
            session.step()
        a, b, c = session.output_ids
        counts[a * VOCAB * VOCAB + b * VOCAB + c] += 1
    return counts / draws


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def null_threshold(exact: torch.Tensor, draws: int = DRAWS) -> float:
    """1.5x the largest TV of 20 honest multinomial samples of the same size."""
    generator = torch.Generator().manual_seed(7)
    values = []
    for _ in range(20):
        sample = torch.multinomial(exact.float(), draws, replacement=True, generator=generator)
        values.append(total_variation(torch.bincount(sample, minlength=len(exact)).double() / draws, exact))
    return 1.5 * max(values)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)])
def test_tree_speculative_sampling_matches_plain_sampling(tiny, sampling):
    base, heads = tiny
    exact = exact_three_token_distribution(base, sampling)
    threshold = null_threshold(exact)
    assert total_variation(draw_counts(base, heads, "speculative", sampling), exact) < threshold


@pytest.fixture(scope="module")
def tiny_hydra(tiny) -> HydraHeads:
    """Random Hydra heads on the same tiny model: their children depend on the path."""
    torch.manual_seed(1)
    heads = HydraHeads(HydraConfig(num_heads=3, hidden_size=32, vocab_size=VOCAB, draft_vocab_size=0))
    for head in heads.heads:
        torch.nn.init.normal_(head.mix.weight, std=0.5)
        torch.nn.init.normal_(head.blocks[0].linear.weight, std=1.0)
    return heads.eval().requires_grad_(False)


def test_hydra_tree_speculative_sampling_matches_plain_sampling(tiny, tiny_hydra):
    base, _ = tiny
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_three_token_distribution(base, sampling)
    assert total_variation(draw_counts(base, tiny_hydra, "speculative", sampling), exact) < null_threshold(exact)


def test_eagle_tree_speculative_sampling_matches_plain_sampling(tiny):
    """EAGLE's grown tree (its draft layer reads the tapped features and its own states) keeps plain
    sampling's distribution under speculative acceptance."""
    base, _ = tiny
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_three_token_distribution(base, sampling)
    layer = tiny_eagle(base, std=0.3, seed=2)
    assert total_variation(draw_counts(base, layer, "speculative", sampling), exact) < null_threshold(exact)


def test_control_typical_acceptance_with_hydra_is_biased(tiny, tiny_hydra):
    base, _ = tiny
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_three_token_distribution(base, sampling)
    draws = 4000
    assert total_variation(draw_counts(base, tiny_hydra, "typical", sampling, draws), exact) > \
        null_threshold(exact, draws)


def test_sampling_with_lookup_chains_and_datastore_branches_matches_plain(tiny):
    """Chains (prompt lookup) and datastore branches join the tree on their own columns; the
    speculative rule must stay exact with them (the prompt repeats, so lookup proposes)."""
    base, heads = tiny
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_three_token_distribution(base, sampling)
    store = TokenStore([[1, 4, 2, 5, 3, 3, 1], [4, 2, 5, 0, 1, 2], [2, 5, 4, 4, 4]])
    assert total_variation(draw_counts(base, heads, "speculative", sampling, store=store), exact) < \
        null_threshold(exact)


def test_control_typical_acceptance_is_biased(tiny):
    """The same test catches a rule that is not distribution-preserving."""
    base, heads = tiny
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_three_token_distribution(base, sampling)
    draws = 4000  # the bias is large: fewer draws suffice
    assert total_variation(draw_counts(base, heads, "typical", sampling, draws), exact) > null_threshold(exact, draws)


SHIPPED_DRAWS = 600


def test_shipped_model_speculative_sampling_matches_plain(base_fp32, shipped_heads):
    """The token after the root (head-proposed or bonus) follows the base distribution exactly."""
    sampling = SamplingConfig(temperature=1.0)
    config = DecodeConfig(spec="dynamic:15", max_new_tokens=8, accept=AcceptConfig(rule="speculative", sampling=sampling))
    start = start_session(base_fp32, shipped_heads, "Write one sentence about the sea.", config,
                          page=PageViews(texts=False))
    with torch.inference_mode():
        ids = torch.tensor([start.prompt_ids + [start.root_token]])
        exact = sampling_probs(base_fp32.model(input_ids=ids).logits[0, -1], sampling).double()  # [V]
    entropy = float(-(exact * exact.clamp_min(1e-30).log()).sum())
    assert entropy > 1.0, "pick a prompt whose continuation is not near-deterministic"
    counts = torch.zeros_like(exact)
    for seed in range(SHIPPED_DRAWS):
        record = start.fork(seed).step()
        counts[record.new_tokens[0]] += 1
    empirical = counts / SHIPPED_DRAWS
    # compare on the 30 likeliest tokens plus one bucket for the rest
    top = exact.topk(30).indices
    def bucket(p: torch.Tensor) -> torch.Tensor:
        return torch.cat([p[top], (1 - p[top].sum()).reshape(1)])
    exact_b, empirical_b = bucket(exact), bucket(empirical)
    generator = torch.Generator().manual_seed(3)
    null = [total_variation(torch.bincount(torch.multinomial(exact_b.float(), SHIPPED_DRAWS, replacement=True,
                                                             generator=generator), minlength=31).double() / SHIPPED_DRAWS,
                            exact_b) for _ in range(20)]
    assert total_variation(empirical_b, exact_b) < 1.5 * max(null)


def test_batched_draws_follow_sampling_probs_inside_and_outside_the_candidates(monkeypatch):
    """`sample_rows` (batched generation's draw) reads a row through its best candidates only when its
    top-p set lies among them, else falls back: either way each row's draws follow `sampling_probs`.
    A peaked row (set inside 8 candidates) and a flat row (outside) drawn 4,000 times each: every token
    drawn is in the row's set, and the frequencies match the probabilities."""
    import core.sampling
    from core.sampling import SamplingConfig, sample_rows, sampling_probs
    monkeypatch.setattr(core.sampling, "NUCLEUS_CANDIDATES", 8)
    generator = torch.Generator().manual_seed(0)
    peaked = torch.tensor([4.0, 3.0, 2.5, 1.0] + [-6.0] * 60)
    flat = torch.zeros(64)
    logits = torch.stack([peaked, flat])  # [2, 64]
    config = SamplingConfig(temperature=0.9, top_p=0.9)
    probs = sampling_probs(logits, config)  # [2, 64]
    assert (probs[0] > 0).sum() <= 8 < (probs[1] > 0).sum()  # one inside the candidates, one not
    draws = torch.stack([sample_rows(logits, config, generator) for _ in range(4000)])  # [4000, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=64).float() / 4000
        assert bool((counts[probs[row] == 0] == 0).all())
        assert torch.allclose(counts, probs[row], atol=0.03)
    assert torch.equal(sample_rows(logits, SamplingConfig(), generator), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_and_top_two_match_torch_ties_included(dtype):
    """The greedy readers (numpy where it reads the dtype, torch elsewhere) pick what torch.argmax picks,
    the first of tied maxima included, and top_two gives torch.topk's two values."""
    from core.sampling import argmax_rows, argmax_token, top_two
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=generator).to(dtype)  # [6, V]
    logits[1, 7] = logits[1, 40000] = logits[1].max() + 1  # a tie: the first index wins
    logits[2, -1] = logits[2].max() + 1  # the maximum at either end
    logits[3, 0] = logits[3].max() + 1
    logits[4, 5] = logits[4, 6] = logits[4].max() + 1  # top_two of a tie: equal values
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()  # a strided view
    for row in logits:
        assert argmax_token(row) == int(row.argmax())
        assert top_two(row) == tuple(torch.topk(row, 2).values.tolist())
