"""A drafter family is one entry of the family table (core/families.py): a throwaway family registered
there is in the grammar, the page's choices and the decoder, and decodes plain greedy's text."""
from __future__ import annotations

import dataclasses

import pytest

import labstate
from core.decoder import DecodeConfig, decode
from core.families import DYNAMIC, FAMILIES
from core.strategy import grammar, parse_strategy
from core.records import StepKind
from tests.tiny import tiny_base, tiny_heads

TWIN = "twin"


@pytest.fixture
def twin_family(monkeypatch):
    """Medusa's dynamic tree under another name, rival choice and help texts of its own."""
    entry = dataclasses.replace(FAMILIES[DYNAMIC], name=TWIN, label="twin tree", rival="", store_help="",
                                help="The twin family: Medusa's heads under another name.", auto_help="",
                                lookup_help="", rival_choice="the twin heads")
    monkeypatch.setitem(FAMILIES, TWIN, entry)
    return entry


def test_a_registered_family_is_in_the_grammar(twin_family):
    spec = parse_strategy("twin:auto+lookup")
    assert (spec.family, spec.auto, spec.lookup, spec.grown) == (TWIN, True, True, True)
    assert "twin[:<n>|auto][+lookup][+store]" in grammar()
    assert spec.label == "twin tree (auto budget) + prompt lookup"


def test_a_registered_family_is_among_the_pages_choices(twin_family):
    from page import rivals
    assert {"twin", "twin:auto", "twin:auto+lookup"} <= set(labstate.ui_strategies())
    assert "twin:auto+lookup+store" not in labstate.ui_strategies()  # no store help: not offered
    assert labstate.strategy_help()["twin"] == twin_family.help
    assert labstate.strategy_help()["twin:auto"].startswith("The twin tree, sized every step")
    assert ("the twin heads", TWIN) in rivals() and TWIN in labstate.rival_choices()
    settings = labstate.parse_settings({"strategy": "twin:auto", "precision": "fp32"})
    assert settings.spec.family == TWIN


def test_a_registered_family_decodes_plain_greedys_text(twin_family):
    base = tiny_base("llama")
    heads = tiny_heads(base)
    prompt = list(range(40, 60))
    plain = decode(base, None, prompt, DecodeConfig(spec="ar", max_new_tokens=24)).output_ids
    session = decode(base, heads, prompt, DecodeConfig(spec="twin:15", max_new_tokens=24))
    assert session.output_ids == plain
    assert any(r.family == TWIN and r.kind == StepKind.TREE for r in session.records)
