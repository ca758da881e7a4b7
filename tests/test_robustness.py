"""Robustness of the app: bad input, many users, cancellation, the session cap, nothing let in.

Everything goes through gradio_client (or raw HTTP where gradio_client cannot send the input)
against the app launched in this process on a free port, except the session-cap test, which
starts `python app.py` with a cap of 3 in a subprocess to measure the server's own memory.
Settings are small (budget 15, a dozen new tokens) so the file runs in well under 3 minutes on
a 2-core CPU.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
psutil = pytest.importorskip("psutil")

from gradio_client.exceptions import AppError  # noqa: E402

import app  # noqa: E402  (builds the Blocks; launches nothing)
from offline.served import free_port, stop  # noqa: E402
import labstate  # noqa: E402
import page  # noqa: E402
from core.decoder import DecodeConfig, decode  # noqa: E402
from core.budget.cost_profile import CostProfile  # noqa: E402
from tests.fakes import FakeClock  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:.*no_silent_downcasting:Warning"),
              pytest.mark.filterwarnings("ignore:The copy keyword is deprecated:Warning")]

REPO = Path(__file__).resolve().parent.parent
OUT = {name: i for i, name in enumerate(app.VIEW_OUTPUT_NAMES)}
SETTINGS = dict(strategy="dynamic", budget=15, top_m=8, depth=4, fixed_preset="mc_sim_7b_63", rule="greedy",
                temperature=0.0, precision="fp32", max_new_tokens=12, compare_fixed=False, custom_tree="",
                compare_heads=False)
PROMPT_A = "Write a haiku about cats."
PROMPT_B = "Name three rivers in Europe."
LONG_A = "Count from 1 to 200, one number per line."  # no EOS for hundreds of tokens: room for many steps
LONG_B = "List the numbers from 1 to 100, separated by commas."
RSS_LIMIT_BYTES = 3 * 1024 ** 3


@pytest.fixture(scope="module")
def url():
    """The app in this process, with a fresh session registry (so earlier test modules do not count)."""
    saved, saved_profiles = app.SESSIONS, dict(labstate.shared.MODELS.profiles)
    fake = CostProfile(sizes=[1, 16, 64, 256], ms=[30.0, 40.0, 90.0, 300.0], device="cpu", model="test")
    labstate.shared.MODELS.profiles.update({"fp32": fake, "bf16": fake, "gguf": fake})  # no 5-10 s measurement here
    app.SESSIONS = labstate.SessionRegistry(max_sessions=64, idle_seconds=600)
    port = free_port()
    app.demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                    **app.launch_kwargs())
    yield f"http://127.0.0.1:{port}/"
    app.demo.close()
    app.SESSIONS = saved
    labstate.shared.MODELS.profiles.clear()
    labstate.shared.MODELS.profiles.update(saved_profiles)


@pytest.fixture(scope="module")
def plain_greedy():
    """Plain greedy decoding by core (the yardstick), cached per (prompt, tokens)."""
    base = labstate.runtime("fp32").base
    cache: dict[tuple[str, int], list[int]] = {}

    def run(prompt: str, max_new_tokens: int = SETTINGS["max_new_tokens"]) -> list[int]:
        if (prompt, max_new_tokens) not in cache:
            config = DecodeConfig(spec="ar", max_new_tokens=max_new_tokens)
            cache[prompt, max_new_tokens] = decode(base, None, prompt, config).output_ids
        return cache[prompt, max_new_tokens]

    return run


def _client(url: str):
    return gradio_client.Client(url, verbose=False, download_files=False)


def _call(client, api: str, prompt=None, **overrides):
    if api in ("start", "step", "run"):
        kwargs = {**SETTINGS, **overrides}
        if api == "run":
            return client.submit(prompt, **kwargs, api_name="/run").result()  # the last update; raises AppError
        return client.predict(prompt, **kwargs, api_name=f"/{api}")
    return client.predict(**overrides, api_name=f"/{api}")


def _server_lab(client) -> labstate.LabState:
    """The client's state inside the in-process server (for checks the API cannot make)."""
    return app.SESSIONS._labs[client.session_hash]


