"""The spec_mix evaluation set (offline/evalset.py): reproducible, balanced, original, within length bounds."""
from __future__ import annotations

import json
import re

import pytest

from offline.bench import read_prompts
from offline.evalset import (CATEGORIES, MAX_PROMPT_TOKENS, MIN_PER_CATEGORY, MIN_PROMPT_TOKENS, MT_BENCH, OUTPUT,
                          SOURCE_LABEL, TOKENIZER_DIR, build_rows, load_sources, load_tokenizer, mt_bench_questions,
                          prompt_tokens, to_jsonl)

SHINGLE_WORDS = 8


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return build_rows()


@pytest.fixture(scope="module")
def tokenizer():
    if not (TOKENIZER_DIR / "tokenizer.json").exists() and not (TOKENIZER_DIR / "tokenizer_config.json").exists():
        pytest.skip(f"no SmolLM2 tokenizer at {TOKENIZER_DIR}")
    return load_tokenizer()


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


def _shingles(text: str, n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_build_is_deterministic_and_the_committed_file_is_current(rows):
    again = build_rows(load_sources())
    assert again == rows
    assert to_jsonl(again) == to_jsonl(rows)
    assert OUTPUT.read_text(encoding="utf-8") == to_jsonl(rows), \
        "assets/data/spec_mix.jsonl is out of date: run python -m offline.evalset"


def test_every_category_has_enough_prompts_and_ids_are_unique(rows):
    counts = {category: sum(row["category"] == category for row in rows) for category in CATEGORIES}
    assert all(count >= MIN_PER_CATEGORY for count in counts.values()), counts
    assert len(rows) >= 48 and {row["category"] for row in rows} == set(CATEGORIES)
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids))
    assert all(set(row) == {"id", "category", "prompt", "source"} for row in rows)
    # category order, like MT-Bench: a strided subset keeps every category
    order = [row["category"] for row in rows]
    assert order == sorted(order, key=CATEGORIES.index)


def test_committed_text_is_authored_not_sharegpt(rows):
    assert all(row["source"] == SOURCE_LABEL for row in rows)
    assert not any("sharegpt" in row["id"].lower() for row in rows)


def test_no_mt_bench_question_text(rows):
    questions = mt_bench_questions(MT_BENCH)
    assert len(questions) >= 80
    mt_shingles = set().union(*(_shingles(q) for q in questions))
    mt_whole = {" ".join(_words(q)) for q in questions}
    for row in rows:
        text = " ".join(_words(row["prompt"]))
        assert not any(q in text for q in mt_whole), row["id"]
        shared = _shingles(row["prompt"]) & mt_shingles
        assert not shared, (row["id"], sorted(shared)[:3])


def test_source_material_sizes():
    sources = load_sources()
    for article in sources["summarization"]:
        assert 400 <= len(_words("\n".join(article["text"]))) <= 1200, article["id"]
    for item in sources["rag"]:
        assert 2 <= len(item["passages"]) <= 4, item["id"]
    languages = {item["source_lang"] for item in sources["translation"]} | \
                {item["target_lang"] for item in sources["translation"]}
    assert len(languages) >= 6 and {"English"} < languages
    assert any(item["source_lang"] == "English" for item in sources["translation"])
    assert any(item["target_lang"] == "English" for item in sources["translation"])


def test_prompt_lengths_within_bounds(rows, tokenizer):
    lengths = {row["id"]: prompt_tokens(tokenizer, row["prompt"]) for row in rows}
    for row_id, (bare, chat) in lengths.items():
        assert MIN_PROMPT_TOKENS <= bare and chat <= MAX_PROMPT_TOKENS, (row_id, bare, chat)
        assert chat + 128 < 2048
    bare = [b for b, _ in lengths.values()]
    assert min(bare) <= 20 and max(bare) >= 1200, "the set should span short questions to long documents"
    rag = [lengths[row["id"]][0] for row in rows if row["category"] == "rag"]
    assert 300 <= min(rag) and max(rag) <= 1500


def test_core_bench_reads_the_set(rows):
    prompts = read_prompts(OUTPUT, None)
    assert [p.id for p in prompts] == [row["id"] for row in rows]
    assert [p.text for p in prompts] == [row["prompt"] for row in rows]
    by_id = {row["id"]: row["category"] for row in rows}
    assert {by_id[p.id] for p in read_prompts(OUTPUT, None, stride=4)} == set(CATEGORIES)
    first = json.loads(OUTPUT.read_text(encoding="utf-8").splitlines()[0])
    assert first["prompt"] == prompts[0].text
