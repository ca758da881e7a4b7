"""Token text made visible and safe: whitespace markers, truncation, HTML escaping."""
from __future__ import annotations

import html

WHITESPACE_MARKS = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """Whitespace made visible (space ␣, newline ↵, tab ⇥); an empty token shows as ∅. Not escaped."""
    if text == "":
        return "∅"
    return "".join(WHITESPACE_MARKS.get(ch, ch) for ch in text)


def shorten(text: str, limit: int = 12) -> str:
    """At most `limit` characters, with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def token_label(text: str, limit: int = 12) -> str:
    """A plot label: visible whitespace, shortened, then HTML-escaped (plotly renders entities)."""
    return html.escape(shorten(visible(text), limit), quote=True)


def token_hover(text: str) -> str:
    """The full token for hover text: visible whitespace, HTML-escaped."""
    return html.escape(visible(text), quote=True)


def escape(text: str) -> str:
    """Plain HTML escaping (quotes too) for anything user- or model-supplied."""
    return html.escape(str(text), quote=True)