# -- bad input ----------------------------------------------------------------------------------------
NUM_HEADS = page._num_heads(4)
CHAIN_TOO_DEEP = json.dumps([[0] * d for d in range(1, NUM_HEADS + 2)])
TOO_MANY_PATHS = json.dumps([[r] for r in range(60)] + [[r, c] for r in range(8) for c in range(30)])

# (endpoint, prompt, setting overrides, regex the error message must match)
BAD_INPUTS = [
    ("start", "", {}, r"Type a prompt"),
    ("start", " \n\t  ", {}, r"Type a prompt"),  # (Step and Run on a paused run never read the prompt box)
    ("start", "\x00\x01\x7f", {}, r"Type a prompt"),  # nothing left once control characters are removed
    ("start", 12345, {}, r"the prompt must be text, got int"),
    ("start", "x" * 50_000, {}, r"The prompt is [\d,]+ tokens \(50,000 characters\); the lab accepts prompts of "
                                r"up to 2,048 tokens"),
    ("start", "hello " * 9_000, {}, r"The prompt is (9,\d\d\d) tokens .*the model's context is 8,192 tokens"),
    ("start", "y" * 200_000, {}, r"The prompt is 200,000 characters"),
    ("start", PROMPT_A, {"budget": 10 ** 9}, r"node budget must be between 1 and 256, got 1000000000"),
    ("step", PROMPT_A, {"budget": "abc"}, r"node budget must be a whole number, got 'abc'"),
    ("start", PROMPT_A, {"budget": 15.5}, r"node budget must be a whole number, got 15.5"),
    ("start", PROMPT_A, {"budget": [15]}, r"node budget must be a whole number, got \[15\]"),
    ("start", PROMPT_A, {"top_m": 0}, r"top-m must be between 1 and 64, got 0"),
    ("start", PROMPT_A, {"depth": 99}, r"depth must be between 1 and 16, got 99"),
    ("start", PROMPT_A, {"depth": NUM_HEADS + 1}, rf"depth {NUM_HEADS + 1} exceeds the {NUM_HEADS} heads loaded"),
    ("step", PROMPT_A, {"temperature": -1}, r"temperature must be a number between 0 and 2, got -1"),
    ("start", PROMPT_A, {"temperature": "hot", "rule": "typical"}, r"temperature must be a number between 0 and 2"),
    ("start", PROMPT_A, {"temperature": 0.7}, r"the greedy rule needs temperature 0"),
    ("run", PROMPT_A, {"max_new_tokens": 10 ** 6}, r"max new tokens must be between 1 and 1024, got 1000000"),
    ("start", PROMPT_A, {"max_new_tokens": None}, r"max new tokens must be a whole number, got None"),
    ("start", PROMPT_A, {"strategy": "beam"}, r"strategy must be one of ar, fixed, dynamic, "
                                              r"dynamic:auto, dynamic:auto\+lookup, dynamic:auto\+lookup\+store, hydra, "
                                              r"hydra:auto, hydra:auto\+lookup, eagle, eagle:auto, eagle:auto\+lookup, "
                                              r"got 'beam'"),
    ("start", PROMPT_A, {"precision": "fp8"}, r"precision must be one of fp32, bf16, gguf, gguf-q8, got 'fp8'"),
    ("start", PROMPT_A, {"fixed_preset": "../../etc/passwd"}, r"unknown fixed tree '../../etc/passwd'"),
    ("start", PROMPT_A, {"compare_fixed": "yes"}, r"compare with the fixed tree must be true or false"),
    # the custom tree box
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "[[0], [1"},
     r"custom tree: not valid JSON \(.* at line 1 column \d+\)"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": '{"paths": [[0]]}'},
     r"custom tree must be a JSON list of rank paths .*got an object"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "7"}, r"custom tree must be a JSON list .*got int"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "[[0], [-1]]"},
     r"custom tree: ranks must be whole numbers from 0 to 63; path \[-1\] has -1"),
    ("step", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "[[0], [0.5]]"},
     r"custom tree: ranks must be whole numbers .* has 0.5"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "[[0], [1, 0]]"},
     r"custom tree: path \[1, 0\] has no parent \[1\] in the tree"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "[[0], 3]"},
     r"custom tree: path 2 must be a non-empty list of ranks, got 3"),
    ("start", PROMPT_A, {"strategy": "fixed", "fixed_preset": "custom", "custom_tree": CHAIN_TOO_DEEP},
     rf"custom tree: path \[0(, 0){{{NUM_HEADS}}}\] is {NUM_HEADS + 1} deep but only {NUM_HEADS} heads are loaded"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": TOO_MANY_PATHS},
     r"custom tree has 300 paths; the lab accepts up to 256"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "[]"}, r"custom tree is empty"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "  "}, r"custom tree: the box is empty"),
    ("start", PROMPT_A, {"fixed_preset": "custom", "compare_fixed": True, "custom_tree": "[" * 30_000}, r"custom tree: the text is 30,000 "
                                                                                   r"characters"),
]


