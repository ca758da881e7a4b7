"""The page in a real browser: `python app.py` in a subprocess, Debian's Chromium driven by Playwright.

Never downloads a browser: skipped when /usr/bin/chromium or playwright is missing.
Timings (launch -> first tree, Step click -> updated figures) are printed and written to
tmp_path/timings.json.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SERVER_START_TIMEOUT_S = 240
UI_TIMEOUT_MS = 180_000

playwright_api = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")]

TREE_POINTS_JS = """(minimum) => {
  const plot = document.querySelector('#tree-plot .js-plotly-plot');
  return !!plot && plot.querySelectorAll('.scatterlayer .point').length >= minimum;
}"""
TREE_TITLE_JS = """(text) => {
  const title = document.querySelector('#tree-plot .js-plotly-plot .gtitle');
  return !!title && title.textContent.includes(text);
}"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"app.py exited early with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"app.py did not answer on {url} within {timeout} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python app.py --port N`, as a user would start it; yields (url, launch time)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "app.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False"}
    launched = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_http(url, process, SERVER_START_TIMEOUT_S)
        yield url, launched
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture()
def page():
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1600, "height": 1000})
        yield context.new_page()
        browser.close()


def test_step_renders_tree_text_and_timing(server, page, tmp_path):
    url, launched = server
    page.goto(url)
    prompt = page.get_by_label("Prompt", exact=True)
    prompt.fill("Say hello to <b>bold</b> people <script>window.__pwned = 1</script> 🙂")
    page.locator("#step-btn").click()
    page.wait_for_function(TREE_POINTS_JS, arg=3, timeout=UI_TIMEOUT_MS)  # root, a candidate, the bonus
    first_tree_s = time.perf_counter() - launched
    page.wait_for_function(TREE_TITLE_JS, arg="Step 0", timeout=UI_TIMEOUT_MS)

    # the generated text: the first token and step 0's tokens, with a bonus token, all escaped
    assert page.locator("#gen-text .gen-body .tok").count() >= 2
    assert page.locator("#gen-text .gen-body .r-bonus").count() >= 1
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#gen-text script").count() == 0
    # the accepted path and the bonus star are drawn; the stats show one step
    assert page.locator("#tree-plot .legendtext", has_text="accepted path").count() == 1
    assert page.locator("#tree-plot .legendtext", has_text="bonus token").count() == 1
    assert page.locator("#stats .card .v").nth(1).inner_text() == "1"

    clicked = time.perf_counter()
    page.locator("#step-btn").click()
    page.wait_for_function(TREE_TITLE_JS, arg="Step 1", timeout=UI_TIMEOUT_MS)
    step_s = time.perf_counter() - clicked
    assert page.locator("#stats .card .v").nth(1).inner_text() == "2"
    assert page.locator("#gen-text .gen-body .tok.s1").count() >= 1  # step 1's tokens, step 1's colour

    page.get_by_role("tab", name="Attention mask").click()
    page.wait_for_function("() => !!document.querySelector('#mask-plot .js-plotly-plot .heatmaplayer')",
                           timeout=UI_TIMEOUT_MS)
    page.get_by_role("tab", name="Trees: dynamic vs fixed").click()
    page.screenshot(path=str(tmp_path / "lab.png"), full_page=True)
    timings = {"launch_to_first_tree_s": round(first_tree_s, 2), "step_click_to_figures_s": round(step_s, 2)}
    (tmp_path / "timings.json").write_text(json.dumps(timings))
    print(f"\nbrowser timings: {timings}; screenshot {tmp_path / 'lab.png'}")
    assert (tmp_path / "lab.png").stat().st_size > 10_000
