"""Typical acceptance pinned to hand-computed cases on fixed logits.

Rule (core/accept.py, Medusa's): after node u, token x is accepted when
    p_u(x) > min(epsilon, delta * exp(-H(p_u)))        epsilon = typical_threshold = 0.09,
                                                        delta = typical_alpha = 0.3,
H the (natural-log) entropy of the base distribution p_u at temperature 1. The longest accepted
root-to-node path wins; among equally long ones, the highest sum of log p. The bonus token is
drawn from the last accepted node's distribution.

Every expected value below is worked out by hand in the comments (natural logs, 5 decimals), not
by calling the rule. The code's entropy adds 1e-5 inside the log, which lowers H by about
8e-5 over 8 tokens: every margin below is far larger. Each node's "logits" are log p, fed through an
identity lm_head, so p_u is exactly the distribution written in the test.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core.accept import AcceptConfig, accept, accept_greedy
from core.sampling import SamplingConfig
from core.tree import CandidateTree
from core.verify import VerifyOutput

VOCAB = 8
BONUS = 7  # leaves' rows put (almost) all mass here, so the bonus after a leaf is certain
TYPICAL = AcceptConfig(rule="typical", sampling=SamplingConfig(temperature=1.0))

# Distributions over the 8 tokens, with their entropy H = -sum p ln p and threshold min(0.09, 0.3 e^-H).
# HIGH: 4 x .2 ln(1/.2) = 4 x .2 x 1.60944 = 1.28755; 2 x .06 x 2.81341 = .33761; 2 x .04 x 3.21888 = .25751
#       H = 1.88267, e^-H = .15218, 0.3 e^-H = .04565 < .09 -> threshold .04565 (the entropy term)
HIGH = [0.2, 0.2, 0.2, 0.2, 0.06, 0.06, 0.04, 0.04]
# LOW:  .8 x .22314 = .17851; 3 x .02 x 3.91202 = .23472; 2 x .06 x 2.81341 = .33761; 2 x .01 x 4.60517 = .09210
#       H = .84295, e^-H = .43046, 0.3 e^-H = .12913 > .09 -> threshold .09 (epsilon)
LOW = [0.8, 0.02, 0.02, 0.02, 0.06, 0.06, 0.01, 0.01]
# PEAKED: .7 x .35667 = .24967; .1 x 2.30259 = .23026; .08 x 2.52573 = .20206; .05 x 2.99573 = .14979;
#       .03 x 3.50656 = .10520; .02 x 3.91202 = .07824; 2 x .01 x 4.60517 = .09210
#       H = 1.10732, e^-H = .33046, 0.3 e^-H = .09914 > .09 -> threshold .09 (epsilon)
PEAKED = [0.7, 0.1, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01]
# TWO: .5 x .69315 = .34657; .3 x 1.20397 = .36119; 2 x .05 x 2.99573 = .29957; .04 x 3.21888 = .12876;
#       .03 x 3.50656 = .10520; .02 x 3.91202 = .07824; .01 x 4.60517 = .04605
#       H = 1.36558, e^-H = .25524, 0.3 e^-H = .07657 -> threshold .07657
TWO = [0.5, 0.3, 0.05, 0.05, 0.04, 0.03, 0.02, 0.01]
# MID_A: .4 x .91629 = .36652; 2 x .2 x 1.60944 = .64378; .1 x 2.30259 = .23026; .05 x 2.99573 = .14979;
#       .03 x 3.50656 = .10520; 2 x .01 x 4.60517 = .09210
#       H = 1.58765, e^-H = .20439, 0.3 e^-H = .06132 -> threshold .06132
MID_A = [0.4, 0.2, 0.2, 0.1, 0.05, 0.03, 0.01, 0.01]
# MID_B: 3 x .1 x 2.30259 = .69078; .6 x .51083 = .30650; .04 x 3.21888 = .12876; .03 x 3.50656 = .10520;
#       .02 x 3.91202 = .07824; .01 x 4.60517 = .04605
#       H = 1.35553, e^-H = .25782, 0.3 e^-H = .07735 -> threshold .07735
MID_B = [0.1, 0.1, 0.1, 0.6, 0.04, 0.03, 0.02, 0.01]


def spike_logits() -> list[float]:
    """A leaf's row: token BONUS has probability 1 - 7e^-40, so the bonus draw is certain."""
    return [0.0] * (VOCAB - 1) + [40.0]


def verified(paths: list[tuple[int, ...]], tokens: list[int], rows: dict[int, list[float]]
             ) -> tuple[CandidateTree, torch.Tensor, VerifyOutput]:
    """A tree, its node tokens [n+1] (root first) and a VerifyOutput whose row u has logits ln p_u
    for the distributions in `rows` (node -> probabilities) and the spike row elsewhere."""
    tree = CandidateTree(paths=paths)
    logits = torch.tensor([[math.log(p) for p in rows[node]] if node in rows else spike_logits()
                           for node in range(len(paths) + 1)])  # [n+1, V]
    return tree, torch.tensor(tokens), VerifyOutput(logits, nn.Identity())


