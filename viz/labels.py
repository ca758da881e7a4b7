"""Token text made visible and safe: whole characters from byte-level pieces, whitespace markers,
truncation, escaping for HTML and for plotly's text (which decodes only &amp; &lt; &gt; and numbers).

Byte-level tokenizers split a character (Arabic letters, emoji) over several tokens; decoded alone,
each part reads as "�". Given each token's raw bytes, a character is shown whole on the token that
completes it, and bytes that never complete a character show as readable pieces such as ‹0xE2›.
"""
from __future__ import annotations

import html
import unicodedata
from typing import Mapping, Sequence

WHITESPACE_MARKS = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
TokenBytes = Mapping[int, bytes]  # token id -> its raw UTF-8 bytes


def byte_piece(value: int) -> str:
    """One byte that is not (yet) a character, readable: ‹0xE2›."""
    return f"‹0x{value:02X}›"


def _char_length(lead: int) -> int:
    """Bytes in the UTF-8 character that starts with `lead`; 0 when `lead` cannot start one."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def split_utf8(data: bytes) -> tuple[str, bytes]:
    """Complete characters of `data` (invalid bytes as ‹0xNN›) and the unfinished tail of a character."""
    out: list[str] = []
    i = 0
    while i < len(data):
        need = _char_length(data[i])
        if need == 0:
            out.append(byte_piece(data[i]))
            i += 1
            continue
        chunk = data[i:i + need]
        if len(chunk) < need and all(0x80 <= b <= 0xBF for b in chunk[1:]):
            return "".join(out), bytes(chunk)  # may be completed by the next token
        try:
            out.append(chunk.decode("utf-8"))
            i += need
        except UnicodeDecodeError:
            out.append(byte_piece(data[i]))
            i += 1
    return "".join(out), b""


def pieces(data: bytes) -> str:
    """Bytes that form no character, each shown as ‹0xNN›."""
    return "".join(byte_piece(b) for b in data)


def continues(pending: bytes, data: bytes) -> bool:
    """Whether `data` goes on with the unfinished character `pending` (its first bytes are continuation bytes)."""
    if not pending or not data:
        return False
    missing = _char_length(pending[0]) - len(pending)
    return missing > 0 and all(0x80 <= b <= 0xBF for b in data[:missing])


def token_text(data: bytes, pending: bytes = b"") -> tuple[str, bytes]:
    """What one token shows after `pending` (its predecessors' unfinished character), and what stays pending.

    e.g. the two tokens of "ء" (bytes D8, A1): token_text(b"\\xd8") == ("", b"\\xd8"), then
    token_text(b"\\xa1", b"\\xd8") == ("ء", b""). A `pending` that `data` does not go on with is
    dropped: it belongs to the predecessor, which shows it as pieces.
    """
    return split_utf8((pending if continues(pending, data) else b"") + data)


def standalone_text(data: bytes, pending: bytes = b"") -> str:
    """One token's text on its own (a tree node, a head's guess): whole characters, then its unfinished bytes."""
    text, tail = token_text(data, pending)
    return text + pieces(tail)


def sequence_texts(chunks: Sequence[bytes]) -> list[tuple[str, bool]]:
    """Each token's text in a sequence and whether it ends inside a character that a later token completes.

    A character is shown on the token that completes it; bytes still unfinished at the end are pieces.
    """
    out: list[tuple[str, bool]] = []
    pending = b""
    for index, data in enumerate(chunks):
        text, pending = token_text(data, pending)
        following = chunks[index + 1] if index + 1 < len(chunks) else b""
        if pending and not continues(pending, following):
            text, pending = text + pieces(pending), b""
        out.append((text, bool(pending)))
    return out


def texts_from_bytes(token_ids: Sequence[int], token_bytes: TokenBytes | None,
                     fallback: Sequence[str]) -> list[str]:
    """Standalone texts of tokens from their bytes when known, else the recorded texts (or #id)."""
    if token_bytes is not None and all(t in token_bytes for t in token_ids):
        return [standalone_text(token_bytes[t]) for t in token_ids]
    if len(fallback) == len(token_ids):
        return list(fallback)
    return [f"#{t}" for t in token_ids]


def visible(text: str) -> str:
    """Whitespace made visible (space ␣, newline ↵, tab ⇥); an empty token shows as ∅. Not escaped."""
    if text == "":
        return "∅"
    return "".join(WHITESPACE_MARKS.get(ch, ch) for ch in text)


def shorten(text: str, limit: int = 12) -> str:
    """At most `limit` characters, with an ellipsis when cut (a ‹0xNN› piece is never cut in half)."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    start = cut.rfind("‹")
    if start > cut.rfind("›"):
        cut = cut[:start]
    return cut + "…"


def char_px(char: str, font_px: float = 12.0) -> float:
    """A generous estimate of one character's rendered width (wide East Asian glyphs and emoji count double)."""
    wide = unicodedata.east_asian_width(char) in ("W", "F") or ord(char) >= 0x1F000
    return font_px * (1.05 if wide else 0.62)


def text_px(text: str, font_px: float = 12.0) -> float:
    """Estimated rendered width of `text`."""
    return sum(char_px(c, font_px) for c in text)


def plotly_escape(text: str) -> str:
    """Escaping for plotly text and hover labels: & < > only (plotly does not decode &quot;)."""
    return html.escape(text, quote=False)


def token_label(text: str, limit: int = 12) -> str:
    """A plot label: visible whitespace, shortened, escaped for plotly."""
    return plotly_escape(shorten(visible(text), limit))


def token_hover(text: str) -> str:
    """The full token for hover text: visible whitespace, escaped for plotly."""
    return plotly_escape(visible(text))


def escape(text: str) -> str:
    """Plain HTML escaping (quotes too) for anything user- or model-supplied in HTML views."""
    return html.escape(str(text), quote=True)
