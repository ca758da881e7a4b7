"""A path stops at the end-of-sequence token: no tree (the step's, or the fixed-tree comparison)
verifies or accepts anything after it, as decoding itself stops there (tiny in-process model)."""
from __future__ import annotations

import torch

from core.decoder import DecodeConfig, PageViews, start_session
from core.drafters.interface import HeadProposal
from tests.tiny import greedy_reference, tiny_base, tiny_heads

PROMPT = list(b"the quick brown fox")


def _session_with_eos_at_second_token():
    base = tiny_base("llama")
    greedy = greedy_reference(base, PROMPT, 4)  # root, g1, g2, g3 (no EOS yet)
    base.model.generation_config.eos_token_id = greedy[2]  # g2 now ends the text
    config = DecodeConfig(spec="dynamic:3", top_m=4, depth=3, fixed_tree=((0,), (0, 0), (0, 0, 0)))
    session = start_session(base, tiny_heads(base, num_heads=3), PROMPT, config, page=PageViews(fixed=True))
    assert session.root_token == greedy[0]
    ids = torch.tensor([[greedy[1], 1, 2, 3], [greedy[2], 4, 5, 6], [greedy[3], 7, 8, 9]])  # [D, m] right guesses first
    proposal = HeadProposal(probs=torch.tensor([[0.9, 0.05, 0.03, 0.02]] * 3), token_ids=ids)
    return session, proposal, greedy


def test_the_step_tree_stops_at_eos():
    session, proposal, greedy = _session_with_eos_at_second_token()
    draft = session._build(proposal, [], session.controller.plan(session.config.budget), max_depth=3)
    assert (0, 0, 0) not in draft.tree  # nothing below the EOS node
    outcome = session._accept(draft, session._verify(draft))
    assert outcome.accepted_tokens == greedy[1:3]  # g1, then EOS, and nothing after it


def test_the_fixed_tree_comparison_stops_at_eos():
    session, proposal, greedy = _session_with_eos_at_second_token()
    session.heads_drafter.propose = lambda context: proposal
    comparison = session.step().comparison  # greedy: judged from the step's own greedy tokens
    assert comparison.accepted_tokens == greedy[1:3]
    assert comparison.tree.num_nodes == 2


def test_the_fixed_tree_comparison_does_not_change_sampled_text():
    """Same seed, sampling: ticking the side-by-side comparison must not change the output."""
    from core.accept import AcceptConfig
    from core.decoder import decode
    from core.sampling import SamplingConfig
    base = tiny_base("llama")
    heads = tiny_heads(base, num_heads=4)
    accept = AcceptConfig(rule="typical", sampling=SamplingConfig(temperature=0.9))
    outputs = [decode(base, heads, PROMPT, DecodeConfig(spec="dynamic:12", max_new_tokens=40, seed=3, accept=accept),
                      page=PageViews(fixed=compare)).output_ids
               for compare in (False, True)]
    assert outputs[0] == outputs[1]
