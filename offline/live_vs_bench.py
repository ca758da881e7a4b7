"""Does the page decode as fast as the benchmark? One prompt and strategy, decoded by `core.bench`
and then live in the page (Chromium, Run to end), both timed by the decoding steps' own clock: the
milliseconds a decoding step takes in each, and the page's own drawing time a step (shown apart on
the speed card), and the two runs' verdicts (the speed card's "x plain decoding" against the
benchmark's plain / strategy time for the same tokens). Not a test (it times); figures go in docs/RESULTS.md.

    python -m offline.live_vs_bench --question 81 --strategy dynamic --budget 15 --precision bf16
    python -m offline.live_vs_bench --strategy dynamic:auto+lookup --label "prompt lookup" --budget 63 --precision gguf-q8
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from offline.served import REPO, served_app


def _bench(prompt_row: dict, spec: str, precision: str, tokens: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="live-vs-bench-"))
    prompts, out = folder / "prompt.jsonl", folder / "bench.json"
    prompts.write_text(json.dumps(prompt_row) + "\n")
    subprocess.run([sys.executable, "-m", "core.bench", "--prompts", str(prompts), "--strategies", f"ar,{spec}",
                    "--dtype", precision, "--max-new-tokens", str(tokens), "--repeats", "2", "--out", str(out)],
                   cwd=REPO, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rows = json.loads(out.read_text())["rows"]
    row = next(r for r in rows if r["strategy"] == spec)
    plain = next(r for r in rows if r["strategy"] == "ar")
    return {"steps": row["steps"], "tokens": row["new_tokens"], "ms_per_step": 1000 * row["seconds"] / row["steps"],
            "vs_plain": round(plain["seconds"] / plain["new_tokens"] * row["new_tokens"] / row["seconds"], 3)}


def _live(prompt: str, args: argparse.Namespace) -> dict:
    with served_app(env={"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}) as (url, _):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url)
            page.locator("#step-btn").wait_for()
            page.get_by_label("Prompt", exact=True).fill(prompt)
            page.locator("#strategy label", has_text=args.label).first.click()
            for elem_id, value in (("budget", args.budget), ("max-new", args.tokens)):
                box = page.locator(f"#{elem_id} input[type=number]")
                box.fill(str(value))
                box.press("Tab")
            page.locator("#precision label", has_text=args.precision).first.click()
            page.locator("#run-btn").click()
            page.wait_for_function("() => document.querySelector('#status')?.textContent.includes('finished')",
                                   timeout=900_000)
            # a fixed-size run's verdict waits for the plain run of its prompt, timed after the run
            page.wait_for_function("() => !document.querySelector('#stats .card.speed .sub')?.textContent"
                                   ".includes('measuring')", timeout=300_000)
            cards = page.evaluate("() => Object.fromEntries([...document.querySelectorAll('#stats .card')]"
                                  ".map(c => [c.querySelector('.k')?.textContent.trim(), c.querySelector('.v')?.textContent]))")
            card = page.locator("#stats").inner_text()
            verdict = page.locator("#stats .card.speed .sub").first.inner_text()
            status = page.locator("#status").inner_text()
            browser.close()
    values = {"tokens": float(cards["tokens"]), "steps": float(cards["steps"]),
              "tokens_per_s": float(cards["tokens / s"])}
    page_ms = next((line for line in card.splitlines() if "page:" in line), "")
    ratio = re.match(r"\s*([0-9.]+)\s*×", verdict)
    return {"steps": int(values["steps"]), "tokens": int(values["tokens"]),
            "ms_per_step": 1000 * values["tokens"] / values["tokens_per_s"] / values["steps"], "page": page_ms,
            "verdict": verdict.strip(), "vs_plain": float(ratio.group(1)) if ratio else None, "status": status.strip()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="81")
    parser.add_argument("--strategy", default="dynamic")
    parser.add_argument("--label", default="dynamic", help="the strategy's label in the page's radio")
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in (REPO / "assets/data/mt_bench.jsonl").read_text().splitlines() if line.strip()]
    row = next(r for r in rows if str(r["question_id"]) == args.question)
    # a sized strategy at the page's budget; `auto` takes it as its ceiling (the grammar's default, 63)
    spec = args.strategy if "auto" in args.strategy else f"{args.strategy}:{args.budget}"
    bench = _bench(row, spec, args.precision, args.tokens)
    live = _live(row["turns"][0], args)
    print(json.dumps({"spec": spec, "precision": args.precision, "bench": bench, "live": live,
                      "live_over_bench": round(live["ms_per_step"] / bench["ms_per_step"], 3),
                      "verdict_live_over_bench": (round(live["vs_plain"] / bench["vs_plain"], 3)
                                                  if live["vs_plain"] else None)}, indent=1))


if __name__ == "__main__":
    main()
