"""Per-user lab state, kept server-side in a bounded registry keyed by Gradio's session hash."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from labstate.errors import LabInputError, SessionExpired
from labstate.modes import PAUSED, RUNNING, STOPPED

if TYPE_CHECKING:
    from labstate.runs import Run


@dataclass
class LabState:
    """Everything one user (browser tab or API client) owns. Kept in a SessionRegistry, never global."""

    run: Run | None = None
    # plain greedy runs (labstate.plain.Reference) by (prompt, precision, max new tokens)
    references: OrderedDict[tuple[str, str, int], Any] = field(default_factory=OrderedDict)
    forward_seconds: dict[str, float] = field(default_factory=dict)  # precision -> one-token forward
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    epoch: int = 0  # bumped by Start, Stop, Reset and eviction: a running loop stops when it changes
    last_used: float = 0.0  # SessionRegistry clock
    client: str = ""  # who opened it (an address; "" when unknown): a client's flood evicts only its own
    active: int = 0  # handlers working on this state now (never evicted while > 0 unless idle-expired)
    stop_clicked_at: float | None = None  # the page's clock (ms) at the last Stop click: older clicks are dropped
    awaited_draw: int = 0  # the number of the last redraw a Run asked the page to say it has drawn (0: none)
    _drawn: threading.Event = field(default_factory=threading.Event, repr=False)  # set when the page says so
    _count_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def interrupt(self) -> None:
        """Make any running loop stop before its next step."""
        with self._count_lock:
            self.epoch += 1
            self._drawn.set()  # a loop waiting for the page to draw goes on to stop

    def stop(self, clicked_at: float | None = None) -> None:
        """Stop: a running loop and any step that is waiting end without stepping; the run says it stopped.

        `clicked_at` (the page's clock) also drops a Step or Run clicked before Stop that only gets its
        turn after it: the epoch alone cannot tell that one from a Step clicked after Stop.
        """
        with self._count_lock:  # with the epoch, so a step ending now cannot turn the run back to paused
            self.epoch += 1
            if clicked_at is not None:
                self.stop_clicked_at = max(clicked_at, self.stop_clicked_at or clicked_at)
            if self.run is not None:
                self.run.mode = STOPPED
            self._drawn.set()

    def pause_after_step(self, run: Run, epoch: int) -> None:
        """A Step ended: the run is paused, unless Stop, Start or Reset came while it stepped (it stays
        stopped) or a Run loop is driving it (it stays running)."""
        with self._count_lock:
            if self.epoch == epoch and run.mode != RUNNING:
                run.mode = PAUSED

    def pause_after_loop(self, run: Run) -> None:
        """A Run loop ended without finishing: running becomes paused (a stopped run stays stopped)."""
        with self._count_lock:
            if run.mode == RUNNING:
                run.mode = PAUSED

    def expect_drawing(self) -> int:
        """A redraw is about to go to a page that says when it has drawn it: that redraw's number."""
        with self._count_lock:
            self.awaited_draw += 1
            self._drawn.clear()
            return self.awaited_draw

    def mark_drawn(self, number: int) -> None:
        """The page says it has drawn redraw `number`; an older redraw's word is ignored."""
        with self._count_lock:
            if number == self.awaited_draw:
                self._drawn.set()

    def wait_drawn(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the page to draw the awaited redraw (or for Stop, Start,
        Reset); False when it did not say so in time."""
        return self._drawn.wait(timeout)

    def clicked_before_stop(self, clicked_at: float | None) -> bool:
        """A Step or Run clicked (page clock) before the last Stop: it must not step."""
        return clicked_at is not None and self.stop_clicked_at is not None and clicked_at <= self.stop_clicked_at

    def enter(self) -> None:
        """A handler starts working on this state (see `active`)."""
        with self._count_lock:
            self.active += 1

    def leave(self) -> None:
        with self._count_lock:
            self.active -= 1

    @contextmanager
    def working(self) -> Iterator[LabState]:
        """Mark the state busy (never evicted) while a handler works on it."""
        self.enter()
        try:
            yield self
        finally:
            self.leave()


class SessionRegistry:
    """Per-session LabStates keyed by Gradio's session hash, with caps and idle expiry.

    At most `max_sessions` live states, and at most `per_client` of one known client's (client "" is
    unknown: the server's own machine, no cap of its own); a state unused for `idle_seconds` is dropped.
    Room for a new session is made by evicting a state that is not working right now: first the opening
    client's own least recently used one (a client at its cap always churns its own), then another
    client's, but only one unused for `protect_seconds`: a flood of new sessions never takes a session
    someone used recently; when nothing may go, the new one is refused with a "busy" message. Evicted keys are remembered (bounded) so that their owner is told the session
    expired instead of silently getting a fresh one. Thread-safe.
    """

    def __init__(self, max_sessions: int = 32, idle_seconds: float = 1200.0,
                 clock: Callable[[], float] = time.monotonic, remember_evicted: int = 4096,
                 per_client: int | None = None, protect_seconds: float = 600.0) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self.per_client = max(1, per_client if per_client is not None else max_sessions)
        self.protect_seconds = protect_seconds
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._labs: OrderedDict[str, LabState] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[str, str] = OrderedDict()  # key -> why
        self._remember = remember_evicted
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._labs)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._labs

    def keys(self) -> list[str]:
        """The live sessions' keys, least recently used first."""
        with self._lock:
            return list(self._labs)

    def get(self, key: str) -> LabState | None:
        """The session's state (touched), None when it never had one; SessionExpired when it was dropped."""
        with self._lock:
            self._sweep()
            lab = self._labs.get(key)
            if lab is not None:
                self._touch(key, lab)
                return lab
            why = self._evicted.get(key)
        if why is not None:
            raise SessionExpired(f"Your session expired ({why}), so its run is gone. Press **Start** to begin "
                                 f"again.")
        return None

    def open(self, key: str, client: str = "") -> LabState:
        """The session's state, created when missing (forgetting an expiry) for `client` (its address).
        LabInputError when no session may make room (see the class)."""
        with self._lock:
            self._sweep()
            lab = self._labs.get(key)
            if lab is None:
                own = [k for k, v in self._labs.items() if v.client == client]
                if client and len(own) >= self.per_client:
                    self._make_room(client, own_only=True)
                elif len(self._labs) >= self.max_sessions:
                    self._make_room(client, own_only=False)
                lab = LabState(client=client)
                self._labs[key] = lab
                self._evicted.pop(key, None)
            self._touch(key, lab)
            return lab

    def drop(self, key: str) -> None:
        """Forget a session for good (its browser tab closed)."""
        with self._lock:
            lab = self._labs.pop(key, None)
            self._evicted.pop(key, None)
        if lab is not None:
            _clear(lab)

    def forget_expiry(self, key: str) -> None:
        with self._lock:
            self._evicted.pop(key, None)

    def is_live(self, key: str, lab: LabState) -> bool:
        with self._lock:
            return self._labs.get(key) is lab

    def touch(self, key: str, lab: LabState) -> None:
        with self._lock:
            if self._labs.get(key) is lab:
                self._touch(key, lab)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"live": len(self._labs), "max": self.max_sessions, "evictions": self.evictions,
                    "remembered_expired": len(self._evicted)}

    # -- internals (self._lock held) --
    def _make_room(self, client: str, own_only: bool) -> None:
        idle = [(k, v) for k, v in self._labs.items() if v.active == 0 and not v.lock.locked()]  # LRU first
        own = next((k for k, v in idle if v.client == client), None)
        if own is not None:
            why = (f"your address had {self.per_client} sessions open and this was its least recently used"
                   if own_only else f"{self.max_sessions} sessions were open and yours was the least recently used")
            self._evict(own, why)
            return
        if own_only:
            raise LabInputError(f"Your address has {self.per_client} sessions working right now, the most one "
                                f"address may have. Close a tab or wait for a run to end.")
        now = self.clock()
        other = next((k for k, v in idle if now - v.last_used >= self.protect_seconds), None)
        if other is not None:
            self._evict(other, f"{self.max_sessions} sessions were open and yours had been unused for more "
                               f"than {self.protect_seconds / 60:g} min")
            return
        if not idle:
            raise LabInputError(f"The lab is full: {len(self._labs)} sessions are busy right now. "
                                f"Try again in a minute.")
        raise LabInputError(f"The lab is busy: all {len(self._labs)} sessions were used in the last "
                            f"{self.protect_seconds / 60:g} min. Try again in a few minutes.")

    def _touch(self, key: str, lab: LabState) -> None:
        lab.last_used = self.clock()
        self._labs.move_to_end(key)

    def _sweep(self) -> None:
        now = self.clock()
        for key, lab in list(self._labs.items()):
            if now - lab.last_used <= self.idle_seconds:
                break  # ordered by last use: the rest are fresher
            self._evict(key, f"idle for more than {self.idle_seconds / 60:g} min")

    def _evict(self, key: str, why: str) -> None:
        lab = self._labs.pop(key)
        self._evicted[key] = why
        while len(self._evicted) > self._remember:
            self._evicted.popitem(last=False)
        self.evictions += 1
        _clear(lab)


def _clear(lab: LabState) -> None:
    """Free what a dropped state holds, even if a running loop still references it."""
    lab.interrupt()
    lab.run = None
    lab.references.clear()
