"""Does the page decode as fast as the benchmark? One prompt and strategy, decoded by `core.bench`
and then live in the page (Chromium, Run to end), both timed by the decoding steps' own clock: the
milliseconds a decoding step takes in each, and the page's own drawing time a step (shown apart on
the speed card). Not a test (it times); figures go in docs/RESULTS.md.

    python -m offline.live_vs_bench --question 81 --strategy dynamic --budget 15 --precision bf16
"""
from __future__ import annotations

import argparse
import json
import os
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
    row = next(r for r in json.loads(out.read_text())["rows"] if r["strategy"] == spec)
    return {"steps": row["steps"], "tokens": row["new_tokens"], "ms_per_step": 1000 * row["seconds"] / row["steps"]}


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
            cards = page.evaluate("() => Object.fromEntries([...document.querySelectorAll('#stats .card')]"
                                  ".map(c => [c.querySelector('.k')?.textContent.trim(), c.querySelector('.v')?.textContent]))")
            card = page.locator("#stats").inner_text()
            browser.close()
    values = {"tokens": float(cards["tokens"]), "steps": float(cards["steps"]),
              "tokens_per_s": float(cards["tokens / s"])}
    page_ms = next((line for line in card.splitlines() if "page:" in line), "")
    return {"steps": int(values["steps"]), "tokens": int(values["tokens"]),
            "ms_per_step": 1000 * values["tokens"] / values["tokens_per_s"] / values["steps"], "page": page_ms}


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
    spec = f"{args.strategy}:{args.budget}"
    bench = _bench(row, spec, args.precision, args.tokens)
    live = _live(row["turns"][0], args)
    print(json.dumps({"spec": spec, "precision": args.precision, "bench": bench, "live": live,
                      "live_over_bench": round(live["ms_per_step"] / bench["ms_per_step"], 3)}, indent=1))


if __name__ == "__main__":
    main()
