"""The generator survives interruption: no conversation lost or duplicated, every written answer
has the features captured while it was written (tiny in-process model, no package, no network)."""
from __future__ import annotations

import json

import pytest
import torch

import offline.datagen as datagen
from offline.datagen import GenConfig, answer_prompts, generate_batch, generate_with_features, load_captured
from offline.train import Features, load_training_features
from tests.tiny import tiny_base

PROMPTS = [{"id": f"p{i}", "prompt": "tell me about " + "abcdefghijklmnop"[: 3 + i], "source": "test/x"}
           for i in range(7)]


@pytest.fixture(scope="module")
def base():
    return tiny_base("llama")


def _config(tmp_path) -> GenConfig:
    return GenConfig(out=tmp_path / "gen.jsonl", max_new_tokens=6, batch_size=3)


def _reference(base, tmp_path) -> dict[str, list[int]]:
    clean = GenConfig(out=tmp_path / "clean.jsonl", max_new_tokens=6, batch_size=3)
    answer_prompts(base, PROMPTS, clean)
    return {row["id"]: row["answer_ids"] for row in datagen.read_rows(clean.out)}


def test_captured_features_are_what_a_forward_gives(base):
    """The hidden states kept while generating equal a teacher-forced forward's, and the
    answers equal plain generation's."""
    answers, features = generate_with_features(base, ["hello there", "hi"], 5)
    assert answers == generate_batch(base, ["hello there", "hi"], 5, sample=False)
    for prompt, answer, captured in zip(["hello there", "hi"], answers, features):
        ids = base.chat_ids(prompt) + answer
        with torch.inference_mode():
            hidden = base.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [T, H]
        start = len(ids) - len(answer) - 1
        expected = hidden[start:start + len(answer)].to(torch.bfloat16)  # hidden that predicted answer[j]
        assert captured.hidden.shape == expected.shape
        assert torch.allclose(captured.hidden.float(), expected.float(), atol=2e-2)
        assert captured.teacher_ids[:, 0].tolist() == answer  # greedy: the teacher's top-1 is the answer


def test_captured_taps_are_the_eagle_features_a_forward_gives(tmp_path):
    """Generation keeps the residual streams the EAGLE layer reads; its training shards built from
    them equal those of a teacher-forced forward over the written answers (no second forward)."""
    from core.drafters.eagle import eagle_taps
    from offline.eagle_features import extract, shard_features

    base = tiny_base("llama", num_hidden_layers=6)  # low, middle and last states all differ
    config = _config(tmp_path)
    answer_prompts(base, PROMPTS[:4], config)
    rows, found = load_captured(config.out, tapped=True)
    assert all(found[r["id"]].tapped.shape == (2, len(r["answer_ids"]), base.model.config.hidden_size) for r in rows)
    assert load_captured(config.out)[1][rows[0]["id"]].tapped is None  # the heads' trainers never load them
    rows = [r for r in rows if len(r["answer_ids"]) >= 2]
    captured, forward = shard_features(None, rows, found), extract(base, rows)
    assert eagle_taps(base.model.config.num_hidden_layers) == (2, 3)
    assert captured.tokens.tolist() == forward.tokens.tolist() == [t for r in rows for t in r["answer_ids"]]
    assert captured.remaining.tolist() == forward.remaining.tolist()
    for name in ("low", "mid", "high"):
        assert torch.allclose(getattr(captured, name).float(), getattr(forward, name).float(), atol=3e-2), name
    assert captured.teacher_ids[:, 0].tolist() == forward.teacher_ids[:, 0].tolist()
    # an answer written before generation kept the taps is extracted; without a model that is an error
    del found[rows[0]["id"]]
    with pytest.raises(ValueError, match="no captured taps"):
        shard_features(None, rows, found)
    mixed = shard_features(base, rows, found)
    assert sorted(mixed.tokens.tolist()) == sorted(forward.tokens.tolist())


def test_interrupted_between_features_and_rows_resumes_exactly(base, tmp_path, monkeypatch):
    reference = _reference(base, tmp_path)
    config = _config(tmp_path)
    real_save = datagen._save_shard
    calls = {"n": 0}

    def dying_save(folder, rows, features):
        real_save(folder, rows, features)
        calls["n"] += 1
        if calls["n"] == 2:  # killed after the second batch's features, before its rows
            raise KeyboardInterrupt

    monkeypatch.setattr(datagen, "_save_shard", dying_save)
    with pytest.raises(KeyboardInterrupt):
        answer_prompts(base, PROMPTS, config)
    assert len(datagen.read_rows(config.out)) == 3
    monkeypatch.setattr(datagen, "_save_shard", real_save)
    answer_prompts(base, PROMPTS, config)
    rows, found = load_captured(config.out)
    assert sorted(r["id"] for r in rows) == sorted(reference)  # none lost, none twice
    assert {r["id"]: r["answer_ids"] for r in rows} == reference
    assert set(found) == set(reference)
    assert all(len(found[r["id"]].hidden) == len(r["answer_ids"]) for r in rows)


def test_half_written_line_is_cut_and_answered_again(base, tmp_path):
    reference = _reference(base, tmp_path)
    config = _config(tmp_path)
    answer_prompts(base, PROMPTS[:3], config)
    with config.out.open("a") as sink:  # a writer killed in the middle of a row
        sink.write(json.dumps({"id": "p3", "answer_ids": [1, 2]})[:17])
    answer_prompts(base, PROMPTS, config)
    rows = datagen.read_rows(config.out)
    assert sorted(r["id"] for r in rows) == sorted(reference)
    assert config.out.read_text().endswith("\n")


