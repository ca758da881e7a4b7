"""What the lab tells a user instead of a traceback."""
from __future__ import annotations


class LabInputError(ValueError):
    """Bad user input (prompt, settings, custom tree); the message is for the page and the API."""


class LabNotice(LabInputError):
    """An action that does not apply right now (run finished, nothing to check, session expired): shown as a
    note rather than an error. A LabInputError subclass, so callers that catch LabInputError see both."""


class SessionExpired(LabNotice):
    """The session's state was dropped (idle too long, or evicted to make room)."""


def show(value: object, limit: int = 60) -> str:
    """A short repr for messages (an API client may send a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