@pytest.fixture(scope="module")
def two_sessions(url):
    """Session A mid-run on LONG_A (the one that gets the bad input) and session B mid-run on LONG_B."""
    a, b = _client(url), _client(url)
    long_run = {"max_new_tokens": 200}
    assert _call(a, "step", LONG_A, **long_run)[OUT["summary"]]["steps"] == 1
    assert _call(b, "step", LONG_B, **long_run)[OUT["summary"]]["steps"] == 1
    return a, b, long_run


@pytest.mark.parametrize("api, prompt, overrides, message", BAD_INPUTS,
                         ids=[f"{i:02d}-{case[0]}" for i, case in enumerate(BAD_INPUTS)])
def test_bad_input_is_refused_with_a_message_and_both_sessions_go_on(two_sessions, api, prompt, overrides, message):
    a, b, long_run = two_sessions
    before = _server_lab(a).run.session
    steps_before = len(before.records)
    with pytest.raises(AppError) as raised:
        _call(a, api, prompt, **{**long_run, **overrides})
    assert re.search(message, str(raised.value)), str(raised.value)
    assert "Traceback" not in str(raised.value)
    if "9," in message:  # the over-long prompt: the count really is above the context
        assert int(re.search(message, str(raised.value)).group(1).replace(",", "")) > 8192
    # the same session still has its run and steps on; so does another session
    view = _call(a, "step", LONG_A, **long_run)
    summary = view[OUT["summary"]]
    assert _server_lab(a).run.session is before
    assert summary["prompt"] == LONG_A and summary["steps"] == steps_before + 1, view[OUT["status"]]
    assert _call(b, "step", LONG_B, **long_run)[OUT["summary"]]["prompt"] == LONG_B


def test_bad_step_index_and_actions_that_do_not_apply(url):
    client = _client(url)
    with pytest.raises(AppError, match="step index must be a whole number, got 'abc'"):
        client.predict(step_index="abc", api_name="/view")
    view = client.predict(api_name="/check")
    assert "Nothing to check yet" in view[OUT["status"]]
    view = client.predict(step_index=3, api_name="/view")  # no run yet: the empty page, not an error
    assert view[OUT["summary"]] == {} or view[OUT["summary"]] is None
    assert client.predict(api_name="/trace") is None


def test_control_characters_are_removed_and_rtl_and_emoji_just_work(url, plain_greedy):
    client = _client(url)
    view = _call(client, "start", "Say hi\x00 to\x07 me\x1b[0m.\r\nThanks")
    assert "Prompt cleaned: removed 3 control characters" in view[OUT["status"]]
    assert view[OUT["summary"]]["prompt"] == "Say hi to me[0m.\nThanks"
    rtl = "ما هو لون السماء؟ ‏🌤️ שלום עולם 👋🏽 and 👩‍👩‍👧"
    assert "Prefilled" in _call(client, "start", rtl, max_new_tokens=6)[OUT["status"]]
    final = _call(client, "run", rtl, max_new_tokens=6)
    summary = final[OUT["summary"]]
    assert summary["prompt"] == rtl and "cleaned" not in final[OUT["status"]]
    assert summary["finished"] and summary["output_ids"] == plain_greedy(rtl, 6)