def test_training_features_line_up_with_answers(base, tmp_path):
    config = _config(tmp_path)
    answer_prompts(base, PROMPTS, config)
    features, card = load_training_features(base, [config.out], extract_missing=False)
    rows = datagen.read_rows(config.out)
    assert card.answers == len(PROMPTS) and card.tokens == sum(len(r["answer_ids"]) for r in rows)
    assert isinstance(features, Features)
    assert features.tokens.tolist() == [t for r in rows for t in r["answer_ids"]]
    # remaining counts down to 0 at each answer's last token
    ends = [i for i, left in enumerate(features.remaining.tolist()) if left == 0]
    assert len(ends) == len(rows)


def test_the_last_shard_holding_a_row_wins(tmp_path):
    """An orphan shard (its run died before writing the rows) may hold another answer to the same
    prompt; the shard written just before the row is the one that matches it."""
    from offline.datagen import AnswerFeatures, _save_shard

    def features(length: int, value: float) -> AnswerFeatures:
        return AnswerFeatures(hidden=torch.full((length, 4), value).bfloat16(),
                              teacher_ids=torch.zeros(length, 2, dtype=torch.int32),
                              teacher_probs=torch.ones(length, 2).half())

    out = tmp_path / "gen.jsonl"
    row = {"id": "p0", "answer_ids": [5, 6, 7]}
    _save_shard(datagen.features_dir(out), [{"id": "p0"}], [features(5, 1.0)])  # the orphan
    _save_shard(datagen.features_dir(out), [row], [features(3, 2.0)])
    out.write_text(json.dumps(row) + "\n")
    _, found = load_captured(out)
    assert len(found["p0"].hidden) == 3 and float(found["p0"].hidden[0, 0]) == 2.0


def test_a_reader_never_cuts_the_file(tmp_path):
    out = tmp_path / "gen.jsonl"
    out.write_text('{"id": "a", "answer_ids": [1]}\n{"id": "b", "ans')
    assert [r["id"] for r in datagen.read_rows(out)] == ["a"]
    assert out.read_text().endswith('"ans')  # a writer may still be appending
    datagen.read_rows(out, repair=True)
    assert out.read_text().endswith("\n")


def test_answers_committed_elsewhere_and_other_families_are_skipped(base, tmp_path):
    """A licence-clean round answers only the chosen source families, never a prompt that a
    committed answer file (gzip) already holds, and gives another seed's self-prompts ids of
    their own."""
    import gzip
    committed = tmp_path / "committed.jsonl.gz"
    committed.write_bytes(gzip.compress(json.dumps({"id": "p1", "answer_ids": [1]}).encode() + b"\n"))
    prompts = PROMPTS + [{"id": "q0", "prompt": "a code question", "source": "other/code"}]
    config = GenConfig(out=tmp_path / "gen.jsonl", max_new_tokens=4, batch_size=3,
                       families=("test/",), skip_answered=(committed,))
    assert {p["id"] for p in datagen.wanted_prompts(prompts, config)} == {p["id"] for p in PROMPTS} - {"p1"}
    answer_prompts(base, prompts, config)
    assert {row["id"] for row in datagen.read_rows(config.out)} == {p["id"] for p in PROMPTS} - {"p1"}
    assert datagen._self_prompt_id(0, 3) == "self-3" and datagen._self_prompt_id(1, 3) == "self-s1-3"


def test_a_capped_run_holds_at_most_max_answers_across_resumes(base, tmp_path):
    """`max_answers` caps the file, not one run: a resumed run answers only what is missing."""
    config = GenConfig(out=tmp_path / "gen.jsonl", max_new_tokens=4, batch_size=2, max_answers=3)
    answer_prompts(base, PROMPTS[:2], config)
    assert len(datagen.read_rows(config.out)) == 2
    answer_prompts(base, PROMPTS, config)
    assert len(datagen.read_rows(config.out)) == 3
    answer_prompts(base, PROMPTS, config)
    rows, found = load_captured(config.out)
    assert len(rows) == 3 and set(found) == {r["id"] for r in rows}


def test_sampled_answers_without_features_resume_by_their_own_ids(base, tmp_path):
    """`samples=2`: two sampled answers a prompt (ids `<id>#s1`, `<id>#s2`), token ids alone (no features
    folder); a rerun answers only what is missing, and the first answers are kept as written."""
    config = GenConfig(out=tmp_path / "sampled.jsonl", max_new_tokens=6, batch_size=3, samples=2,
                       keep_features=False)
    answer_prompts(base, PROMPTS[:3], config)
    first = {row["id"]: row["answer_ids"] for row in datagen.read_rows(config.out)}
    assert sorted(first) == sorted(f"p{i}#s{k}" for i in range(3) for k in (1, 2))
    assert not datagen.features_dir(config.out).exists()
    answer_prompts(base, PROMPTS[:4], config)
    rows = datagen.read_rows(config.out)
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}#s{k}" for i in range(4) for k in (1, 2))
    assert {r["id"]: r["answer_ids"] for r in rows if r["id"] in first} == first
    assert all(r["prompt"] == PROMPTS[int(r["id"][1])]["prompt"] for r in rows)
