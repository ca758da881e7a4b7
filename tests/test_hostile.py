"""A public Space and a hostile visitor: session floods, uploads that try to keep memory or inject markup,
event values the page would never send. Quick except the flood through the served app."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

import labstate
from labstate import replay
from labstate.trace import inert_text, load_trace
from tests.fakes import FakeClock
from viz.view import VIEW_FIELDS


# -- a flood of sessions --------------------------------------------------------------------------------
def test_a_flood_from_one_address_churns_its_own_sessions_and_never_another_clients():
    clock = FakeClock()
    registry = labstate.SessionRegistry(max_sessions=32, per_client=8, protect_seconds=600, clock=clock)
    victim = registry.open("victim", client="10.0.0.1")
    for i in range(40):  # 33 is enough to fill the old registry and evict the victim
        clock.now += 0.1
        registry.open(f"flood-{i}", client="10.0.0.2")
    assert registry.get("victim") is victim
    assert sum(1 for k in registry.keys() if k.startswith("flood-")) == 8  # its cap, its own oldest gone first
    with pytest.raises(labstate.SessionExpired, match="your address had 8 sessions open"):
        registry.get("flood-0")


def test_a_flood_from_many_addresses_is_refused_busy_before_it_evicts_a_recent_session():
    """Spoofed addresses get past the per-address cap, not past the rule that a session used in the last
    `protect_seconds` is never evicted for another client: the flood is told the lab is busy."""
    clock = FakeClock()
    registry = labstate.SessionRegistry(max_sessions=4, per_client=2, protect_seconds=600, clock=clock)
    victim = registry.open("victim", client="10.0.0.1")
    for i in range(3):
        registry.open(f"flood-{i}", client=f"10.1.0.{i}")
    clock.now = 100
    with pytest.raises(labstate.LabInputError, match="The lab is busy: all 4 sessions were used in the last 10 min"):
        registry.open("flood-4", client="10.1.0.4")
    assert registry.get("victim") is victim
    clock.now = 1000  # long unused now: those may make room (the victim was touched at 100)
    registry.open("later", client="10.2.0.1")
    assert registry.get("victim") is victim and "flood-0" not in registry


def test_the_client_address_is_the_forwarded_one_only_behind_a_proxy():
    import server

    def request(host: str, forwarded: str | None = None) -> SimpleNamespace:
        headers = {"x-forwarded-for": forwarded} if forwarded else {}
        return SimpleNamespace(client=SimpleNamespace(host=host), headers=headers)

    assert server.client_address(request("10.0.0.3", "203.0.113.7, 10.0.0.3")) == "203.0.113.7"  # a Space's proxy
    assert server.client_address(request("127.0.0.1", "203.0.113.8")) == "203.0.113.8"
    assert server.client_address(request("93.184.216.34", "203.0.113.7")) == "93.184.216.34"  # not a proxy: ignored
    assert server.client_address(request("127.0.0.1")) == ""  # this machine's own browser: no cap of its own
    assert server.client_address(None) == ""


@pytest.mark.slow
def test_a_flood_through_the_served_app_leaves_another_clients_session_stepping(monkeypatch):
    """Two clients behind a proxy (their forwarded addresses): the second opens 33 sessions over plain HTTP
    /call/start, the first steps on with its run."""
    import urllib.request

    import app
    import gradio_client

    from offline.served import free_port
    from tests.test_robustness import SETTINGS

    from core.budget.cost_profile import CostProfile
    monkeypatch.setattr(app, "SESSIONS", labstate.SessionRegistry(max_sessions=32, per_client=8))
    fake = CostProfile(sizes=[1, 16, 64, 256], ms=[30.0, 40.0, 90.0, 300.0], device="cpu", model="test")
    monkeypatch.setitem(labstate.shared.MODELS.profiles, "fp32", fake)  # no background measurement racing the flood
    port = free_port()
    app.demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                    **app.launch_kwargs())
    url = f"http://127.0.0.1:{port}/"
    try:
        victim = gradio_client.Client(url, verbose=False, download_files=False,
                                      headers={"X-Forwarded-For": "203.0.113.1"})
        small = {**SETTINGS, "max_new_tokens": 30}
        summary = victim.predict("Count from 1 to 20.", **small, api_name="/step")[app.VIEW_OUTPUT_NAMES.index("summary")]
        assert summary["steps"] == 1
        body = json.dumps({"data": ["Hi.", *[small[name] for name in labstate.SETTING_NAMES]]}).encode()
        for _ in range(33):
            call = urllib.request.Request(f"{url}gradio_api/call/start", data=body, method="POST",
                                          headers={"Content-Type": "application/json",
                                                   "X-Forwarded-For": "203.0.113.66"})
            with urllib.request.urlopen(call, timeout=60) as response:
                assert "event_id" in json.loads(response.read())
        view = victim.predict("Count from 1 to 20.", **small, api_name="/step")
        status = view[app.VIEW_OUTPUT_NAMES.index("status")]
        assert "expired" not in status and view[app.VIEW_OUTPUT_NAMES.index("summary")]["steps"] == 2, status
        flooder = [lab for lab in app.SESSIONS._labs.values() if lab.client == "203.0.113.66"]
        assert 1 <= len(flooder) <= 8
    finally:
        app.demo.close()


# -- event values the page would never send ----------------------------------------------------------------
@pytest.mark.parametrize("value", ["abc", [1], {"a": 1}, float("nan"), float("inf"), True])
def test_clicked_at_takes_the_pages_clock_or_nothing(value):
    with pytest.raises(labstate.LabInputError, match="clicked_at must be the page's clock"):
        labstate.parse_clicked_at(value)
    assert labstate.parse_clicked_at(None) is None and labstate.parse_clicked_at(1.7e12) == 1.7e12


def test_a_non_numeric_clicked_at_after_stop_is_a_message_not_a_type_error():
    import app

    request = SimpleNamespace(session_hash="hostile-clicked-at", headers={}, client=SimpleNamespace(host="127.0.0.1"),
                              url="http://127.0.0.1/gradio_api/call/step")
    app.SESSIONS.open("hostile-clicked-at").stop(clicked_at=5.0)
    try:
        with pytest.raises(Exception, match="clicked_at must be the page's clock") as raised:
            app.on_stop("soon", request=request)
        assert "TypeError" not in str(raised.value)
    finally:
        app.SESSIONS.drop("hostile-clicked-at")


# -- uploads ------------------------------------------------------------------------------------------------
def _gallery_data() -> dict:
    return json.loads((replay.GALLERY_DIR / replay.gallery()[0].file).read_text(encoding="utf-8"))


HOSTILE = '<img src="http://203.0.113.5/x.png"> ![pic](http://203.0.113.5/y.png) [link](http://203.0.113.5)'


def test_markup_in_an_uploaded_trace_is_shown_as_text():
    data = _gallery_data()
    data["meta"].update(title=HOSTILE, notice=HOSTILE, notes={"1": HOSTILE})
    data["facts"].update(note=HOSTILE, state=HOSTILE)
    data["facts"]["settings"]["precision"] = HOSTILE
    import app
    state = app.on_upload(json.dumps(data).encode(), None)[0]
    out = app.on_replay_step(state)
    shown = " ".join(str(getattr(out[1 + VIEW_FIELDS.index(name)], "value", out[1 + VIEW_FIELDS.index(name)]))
                     for name in ("status", "notice", "recording"))
    assert "&lt;img" in shown and not re.search(r"<img|!\[pic\]\(|\[link\]\(", shown)
    # the shipped gallery is the lab's own text: its Markdown is kept
    assert load_trace(json.dumps(data)).facts.notice == HOSTILE
    assert inert_text("mc_sim_7b_63 gguf-q8") == "mc_sim_7b_63 gguf-q8"


def test_uploads_and_drawn_views_stay_bounded_in_bytes(monkeypatch):
    import app
    import replay_events
    monkeypatch.setattr(replay, "UPLOADS", replay.BoundedCache(capacity=64, max_bytes=3_000_000))
    monkeypatch.setattr(replay_events, "RECORDED_VIEWS", replay.BoundedCache(capacity=512, max_bytes=2_000_000))
    data = _gallery_data()
    size = len(json.dumps(data))
    for i in range(20):  # 20 distinct uploads, a step drawn of each
        data["meta"]["title"] = f"upload {i}"
        state = app.on_upload(json.dumps(data).encode(), None)[0]
        app.on_replay_step(state)
    assert replay.UPLOADS.bytes <= 3_000_000 and 1 <= len(replay.UPLOADS) <= 3_000_000 // size + 1
    assert replay_events.RECORDED_VIEWS.bytes <= 2_000_000


def test_a_trace_that_loads_but_cannot_be_drawn_is_a_damaged_trace_message(monkeypatch):
    import app
    import replay_events
    state = app.on_upload(json.dumps(_gallery_data()).encode(), None)[0]

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(replay_events, "build_view", broken)
    replay_events.RECORDED_VIEWS.clear()
    with pytest.warns(UserWarning, match="This trace is damaged"):
        out = app.on_replay_step(state)
    assert "damaged" in out[1 + VIEW_FIELDS.index("status")] and "Traceback" not in out[1 + VIEW_FIELDS.index("status")]
