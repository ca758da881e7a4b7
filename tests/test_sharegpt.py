"""The ShareGPT first-turn reader: a cut-off JSON array, and what is kept. No package, no network."""
from __future__ import annotations

import json

from offline.datagen import mt_bench_questions
from offline.sharegpt import PromptStats, first_human_turns, iter_json_array


def conversation(cid: str, first: object, speaker: str = "human") -> dict:
    return {"id": cid, "conversations": [{"from": speaker, "value": first}, {"from": "gpt", "value": "ok"}]}


def test_a_truncated_array_yields_its_complete_elements_and_stops():
    rows = [conversation(str(i), f"question {i}") for i in range(5)]
    text = json.dumps(rows, indent=2)
    cut = text[: text.index('"question 3"') + 5]  # the file ends inside the 4th element
    assert [row["id"] for row in iter_json_array(cut)] == ["0", "1", "2"]
    assert list(iter_json_array(text)) == rows  # the whole array, untouched
    assert list(iter_json_array("")) == [] and list(iter_json_array("[")) == []


def test_duplicates_empty_non_text_and_mt_bench_turns_are_dropped():
    mt_bench = mt_bench_questions()[0]
    rows = [conversation("a", "How do I bake bread?"), conversation("b", "  how do I  BAKE bread? "),
            conversation("c", ""), conversation("d", "!!! ???"), conversation("e", {"image": 1}),
            conversation("f", mt_bench), conversation("g", "hi", speaker="gpt"),
            conversation("h", "x" * 3000), conversation("i", "¿Cómo se hornea el pan?")]
    stats = PromptStats()
    kept = first_human_turns(rows, refused=[mt_bench], max_chars=2000, stats=stats)
    assert [row["prompt"] for row in kept] == ["How do I bake bread?", "¿Cómo se hornea el pan?"]
    assert [row["id"] for row in kept] == ["sharegpt-a", "sharegpt-i"]  # non-English is kept
    assert stats.dropped == {"duplicate": 1, "empty or non-text": 3, "MT-Bench question": 1,
                             "not a human first turn": 1, "too long": 1}
    assert stats.conversations == 9 and stats.kept == 2
