"""A first Start on a fresh machine, timed as a user sees it: a cache holding only what set-up builds
(the compiled kernels), `python app.py`, the page, then Step (which starts the run): seconds from the
click to a drawn tree, and from launch to the page answering. Not a test (it times); figures go in the
closing note and docs/RESULTS.md.

    python -m offline.first_start
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from offline.served import REPO, served_app

TREE_JS = "() => document.querySelectorAll('#tree-plot .js-plotly-plot .scatterlayer .point').length > 2"


def main() -> None:
    cache = Path(tempfile.mkdtemp(prefix="medusa-fresh-cache-"))
    shutil.copytree(REPO / ".cache" / "extensions", cache / "extensions")  # what scripts/setup.sh builds
    env = {"MEDUSA_LAB_CACHE": str(cache), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    launched = time.perf_counter()
    try:
        with served_app(env=env, log=cache / "app.log") as (url, _):
            answered = time.perf_counter() - launched
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(url)
                page.locator("#step-btn").wait_for()
                clicked = time.perf_counter()
                page.locator("#step-btn").click()
                page.wait_for_function(TREE_JS, timeout=600_000)
                to_tree = time.perf_counter() - clicked
                status = page.locator("#status").inner_text()
                browser.close()
        profiled = (cache / "profiles").exists() and any((cache / "profiles").iterdir())
        print(json.dumps({"launch_to_page_s": round(answered, 1), "first_step_click_to_tree_s": round(to_tree, 1),
                          "profile_cached_by_then": profiled, "status": status}, indent=1))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
