"""How the lab meets Gradio's server: who is asking (a tab's session key, the client behind a proxy, the
API or the page), how an error is answered (a toast for the page, gr.Error for the API, never a
traceback) and the queue's polling. app.py wires the events; this is what the events stand on.
"""
from __future__ import annotations

import ipaddress
import logging
import time
import uuid
from typing import Callable

import gradio as gr

import labstate

log = logging.getLogger("medusa_lab")  # the app's logger
LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")  # a request from this machine itself


def session_key(request: gr.Request | None) -> str:
    """The Gradio session hash (one per browser tab / API client); a throwaway key when there is none."""
    key = getattr(request, "session_hash", None) if request is not None else None
    return key if isinstance(key, str) and key else f"anonymous-{uuid.uuid4().hex}"


def client_address(request: gr.Request | None) -> str:
    """Who is asking, for the per-client session cap: behind a proxy (a Space; the peer is a loopback or
    private address) the forwarded address it names, else the peer's; "" for this machine's own browser
    or client (no cap: a lab on a laptop)."""
    host = str(getattr(getattr(request, "client", None), "host", "") or "")
    headers = getattr(request, "headers", None) or {}
    forwarded = str(headers.get("x-forwarded-for", "") or "").split(",")[0].strip()
    if forwarded and _is_proxy(host):
        return forwarded[:64]
    return "" if host in (*LOCAL_HOSTS, "") else host[:64]


def _is_proxy(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return address.is_loopback or address.is_private


def from_api(request: gr.Request | None) -> bool:
    """True for gradio_client (it sends `x-gradio-user: api`) and plain-HTTP `/call/` requests, False for the page."""
    if request is None:
        return True
    headers = getattr(request, "headers", None) or {}
    return headers.get("x-gradio-user") in ("api", "mcp") or "/call/" in str(getattr(request, "url", "") or "")


def answer(request: gr.Request | None, error: Exception, redraw: Callable[[str], tuple]) -> tuple:
    """LabNotice: a toast and the view with a note. LabInputError: gr.Error for the API; for the page a toast
    and the view untouched, with the message. Anything else is logged and reported in short, never a traceback."""
    if isinstance(error, gr.Error):
        raise error
    if isinstance(error, labstate.LabInputError):
        if from_api(request) and not isinstance(error, labstate.LabNotice):
            raise gr.Error(str(error), title="Cannot do that", print_exception=False)
        gr.Warning(str(error).replace("**", ""))
        return redraw(f"⚠️ {error}")
    log.exception("unexpected error in a lab event")
    text = f"{type(error).__name__}: {error}"
    raise gr.Error(f"Something went wrong ({text[:200]}); it was logged. Your other runs are unaffected; press "
                   f"Start to try again.", title="Internal error", print_exception=False) from None


def quiet_queue(demo: gr.Blocks, queue_poll_s: float, progress_poll_s: float) -> None:
    """Gradio's queue looks for work every millisecond and for progress every 10 ms, forever (on Linux): on
    a small machine each wake-up takes a core from the decoding's OpenMP team, whose two threads then wait
    for each other (served steps 55 ms against 45 in a plain process; the tensor thread preempted 4,600
    times in one 128-token run against 450). Waking every `queue_poll_s` costs a click at most that long."""
    queue = getattr(demo, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, queue_poll_s)
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, progress_poll_s)


def browser_on_this_machine(request: gr.Request | None) -> bool:
    """True for the page in a browser on this machine (a laptop in front of a class): where the decoding
    takes every core, its drawing runs in the decoding's time."""
    if from_api(request):
        return False
    host = getattr(getattr(request, "client", None), "host", "") or ""
    return host in LOCAL_HOSTS


def wait_for_the_browser(lab: labstate.LabState, seconds: float) -> None:
    """Leave the cores to a browser on this machine until it says it has drawn the redraw just sent (at
    most `seconds`), counted as the page's time: drawn beside the next steps, a redraw would cost them what
    their clock charges to decoding. Chromium on a 2-core EPYC says so 21-36 ms after a progress redraw
    (40-90 ms after a run's first); `offline.live_vs_bench --pairs` measures a live step against the
    benchmark's with and without the wait."""
    started = time.perf_counter()
    drawn = lab.wait_drawn(seconds)
    labstate.note_page_draw(lab, time.perf_counter() - started, drawn)