def _raw_call(url: str, api: str, data: list) -> tuple[str, str]:
    """POST /gradio_api/call/<api> with JSON that gradio_client cannot send, then read the SSE result."""
    body = json.dumps({"data": data}).encode("ascii")  # ensure_ascii: a lone surrogate travels as \\ud800
    request = urllib.request.Request(f"{url}gradio_api/call/{api}", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        event_id = json.loads(response.read())["event_id"]
    with urllib.request.urlopen(f"{url}gradio_api/call/{api}/{event_id}", timeout=120) as response:
        text = response.read().decode("utf-8")
    event = re.findall(r"^event: (\w+)$", text, re.M)[-1]
    data_line = re.findall(r"^data: (.*)$", text, re.M)[-1]
    return event, data_line


def test_lone_surrogates_are_replaced_not_a_crash(url):
    settings = [SETTINGS[k] for k in labstate.SETTING_NAMES]
    event, data = _raw_call(url, "start", ["\ud800 Hello \udfff there", *settings])
    assert event == "complete", data
    outputs = json.loads(data)
    assert "replaced 2 invalid characters (lone UTF-16 surrogates) with \ufffd" in outputs[OUT["status"]]
    assert outputs[OUT["summary"]]["prompt"] == "\ufffd Hello \ufffd there"
    event, data = _raw_call(url, "start", ["   ", *settings])  # errors reach plain-HTTP callers as text too
    assert event == "error" and "Type a prompt" in data


# -- cancellation --------------------------------------------------------------------------------------
def _wait_outputs(job, count: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(job.outputs()) < count and time.time() < deadline:
        time.sleep(0.1)
    assert len(job.outputs()) >= count


def test_cancelled_run_stops_computing(url):
    client = _client(url)
    job = client.submit(PROMPT_B, **{**SETTINGS, "max_new_tokens": 300}, api_name="/run")
    _wait_outputs(job, 2)
    assert job.cancel()
    lab = _server_lab(client)
    deadline = time.time() + 30
    while lab.active and time.time() < deadline:  # the step in flight finishes, then the loop is closed
        time.sleep(0.05)
    assert lab.active == 0
    session = lab.run.session
    steps = len(session.records)
    time.sleep(2.0)
    assert len(session.records) == steps and not session.finished  # the loop is not stepping on in the background
    view = _call(client, "step", PROMPT_B, max_new_tokens=300)  # and the run can be continued by hand
    assert view[OUT["summary"]]["steps"] == steps + 1


def test_stop_endpoint_ends_the_run_loop(url):
    client = _client(url)  # a prompt with no EOS for hundreds of tokens: a haiku ended itself before Stop landed
    job = client.submit(LONG_A, **{**SETTINGS, "max_new_tokens": 300}, api_name="/run")
    _wait_outputs(job, 2)
    client.predict(api_name="/stop")
    deadline = time.time() + 30
    while not job.done() and time.time() < deadline:
        time.sleep(0.1)
    assert job.done()  # the generator returned by itself
    session = _server_lab(client).run.session
    steps = len(session.records)
    time.sleep(1.5)
    assert len(session.records) == steps < 299 and not session.finished


# -- many users ---------------------------------------------------------------------------------------
def test_eight_clients_stepping_interleaved_get_their_own_exact_text(url, plain_greedy, mt_bench_prompts):
    prompts = sorted(mt_bench_prompts, key=len)[:8]
    assert len(set(prompts)) == 8
    expected = {p: plain_greedy(p) for p in prompts}
    base = labstate.runtime("fp32").base

    def drive(prompt: str) -> tuple[dict, str, int]:
        client = _client(url)
        for calls in range(1, 40):
            view = _call(client, "step", prompt)
            if view[OUT["summary"]]["finished"]:
                return view[OUT["summary"]], view[OUT["plain_text"]], calls
        raise AssertionError(f"{prompt!r} did not finish")

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(drive, prompts))
    total_steps = sum(calls for _, _, calls in results)
    for prompt, (summary, text, _) in zip(prompts, results):
        assert summary["prompt"] == prompt
        assert summary["output_ids"] == expected[prompt]
        assert text == base.decode(expected[prompt])
        assert summary["greedy_check"]["state"] == "ok"
    print(f"8 clients, {total_steps} interleaved step calls, all exact")


def test_auto_budget_shows_the_node_count_chosen_each_step(url, plain_greedy, monkeypatch):
    # a made-up cost profile (verify cost rising steeply with size) instead of a 5-10 s measurement
    profile = CostProfile(sizes=[1, 4, 16, 64], ms=[10.0, 14.0, 40.0, 160.0], device="cpu", model="test")
    monkeypatch.setitem(labstate.shared.MODELS.profiles, str(labstate.runtime("fp32").base.dtype), profile)
    client = _client(url)
    view = _call(client, "step", PROMPT_A, strategy="dynamic:auto", max_new_tokens=6)
    nodes = view[OUT["summary"]]["nodes_per_step"]
    assert len(nodes) == 1 and 0 <= nodes[0] <= SETTINGS["budget"]
    assert f"Auto budget chose **{nodes[0]} node(s)** at step 1" in view[OUT["status"]]
    assert f"auto budget: {nodes[0]} of ≤ 15 nodes" in view[OUT["tree"]]["plot"]
    assert view[OUT["summary"]]["settings"]["auto_budget"] is True
    final = _call(client, "run", PROMPT_A, strategy="dynamic:auto", max_new_tokens=6)
    summary = final[OUT["summary"]]
    assert summary["output_ids"] == plain_greedy(PROMPT_A, 6)
    assert len(summary["nodes_per_step"]) == summary["steps"]
    assert all(0 <= n <= 15 for n in summary["nodes_per_step"])


def test_lookup_strategy_copies_through_the_api(url, plain_greedy, monkeypatch):
    """dynamic:auto+lookup through gradio_client: exact output, copied nodes accepted, labelled as such."""
    profile = CostProfile(sizes=[1, 16, 64], ms=[10.0, 11.0, 40.0], device="cpu", model="test")
    monkeypatch.setitem(labstate.shared.MODELS.profiles, str(labstate.runtime("fp32").base.dtype), profile)
    prompt = "Repeat exactly: red, orange, yellow, green, blue, indigo, violet, red, orange, yellow."
    client = _client(url)
    final = _call(client, "run", prompt, strategy="dynamic:auto+lookup", max_new_tokens=24)
    summary = final[OUT["summary"]]
    assert summary["output_ids"] == plain_greedy(prompt, 24)
    assert summary["settings"]["lookup"] is True and summary["settings"]["auto_budget"] is True
    assert "dynamic (auto budget ≤ 15) + prompt lookup" in final[OUT["status"]]
    assert summary["steps"] < 20  # copying pays: fewer steps than tokens
    assert "lookup guess accepted" in final[OUT["text"]]


def test_custom_tree_is_used(url, plain_greedy):
    client = _client(url)
    final = _call(client, "run", PROMPT_A, strategy="fixed", fixed_preset="custom",
                  custom_tree="[[0], [1], [0, 0], [0, 1], [0, 0, 0]]", max_new_tokens=6)
    summary = final[OUT["summary"]]
    nodes = summary["nodes_per_step"]
    assert nodes[0] == 5 and max(nodes) == 5  # the custom tree (core may shrink the last steps' trees to fit)
    assert summary["output_ids"] == plain_greedy(PROMPT_A, 6)
    assert summary["settings"]["custom_tree"] == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


# -- the session registry ---------------------------------------------------------------------------
def test_registry_caps_sessions_evicting_the_least_recently_used_idle_one():
    clock = FakeClock()
    registry = labstate.SessionRegistry(max_sessions=3, idle_seconds=100, clock=clock)
    labs = {}
    for key in "abc":
        clock.now += 1
        labs[key] = registry.open(key)
    clock.now += 1
    assert registry.get("a") is labs["a"]  # a is now the most recently used; b is the oldest
    labs["c"].active = 1  # busy sessions are never evicted to make room
    registry.open("d")
    assert len(registry) == 3 and "b" not in registry and all(k in registry for k in "acd")
    with pytest.raises(labstate.SessionExpired, match="least recently used"):
        registry.get("b")
    assert registry.open("b") is not labs["b"]  # Start: a fresh state, the expiry forgotten ("a" made room)
    assert registry.get("b") is not None and "a" not in registry
    for key in ("b", "d"):
        registry.get(key).active = 1
    with pytest.raises(labstate.LabInputError, match="The lab is full: 3 sessions are busy"):
        registry.open("e")  # everyone is working: refused rather than killing a running session


def test_registry_expires_idle_sessions_and_forgets_closed_tabs():
    clock = FakeClock()
    registry = labstate.SessionRegistry(max_sessions=8, idle_seconds=60, clock=clock)
    old = registry.open("old")
    old.run = object()  # stands in for a run: dropped with the state
    clock.now = 50
    registry.open("fresh")
    clock.now = 61
    assert registry.get("fresh") is not None
    with pytest.raises(labstate.SessionExpired, match="idle for more than 1 min"):
        registry.get("old")
    assert old.run is None and old.epoch > 0  # freed, and any loop on it stops
    registry.drop("fresh")  # the tab closed
    assert registry.get("fresh") is None  # a new visitor with that key simply starts over
    assert registry.stats()["live"] == 0


def _rss_tree(pid: int) -> int:
    process = psutil.Process(pid)
    return process.memory_info().rss + sum(c.memory_info().rss for c in process.children(recursive=True))


def test_session_cap_evicts_idle_sessions_and_memory_stays_bounded(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "MEDUSA_LAB_MAX_SESSIONS": "3", "MEDUSA_LAB_SESSION_IDLE_S": "600"}
    log = tmp_path / "app.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 180
        while True:
            assert process.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(url, timeout=5):
                    break
            except OSError:
                assert time.time() < deadline, "app.py did not come up"
                time.sleep(0.5)
        rss_before = _rss_tree(process.pid)
        # the precision the server preloaded: its default (gradio_client fills an omitted parameter with
        # it); this process's own measurement may differ on a busy machine (a busy one is not cached)
        small = {name: value for name, value in {**SETTINGS, "max_new_tokens": 8}.items() if name != "precision"}

        def call(client, api: str, prompt: str):
            return client.predict(prompt, **small, api_name=f"/{api}")

        clients = [_client(url) for _ in range(5)]
        for i, client in enumerate(clients):  # five sessions, one after the other, on a cap of three
            view = call(client, "step", f"Count to {i + 3}.")
            assert view[OUT["summary"]]["steps"] == 1
        for client in clients[:2]:  # the two least recently used were evicted, with a message
            view = call(client, "step", "Count to 3.")
            assert "Your session expired" in view[OUT["status"]] and "least recently used" in view[OUT["status"]]
            assert view[OUT["summary"]] in ({}, None)
        for i, client in enumerate(clients[2:], start=2):  # the three newest go on
            view = call(client, "step", f"Count to {i + 3}.")
            assert view[OUT["summary"]]["steps"] == 2
        view = call(clients[0], "start", "Count to 3.")  # Start brings an evicted user back
        assert "Prefilled" in view[OUT["status"]]
        for round_ in range(3):  # more churn: memory must not grow with the number of visitors
            for i in range(3):
                call(_client(url), "step", f"Say {round_}-{i}.")
        rss_after = _rss_tree(process.pid)
        print(f"server RSS: {rss_before / 2**20:.0f} MiB after load, {rss_after / 2**20:.0f} MiB after 14 sessions "
              f"on a cap of 3")
        assert rss_after < RSS_LIMIT_BYTES
        assert rss_after - rss_before < 600 * 2 ** 20
        assert "Traceback" not in log.read_text()
    finally:
        stop(process)


# -- nothing let in ------------------------------------------------------------------------------------
def test_the_page_lets_in_no_files_models_or_code():
    import gradio as gr

    allowed_inputs = (gr.Textbox, gr.Slider, gr.Radio, gr.Dropdown, gr.Checkbox, gr.State, gr.Number)  # Number: clicked_at
    trace_upload = next(b for b in app.demo.blocks.values() if getattr(b, "elem_id", None) == "trace-upload")
    for fn in app.demo.fns.values():
        for block in fn.inputs:
            assert isinstance(block, allowed_inputs) or block is trace_upload, f"{fn.name} takes a {type(block).__name__}"
    # the one upload is a JSON trace to replay, read as bytes and parsed as data (labstate.trace), never run
    assert trace_upload.file_types == [".json"] and trace_upload.type == "binary"
    uploads = (gr.File, gr.UploadButton, gr.Image, gr.Audio, gr.Video, gr.Model3D, gr.Code, gr.Gallery)
    for block in app.demo.blocks.values():
        if isinstance(block, uploads) and block is not trace_upload:
            assert block.interactive is False, f"{type(block).__name__} {block.label!r} accepts uploads"
    kwargs = app.launch_kwargs()
    assert kwargs["share"] is False and kwargs["max_file_size"]
    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
    source = (REPO / "app.py").read_text()
    assert source.index('os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"') < source.index("import gradio")
    needle = "trust_remote" + "_code"
    offenders = [str(path.relative_to(REPO)) for folder in ("core", "viz", "tests", "scripts")
                 for path in (REPO / folder).rglob("*.py") if needle in path.read_text(encoding="utf-8")]
    offenders += [str(path.relative_to(REPO)) for path in [REPO / "app.py", *(REPO / "labstate").rglob("*.py")]
                  if needle in path.read_text(encoding="utf-8")]
    assert offenders == []


# -- the page's side of bad input ----------------------------------------------------------------------
class PageRequest:
    """What a browser's event looks like to a handler: a session hash, no `x-gradio-user` header."""

    def __init__(self, session_hash: str) -> None:
        self.session_hash = session_hash
        self.headers: dict[str, str] = {}
        self.url = "http://127.0.0.1:7860/gradio_api/queue/join"


def test_the_page_gets_a_warning_and_keeps_its_run_on_bad_input():
    request = PageRequest("page-session-for-test")
    view = app.on_step(LONG_A, **SETTINGS, request=request)
    assert view[OUT["summary"]]["steps"] == 1
    with pytest.warns(UserWarning, match="node budget must be a whole number"):
        view = app.on_start(LONG_A, **{**SETTINGS, "budget": "abc"}, request=request)
    assert "⚠️ node budget must be a whole number, got 'abc'" in view[OUT["status"]]
    assert view[OUT["summary"]]["steps"] == 1 and view[OUT["summary"]]["prompt"] == LONG_A  # still drawn
    with pytest.warns(UserWarning, match="custom tree: path \\[1, 0\\] has no parent"):
        views = list(app.on_run(LONG_A, **{**SETTINGS, "fixed_preset": "custom", "compare_fixed": True,
                                           "custom_tree": "[[1, 0]]"}, request=request))
    assert len(views) == 1 and "⚠️ custom tree" in views[0][OUT["status"]]
    assert app.on_step(LONG_A, **SETTINGS, request=request)[OUT["summary"]]["steps"] == 2
    app.on_unload(request)  # the tab closes: its state goes at once
    assert "page-session-for-test" not in app.SESSIONS
