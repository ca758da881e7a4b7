"""The replay-only page in a real browser: `python app.py --replay-only`, no model loaded.

It opens on the first gallery run at the step its notes are about; Step (the button or the → key) goes on, ← goes
back, and the large-type box enlarges the page for a projector. Screenshots go where
tests/test_browser.py puts its own (MEDUSA_LAB_SCREENSHOTS, else a temporary folder).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from labstate import replay
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, STEPS_JS, TREE_POINTS_JS, playwright_api, running_app

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")]
STATUS_JS = """(text) => (document.querySelector('#status') || {}).textContent?.includes(text)"""
FIRST_RUN = replay.gallery()[0].name
POINT = replay.open_gallery(FIRST_RUN).shown  # the step the first gallery run opens on (its point)
FIRST_RUN_STEPS = len(replay.trace_of(replay.open_gallery(FIRST_RUN)).facts.records)


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("replay") / "app.log", "--replay-only") as started:
        yield started


def test_replay_only_page_steps_the_gallery_with_buttons_and_keys(replay_server, tmp_path):
    url, launched = replay_server
    folder = Path(os.environ.get("MEDUSA_LAB_SCREENSHOTS") or tmp_path)
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url)
        assert 2 <= POINT <= FIRST_RUN_STEPS - 2
        page.wait_for_function(STATUS_JS, arg=f"Opened on step {POINT}", timeout=60_000)  # on its point
        page.wait_for_function(TREE_POINTS_JS, arg=1, timeout=30_000)
        first_tree = time.perf_counter() - launched
        assert "live decoding is off" in page.locator("#model-info").inner_text()
        assert page.locator("#start-btn").count() == 0  # no live controls at all
        page.wait_for_function(STEPS_JS, arg=POINT, timeout=30_000)
        page.locator("#replay-step-btn").click()
        page.wait_for_function(STEPS_JS, arg=POINT + 1, timeout=30_000)
        page.locator("body").click(position={"x": 5, "y": 5})
        started = time.perf_counter()
        page.keyboard.press("ArrowRight")
        page.wait_for_function(STEPS_JS, arg=POINT + 2, timeout=30_000)
        step_seconds = time.perf_counter() - started
        page.keyboard.press("ArrowLeft")
        page.wait_for_function(STEPS_JS, arg=POINT + 1, timeout=30_000)
        for shown in range(POINT, 0, -1):  # Back reaches the steps before the one it opened on
            page.locator("#replay-back-btn").click()
            page.wait_for_function(STEPS_JS, arg=shown, timeout=60_000)
        page.locator("#presenter-toggle input").check()
        page.wait_for_function("() => document.body.classList.contains('presenter')", timeout=10_000)
        page.evaluate("window.scrollTo(0, 0)")
        assert page.locator("#tree-plot").bounding_box()["y"] < 720 - 200  # the tree is in view on the projector
        assert page.locator("#notice").bounding_box()["x"] > page.locator("#tree-plot").bounding_box()["x"]  # beside
        page.screenshot(path=str(folder / "replay_presenter_1280x720.png"))
        page.locator("#replay-end-btn").click()
        page.wait_for_function(STATUS_JS, arg="finished", timeout=30_000)
        picker = page.locator("#gallery-pick input")
        picker.click()
        picker.fill("Hydra's tree beside")
        page.keyboard.press("Enter")
        page.wait_for_function(STATUS_JS, arg="same context", timeout=30_000)
        page.wait_for_function(STATUS_JS, arg="Opened on step", timeout=30_000)
        opened = int(page.locator("#stats .card .v").nth(1).inner_text())
        for count in (opened + 1, opened + 2):
            page.locator("#replay-step-btn").click()
            page.wait_for_function(STEPS_JS, arg=count, timeout=30_000)
        rival = page.locator("#tree-rival-plot")
        page.wait_for_function("() => !!document.querySelector('#tree-rival-plot .js-plotly-plot .scatterlayer .point')",
                               timeout=30_000)
        assert "same context" in rival.inner_text()
        for table in (".heads-table", ".verify"):  # nothing clipped at 1280 px: the tables fit their box
            assert page.evaluate(f"() => {{ const e = document.querySelector('{table}'); "
                                 "return e.scrollWidth <= e.clientWidth + 1; }"), table
        page.locator("#presenter-toggle input").uncheck()
        page.set_viewport_size({"width": 1440, "height": 900})
        page.locator("#tree-plot").screenshot(path=str(folder / "two_drafters_medusa.png"))
        rival.screenshot(path=str(folder / "two_drafters_hydra.png"))
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(folder / "gallery_1440x900.png"))
        page.get_by_role("tab", name="Benchmarks").click()
        page.locator(".bench-table table").first.wait_for()
        for width, height in ((1440, 900), (1280, 800)):  # every column of the results in view, no sideways scroll
            page.set_viewport_size({"width": width, "height": height})
            assert page.evaluate("() => [...document.querySelectorAll('.bench-table table')]"
                                 ".every(t => t.scrollWidth <= t.clientWidth + 1)"), width
        print(f"replay-only: launch -> first drawn tree {first_tree:.1f} s, one replayed step {step_seconds:.2f} s")
        browser.close()


def _memory(page, cdp) -> tuple[int, float]:
    """Chromium's own counters after a forced garbage collection: DOM nodes (detached ones too) and
    the JS heap in MB."""
    cdp.send("HeapProfiler.collectGarbage")
    nodes = cdp.send("Memory.getDOMCounters")["nodes"]
    return nodes, cdp.send("Runtime.getHeapUsage")["usedSize"] / 1e6


def test_three_hundred_replayed_steps_keep_the_tab_memory_flat(replay_server):
    """A lecture's worth of stepping in one tab (300 steps back and forth through a recording): the
    DOM nodes and JS heap at the end are within 20 % of their value at step 20. Before the page
    purged the plots Gradio replaces, each step kept some 1,250 detached nodes (255k after 200
    steps) and 0.45 MB of heap."""
    url, _ = replay_server
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        cdp = page.context.new_cdp_session(page)
        cdp.send("HeapProfiler.enable")
        page.goto(url)
        page.wait_for_function(STATUS_JS, arg="Opened on step", timeout=60_000)
        direction, at_20 = 1, None
        for press in range(1, 301):
            shown = int(page.locator("#stats .card .v").nth(1).inner_text())
            direction = -1 if shown >= min(30, FIRST_RUN_STEPS) else 1 if shown <= 2 else direction
            page.locator("#replay-step-btn" if direction > 0 else "#replay-back-btn").click()
            page.wait_for_function(STEPS_JS, arg=shown + direction, timeout=60_000)
            if press == 20:
                at_20 = _memory(page, cdp)
        nodes, heap = _memory(page, cdp)
        print(f"tab after 20 / 300 replayed steps: {at_20[0]} / {nodes} DOM nodes, {at_20[1]:.1f} / {heap:.1f} MB JS heap")
        assert nodes <= 1.2 * at_20[0]
        assert heap <= 1.2 * at_20[1]
        browser.close()


CLIPPED_JS = """(selectors) => selectors.flatMap((selector) => [...document.querySelectorAll(selector)]
    .filter((e) => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
    .map((e) => `${selector}: ${e.scrollWidth} > ${e.clientWidth}`))"""
PANELS = ["#verify", "#verify table", "#heads", ".heads-table", "#notice", "#gallery-pick", "#trace-upload", "#stats",
          "#gen-text", "#status", "#tree-plot", "#tree-compare-plot"]


@pytest.mark.parametrize("width, height", [(1280, 800), (1440, 900)])
def test_nothing_is_clipped_at_lecture_widths(replay_server, width, height):
    """Every table, card, note and plot of a replayed step fits its box at 1280 and 1440 px (no content
    wider than the box that holds it), the attention mask included."""
    url, _ = replay_server
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(url)
        page.wait_for_function(STATUS_JS, arg="Opened on step", timeout=60_000)
        page.wait_for_function(TREE_POINTS_JS, arg=1, timeout=30_000)
        assert page.evaluate(CLIPPED_JS, PANELS) == []
        page.get_by_role("tab", name="Attention mask").click()
        page.wait_for_function("() => !!document.querySelector('#mask-plot .js-plotly-plot .heatmaplayer')",
                               timeout=30_000)
        assert page.evaluate(CLIPPED_JS, ["#mask-plot", "#mask-plot .js-plotly-plot"]) == []
        browser.close()


COUNT_FRAMES_JS = """(() => {
  const native = window.requestAnimationFrame.bind(window);
  window.__frames_asked = 0;
  window.requestAnimationFrame = (callback) => { window.__frames_asked++; return native(callback); };
})();"""


def test_an_idle_page_asks_for_few_animation_frames(replay_server):
    """Gradio 6.31's status tracker asks for a frame 60 times a second for as long as a page is open, even
    when nothing runs (6 % of a core taken from a decoding on the same cores). The page's first script
    (`page.FirstInHead`, assets/timer_frames.js) gives the tracker frames only while a tracker is shown:
    an idle page asks for at most 2 frames a second in all (Gradio's own loop asks for 60).
    The count is taken below the page's script, where the browser receives the requests."""
    url, _ = replay_server
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.add_init_script(COUNT_FRAMES_JS)  # runs before the page's own scripts
        page.goto(url)
        page.wait_for_function(STATUS_JS, arg="Opened on step", timeout=60_000)
        assert page.evaluate("document.head.firstElementChild.textContent").lstrip().startswith("// Runs first")
        rates = []
        for _ in range(10):  # the opening step's tweens ask for frames for a few seconds, then settle
            before = page.evaluate("window.__frames_asked")
            page.wait_for_timeout(2000)
            rates.append((page.evaluate("window.__frames_asked") - before) / 2)
            if rates[-1] <= 2:
                break
        print("animation frames asked for a second on an idle page, 2-s windows:", rates)
        assert rates[-1] <= 2
        browser.close()


# a stand-in for Gradio's status tracker: its elapsed-time loop asks for a frame from a script whose
# name holds "statustracker" (what the page's first script looks for), and calls back while it runs
TRACKER_LOOP_JS = """
window.__calls = 0; window.__running = true;
const loop = () => requestAnimationFrame(() => { window.__calls++; if (window.__running) loop(); });
loop();
//# sourceURL=statustracker-standin.js"""


def test_the_status_trackers_counter_gets_frames_only_while_shown():
    """assets/timer_frames.js: a hidden tracker's loop waits (no frame, no call: each call moves the
    tracker's tweened stores for a second of frames); once a tracker is shown its loop gets a frame 4
    times a second (the counter shows tenths), hidden again it waits again, and a loop its tracker
    stopped ends."""
    script = (Path(__file__).resolve().parents[1] / "assets/timer_frames.js").read_text(encoding="utf-8")
    shown = "document.querySelector('[data-testid=status-tracker]').classList.{}('hide')"
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.add_init_script(COUNT_FRAMES_JS)  # below the script under test: the frames the browser is asked for
        page.goto("about:blank")
        page.set_content('<div data-testid="status-tracker" class="wrap hide">processing</div>'
                         f"<script>{script}</script>")
        page.add_script_tag(content=TRACKER_LOOP_JS)
        counts = lambda: page.evaluate("[window.__calls, window.__frames_asked]")  # noqa: E731
        page.wait_for_timeout(2000)
        assert counts() == [0, 0]  # hidden: the loop waits
        page.evaluate(shown.format("remove"))
        page.wait_for_timeout(2500)  # the waiting loop is released within a quarter of a second
        calls, frames = counts()
        assert 6 <= calls <= 11 and 6 <= frames <= 11
        page.evaluate(shown.format("add"))
        page.wait_for_timeout(600)
        hidden = counts()
        page.wait_for_timeout(1500)
        assert counts() == hidden  # hidden again: waiting again
        page.evaluate(shown.format("remove"))
        page.wait_for_timeout(1000)
        assert counts()[0] >= hidden[0] + 2  # shown again: counting again
        page.evaluate("window.__running = false")
        page.wait_for_timeout(600)
        stopped = counts()
        page.wait_for_timeout(1000)
        assert counts() == stopped  # the loop ended with the tracker's flag
        browser.close()


def test_markup_in_an_uploaded_trace_is_shown_as_text_in_the_browser(replay_server, tmp_path):
    """Issue 71: a shared trace whose title, notice, note and state hold HTML and Markdown images loads no
    image and shows those texts as written (the status line and the notice panel render Markdown)."""
    import json

    from labstate import replay

    hostile = '<img src="http://203.0.113.9/x.png" id="injected"> ![pic](http://203.0.113.9/y.png)'
    data = json.loads((replay.GALLERY_DIR / replay.gallery()[0].file).read_text(encoding="utf-8"))
    data["meta"].update(title=hostile, notice=hostile, notes={"1": hostile})
    data["facts"].update(note=hostile, state=hostile)
    trace = tmp_path / "hostile_trace.json"
    trace.write_text(json.dumps(data), encoding="utf-8")
    url, _ = replay_server
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(url)
        page.wait_for_function(TREE_POINTS_JS, arg=1, timeout=60_000)
        with page.expect_file_chooser() as chooser:
            page.locator("#trace-upload").click()
        chooser.value.set_files(str(trace))
        page.wait_for_function(STATUS_JS, arg="Loaded your trace", timeout=30_000)
        page.locator("#replay-step-btn").click()
        page.wait_for_function(STATUS_JS, arg='<img src="http://203.0.113.9/x.png"', timeout=30_000)
        images = page.evaluate("() => [...document.querySelectorAll('img')].map(i => i.getAttribute('src') || '')")
        assert not [src for src in images if "203.0.113.9" in src], images
        assert page.locator("#injected").count() == 0
        assert "![pic](http://203.0.113.9/y.png)" in page.locator("#notice").inner_text()
        assert page.locator("a[href*='203.0.113.9']").count() == 0  # no bare address linked either
        browser.close()
