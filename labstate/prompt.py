"""Prompt checks: what a tokenizer cannot take is removed, and the user is told what changed."""
from __future__ import annotations

import unicodedata

from labstate.errors import LabInputError
from labstate.limits import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS

KEEP_CHARS = {"\n", "\t"}  # control characters a prompt may keep ("\r\n" becomes "\n")


def sanitize_prompt(prompt: object) -> tuple[str, str]:
    """The prompt with what a tokenizer cannot take removed, and a note saying what changed.

    Lone UTF-16 surrogates (a browser can send "\\ud800"; UTF-8 cannot encode them) become U+FFFD;
    control characters other than newline and tab are removed (CR LF becomes LF). Right-to-left
    text, emoji, joiners and direction marks are kept as they are. LabInputError for non-text.
    """
    if prompt is None:
        return "", ""
    if not isinstance(prompt, str):
        raise LabInputError(f"the prompt must be text, got {type(prompt).__name__}")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise LabInputError(f"The prompt is {len(prompt):,} characters; the lab accepts prompts of up to "
                            f"{MAX_PROMPT_TOKENS:,} tokens (a few thousand characters). Shorten it.")
    text = prompt.replace("\r\n", "\n")
    surrogates = controls = 0
    out = []
    for char in text:
        if "\ud800" <= char <= "\udfff":
            surrogates += 1
            out.append("\ufffd")
        elif char not in KEEP_CHARS and unicodedata.category(char) == "Cc":
            controls += 1
        else:
            out.append(char)
    notes = []
    if surrogates:
        notes.append(f"replaced {surrogates} invalid character{'s' if surrogates > 1 else ''} "
                     f"(lone UTF-16 surrogate{'s' if surrogates > 1 else ''}) with �")
    if controls:
        notes.append(f"removed {controls} control character{'s' if controls > 1 else ''}")
    note = ("Prompt cleaned: " + " and ".join(notes) + ".") if notes else ""
    return "".join(out) if notes else text, note