def run(paths, tokens, rows, config: AcceptConfig = TYPICAL) -> tuple[list[int], int]:
    tree, node_tokens, out = verified(paths, tokens, rows)
    result = accept(tree, node_tokens, out, config, torch.Generator().manual_seed(0))
    return result.accepted_nodes, result.bonus_token


def test_defaults_are_medusas():
    assert (AcceptConfig().typical_threshold, AcceptConfig().typical_alpha) == (0.09, 0.3)


@pytest.mark.parametrize("root, expected", [
    # HIGH: threshold .04565. Node 1 (token 6, p .04 < .04565) rejected; node 2 (token 4, p .06 > .04565)
    # accepted although .06 < epsilon .09: the entropy term lets it through. Path [0, 2], bonus after the leaf.
    (HIGH, [0, 2]),
    # LOW: token 4 has the same p .06, but the peaked distribution's threshold is epsilon .09 > .06: rejected,
    # and node 1 (token 6, p .01) too. Only the root.
    (LOW, [0]),
])
def test_entropy_term_decides(root: list[float], expected: list[int]):
    nodes, bonus = run(paths=[(0,), (1,)], tokens=[5, 6, 4], rows={0: root})
    assert nodes == expected
    if expected[-1] != 0:
        assert bonus == BONUS


def test_threshold_not_probability_ranking_decides():
    """Every token above the threshold is accepted, not just the base model's favourite; the
    longest accepted path then wins over the more likely first token.

    root PEAKED (threshold .09): node 1 token 0 p .7 > .09 accepted; node 2 token 1 p .1 > .09
    accepted (the base's second choice: greedy rejects it); node 3 token 2 p .08 < .09 rejected
    (the third choice, yet below the threshold).
    node 1 PEAKED: node 4 token 3 p .05 < .09 rejected -> path [0, 1] (length 2, log p -.35667).
    node 2 PEAKED: node 5 token 1 p .1 accepted; node 5 PEAKED: node 6 token 0 p .7 accepted
    -> path [0, 2, 5, 6] (length 4, log p = ln .1 + ln .1 + ln .7 = -4.96185) wins by length.
    Node 6 is a leaf: bonus 7.
    """
    paths = [(0,), (1,), (2,), (0, 0), (1, 0), (1, 0, 0)]
    tokens = [5, 0, 1, 2, 3, 1, 0]  # root, then nodes 1..6
    rows = {0: PEAKED, 1: PEAKED, 2: PEAKED, 5: PEAKED}
    assert run(paths, tokens, rows) == ([0, 2, 5, 6], BONUS)
    # greedy, on the same rows, follows the argmax only: node 1 (token 0), then node 4's token 3 is not
    # node 1's argmax (token 0): path [0, 1], bonus = argmax of node 1's row = token 0
    tree, node_tokens, out = verified(paths, tokens, rows)
    greedy = accept_greedy(tree, node_tokens, out)
    assert (greedy.accepted_nodes, greedy.bonus_token) == ([0, 1], 0)


@pytest.mark.parametrize("node4_token, expected", [
    # root TWO (threshold .07657): node 1 token 0 p .5, node 2 token 1 p .3, both accepted.
    # node 1 MID_A (threshold .06132): node 3 token 2 p .2 accepted -> [0, 1, 3], ln .5 + ln .2 = ln .1 = -2.30259
    # node 2 MID_B (threshold .07735): node 4 token 3 p .6 accepted -> [0, 2, 4], ln .3 + ln .6 = ln .18 = -1.71480
    # equal length 3: the higher likelihood wins, [0, 2, 4], though its first token is less likely
    (3, [0, 2, 4]),
    # node 4 token 0 under MID_B: p .1 > .07735 accepted -> [0, 2, 4] has ln .3 + ln .1 = ln .03 = -3.50656
    # < -2.30259: now [0, 1, 3] wins
    (0, [0, 1, 3]),
])
def test_equal_lengths_are_broken_by_likelihood(node4_token: int, expected: list[int]):
    paths = [(0,), (1,), (0, 0), (1, 0)]
    tokens = [5, 0, 1, 2, node4_token]
    assert run(paths, tokens, {0: TWO, 1: MID_A, 2: MID_B}) == (expected, BONUS)


def test_a_rejected_parent_cuts_an_accepted_child():
    """Acceptance is a prefix: root LOW (threshold .09), node 1 token 4 p .06 rejected; its child
    node 2 (token 0, p .8 under LOW) would pass, but the path stops at the root."""
    nodes, _ = run(paths=[(0,), (0, 0)], tokens=[5, 4, 0], rows={0: LOW, 1: LOW})
    assert nodes == [0]


def test_base_argmax_is_always_accepted():
    """H >= -ln max p (Shannon entropy is at least the min-entropy), so 0.3 e^-H <= 0.3 max p < max p:
    the argmax clears the threshold whatever the distribution (here 20 random ones over 8 tokens)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = 3 * torch.randn(VOCAB, generator=generator)  # [V]
        probs = torch.softmax(logits, dim=0).tolist()
        nodes, _ = run(paths=[(0,)], tokens=[5, int(logits.argmax())], rows={0: probs})
        assert nodes == [0, 1]
