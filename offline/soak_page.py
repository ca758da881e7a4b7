"""A lecture's session in one tab, measured: live steps on the real model, then replayed steps, with
Chromium's own counters (DOM nodes, JS heap after a forced GC), the tab's renderer RSS and the app
server's RSS at checkpoints. Not a test (minutes of real decoding); its figures go in docs/RESULTS.md.

    python -m offline.soak_page --live 300 --replayed 300 --out runs/soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import psutil
from playwright.sync_api import sync_playwright

from core.machine import cpu_name
from offline.served import REPO, served_app
CHROMIUM = "/usr/bin/chromium"
STEPS_JS = "() => parseInt(document.querySelectorAll('#stats .card .v')[1]?.textContent || '0')"


def _rss_mb(process: psutil.Process) -> float:
    return process.memory_info().rss / 2**20


def _renderers_mb(browser_pid: int) -> float:
    """RSS of the browser's renderer processes (the tab), summed."""
    children = psutil.Process(browser_pid).children(recursive=True)
    return sum(_rss_mb(c) for c in children if "--type=renderer" in " ".join(c.cmdline()))


def _checkpoint(page, cdp, server: psutil.Process, browser_pid: int, steps: int, kind: str) -> dict:
    cdp.send("HeapProfiler.collectGarbage")
    return {"steps": steps, "kind": kind, "dom_nodes": cdp.send("Memory.getDOMCounters")["nodes"],
            "js_heap_mb": round(cdp.send("Runtime.getHeapUsage")["usedSize"] / 2**20, 1),
            "tab_rss_mb": round(_renderers_mb(browser_pid), 1), "server_rss_mb": round(_rss_mb(server), 1)}


def _step_live(page, timeout_ms: int) -> None:
    """One live Step; a finished run restarts first (Start), so the session keeps decoding."""
    status = page.locator("#status").inner_text()
    if "finished" in status:
        page.locator("#start-btn").click()
        page.wait_for_function(f"() => ({STEPS_JS})() === 0", timeout=timeout_ms)
    before = page.evaluate(STEPS_JS)
    page.evaluate("window.scrollTo(0, 0)")
    page.locator("#step-btn").click()
    page.wait_for_function(f"() => ({STEPS_JS})() === {before + 1}", timeout=timeout_ms)


def _step_replay(page, direction: int, timeout_ms: int) -> int:
    shown = page.evaluate(STEPS_JS)
    direction = -1 if shown >= 30 else 1 if shown <= 2 else direction
    page.locator("#replay-step-btn" if direction > 0 else "#replay-back-btn").click()
    page.wait_for_function(f"() => ({STEPS_JS})() === {shown + direction}", timeout=timeout_ms)
    return direction


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=300)
    parser.add_argument("--replayed", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "soak.json")
    args = parser.parse_args(argv)
    points: list[dict] = []
    env = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    with served_app(env=env, log=args.out.with_suffix(".log")) as (url, server), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        browser_pid = next(p.pid for p in psutil.Process().children(recursive=True)
                           if "chromium" in p.name() and "--type=" not in " ".join(p.cmdline()))
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        cdp = page.context.new_cdp_session(page)
        cdp.send("HeapProfiler.enable")
        page.goto(url)
        page.locator("#step-btn").wait_for(timeout=600_000)
        handle = psutil.Process(server.pid)
        points.append(_checkpoint(page, cdp, handle, browser_pid, 0, "start"))
        started = time.perf_counter()
        for step in range(1, args.live + 1):
            try:
                _step_live(page, 120_000)
            except Exception:
                page.screenshot(path=str(args.out.with_suffix(f".stuck{step}.png")), full_page=True)
                print(f"step {step} stuck: {page.locator('#status').inner_text()!r}", flush=True)
                raise
            if step in (20,) or step % args.every == 0:
                points.append(_checkpoint(page, cdp, handle, browser_pid, step, "live"))
                print(points[-1], f"{time.perf_counter() - started:.0f} s", flush=True)
        page.get_by_text("Recorded runs: the gallery").click()
        page.locator("#gallery-pick input").click()
        page.locator("ul[role=listbox] li").first.click()
        page.wait_for_function("() => document.querySelector('#status')?.textContent.includes('Replay of')",
                               timeout=60_000)
        direction = 1
        for step in range(1, args.replayed + 1):
            direction = _step_replay(page, direction, 60_000)
            if step % args.every == 0:
                points.append(_checkpoint(page, cdp, handle, browser_pid, args.live + step, "replayed"))
                print(points[-1], flush=True)
        browser.close()
    args.out.write_text(json.dumps({"cpu": cpu_name(), "cores": os.cpu_count(), "points": points}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
