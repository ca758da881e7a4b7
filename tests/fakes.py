"""Stand-ins the tests share."""
from __future__ import annotations


class FakeClock:
    """A clock a test sets by hand (`now`), starting at 0: a registry's or a pacer's time, made explicit."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
