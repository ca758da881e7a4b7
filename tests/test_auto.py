"""The adaptive budget's controller (`core.auto`): calibration from the heads' own scores only."""
from __future__ import annotations

import torch

from core.auto import AutoBudget
from core.drafters import Chain, HeadProposal
from core.profile import CostProfile, DepthCalibration
from core.records import DYNAMIC, PhaseTimes, StepRecord, TreeOutcome
from core.tree_policy import DraftTree, build_draft_tree

PROFILE = CostProfile(sizes=[1, 64], ms=[20.0, 40.0])


def heads() -> HeadProposal:
    generator = torch.Generator().manual_seed(7)
    probs = torch.rand(4, 8, generator=generator).sort(dim=1, descending=True).values  # [K, m]
    ids = torch.randperm(100, generator=generator)[:32].reshape(4, 8)  # [K, m] distinct tokens
    return HeadProposal(probs=probs / probs.sum(dim=1, keepdim=True), token_ids=ids)


def record(draft: DraftTree, accepted_paths: list[tuple[int, ...]]) -> StepRecord:
    tree = draft.tree
    accepted = [0] + [tree.node_index(p) for p in accepted_paths]
    outcome = TreeOutcome(tree=tree, node_tokens=[0] * (tree.num_nodes + 1), node_scores=[1.0] + tree.scores,
                          accepted_nodes=accepted, bonus_token=1, head_scores=draft.node_head_scores(),
                          lookup_rank=draft.first_chain_rank if draft.chains else None)
    return StepRecord(index=0, strategy=DYNAMIC, context_length=10, head_token_ids=[], head_probs=[],
                      outcome=outcome, new_tokens=[0] * len(accepted), times=PhaseTimes(verify=0.02))


def test_calibration_is_unchanged_by_a_grafted_chain():
    """A chain that runs along head nodes (raising their merged scores) and beyond them must not
    change what the heads' per-depth calibration learns."""
    proposal = heads()
    plain = build_draft_tree(proposal, [], budget=20, top_m=8, depth=4)
    first = plain.tree.paths[0]
    second = next(p for p in plain.tree.paths if len(p) == 2 and p[0] == first[0])
    ids = proposal.token_ids.tolist()
    chain = Chain(tokens=[ids[0][first[0]], ids[1][second[1]], 555, 556], chances=[0.99, 0.98, 0.97, 0.96],
                  source="lookup")
    grafted = build_draft_tree(proposal, [chain], budget=20, top_m=8, depth=4)
    assert dict(zip(grafted.tree.paths, grafted.tree.scores))[first] == 0.99  # merged score inflated
    assert grafted.chain_paths[0][:2] == [first, second]
    lookup_path = grafted.chain_paths[0][2]
    with_chain, without = AutoBudget(PROFILE), AutoBudget(PROFILE)
    for _ in range(3):  # the chain is accepted through a copied node the heads never proposed
        with_chain.observe(record(grafted, [first, second, lookup_path]))
        without.observe(record(plain, [first, second]))
    assert with_chain.calibration == without.calibration
    assert with_chain.calibration != DepthCalibration()  # it did learn something


def test_expected_acceptance_takes_the_larger_of_head_and_chain_estimates():
    proposal = heads()
    plain = build_draft_tree(proposal, [], budget=10, top_m=8, depth=4)
    first = plain.tree.paths[0]
    chain = Chain(tokens=[proposal.token_ids[0, first[0]].item(), 555], chances=[0.001, 0.0005], source="lookup")
    grafted = build_draft_tree(proposal, [chain], budget=10, top_m=8, depth=4)
    expected = dict(zip(grafted.tree.paths, AutoBudget(PROFILE).expected(grafted)))
    assert expected[first] == plain.head_scores[first]  # the head's own score is larger
    assert expected[grafted.chain_paths[0][1]] == 0.0005
