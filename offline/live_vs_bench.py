"""Does the page decode as fast as the benchmark? One prompt and strategy, decoded by `core.bench`
and then live in the page (Chromium, Run to end), both timed by the decoding steps' own clock: the
milliseconds a decoding step takes in each, and the page's own drawing time a step (shown apart on
the speed card), and the two runs' verdicts (the speed card's "x plain decoding" against the
benchmark's plain / strategy time for the same tokens). The benchmark runs before and after the page
(the VM's speed drifts 20 % in minutes; their mean is the reference), and the page's run is read back
from its own JSON trace: the mean and the median step, the first tree step, and the steps slower than
1.3x the median (a browser drawing on the decoding cores shows as such steps). With `--pairs N` a
benchmark process stays up beside the server (`BenchWorker`) and each served run sits between two
benchmark runs, each started on a quiet machine, after one warm-up run of each (the step ratio is the
served run's mean step over the two benchmark runs' mean). The harness never polls the page: it waits
inside it on DOM changes. Not a test (it times); figures go in docs/RESULTS.md.

    python -m offline.live_vs_bench --question 81 --strategy dynamic --budget 15 --precision bf16
    python -m offline.live_vs_bench --strategy dynamic:auto+lookup --label "prompt lookup" --budget 63 --precision gguf-q8
    python -m offline.live_vs_bench --strategy dynamic:auto+lookup --budget 63 --precision gguf-q8 --client api --pairs 6
    python -m offline.live_vs_bench --strategy dynamic:auto+lookup --label "prompt lookup" --budget 63 --precision gguf-q8 --pairs 6 --settle 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from playwright.sync_api import sync_playwright

from offline.bench import PHASES
from offline.served import REPO, served_app

SERVED_ENV = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
SLOW_STEP = 1.3  # a step this many times the run's median counts as slow
# the harness waits for the page inside it (a MutationObserver), never polling it: a person watching a
# run does not poll, and each poll woke Chromium, Playwright's driver and this process on the decoding cores
WAIT_JS = """([condition, timeoutMs]) => new Promise((resolve, reject) => {
  const met = new Function(`return (${condition})`);
  if (met()) { resolve(true); return; }
  const observer = new MutationObserver(() => { if (met()) { observer.disconnect(); resolve(true); } });
  observer.observe(document.body, { childList: true, subtree: true, characterData: true, attributes: true });
  setTimeout(() => { observer.disconnect(); reject(new Error(`not met in ${timeoutMs} ms: ${condition}`)); }, timeoutMs);
})"""


def _bench(prompt_row: dict, spec: str, precision: str, tokens: int) -> dict:
    """One benchmark run of the prompt, as the page makes one: with repeats the benchmark keeps the
    lower median of its runs (the faster of two), a bias of a few per cent against a single page run."""
    folder = Path(tempfile.mkdtemp(prefix="live-vs-bench-"))
    prompts, out = folder / "prompt.jsonl", folder / "bench.json"
    prompts.write_text(json.dumps(prompt_row) + "\n")
    subprocess.run([sys.executable, "-m", "core.bench", "--prompts", str(prompts), "--strategies", f"ar,{spec}",
                    "--dtype", precision, "--max-new-tokens", str(tokens), "--repeats", "1", "--out", str(out)],
                   cwd=REPO, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rows = json.loads(out.read_text())["rows"]
    row = next(r for r in rows if r["strategy"] == spec)
    plain = next(r for r in rows if r["strategy"] == "ar")
    steps_s, plain_s = _steps_seconds(row["phase_seconds"]), _steps_seconds(plain["phase_seconds"])
    return {**_run_timing(row["phase_seconds"], row["steps"], row["new_tokens"], row["step_nodes"]),
            "vs_plain": round(plain_s / plain["new_tokens"] * row["new_tokens"] / steps_s, 3)}


def _run_timing(phase_seconds: dict[str, float], steps: int, tokens: int, step_nodes: list[int]) -> dict:
    """A benchmark run's steps, tokens, ms a step and a token by the decoding steps' own clock (as the
    page's card times them; a row's seconds also hold the prefill), and its step mix."""
    steps_s = _steps_seconds(phase_seconds)
    return {"steps": steps, "tokens": tokens, "ms_per_step": 1000 * steps_s / steps,
            "ms_per_token": round(1000 * steps_s / tokens, 3), "mix": _step_mix(step_nodes)}


def _step_mix(nodes: list[int]) -> dict[str, int]:
    """Steps by the size of the tree they verified: an adaptive budget times its choices, so a run
    beside a browser may take other steps than the benchmark's (then ms a token is the fair figure)."""
    bins = {"plain": (0, 0), "1-3": (1, 3), "4-15": (4, 15), "16+": (16, 10**6)}
    return {name: sum(low <= n <= high for n in nodes) for name, (low, high) in bins.items()}


def _steps_seconds(phase_seconds: dict[str, float]) -> float:
    """A benchmark row's time in its decoding steps (`PhaseTimes.total`'s phases; no prefill)."""
    return sum(phase_seconds.get(phase, 0.0) for phase in PHASES)


def _live(prompt: str, args: argparse.Namespace) -> dict:
    with served_app(env=SERVED_ENV) as (url, _), sync_playwright() as pw:
        browser = chromium(pw)
        result = _page_run(browser, url, prompt, args)
        browser.close()
    return result


def chromium(pw):
    """Debian's Chromium, headless (the browser the tests drive)."""
    return pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])


def open_page(browser, url: str):
    """A fresh page (a new session) of `browser` on the served `url`, once its controls are there."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(url)
    page.locator("#step-btn").wait_for()
    return page


def run_to_end(page, prompt: str, *, label: str, budget: int, tokens: int, precision: str,
               settle_s: float = 0.0) -> None:
    """Set the prompt, the strategy (the first radio whose label holds `label`: the panel lists a
    family's shortest label first), budget, token limit and precision, click Run to end and wait until
    the status line says the run finished. `settle_s`: the page rests that long before the click."""
    page.get_by_label("Prompt", exact=True).fill(prompt)
    page.locator("#strategy label", has_text=label).first.click()
    for elem_id, value in (("budget", budget), ("max-new", tokens)):
        box = page.locator(f"#{elem_id} input[type=number]")
        box.fill(str(value))
        box.press("Tab")
    page.locator("#precision label", has_text=precision).first.click()  # "gguf" comes before "gguf-q8"
    if settle_s:  # a person reads the page first; its first seconds draw (Gradio's Blocks asks for frames)
        page.wait_for_timeout(1000 * settle_s)
    page.locator("#run-btn").click()
    wait_until(page, "document.querySelector('#status')?.textContent.includes('finished')", timeout_ms=900_000)


def wait_until(page, condition: str, timeout_ms: int) -> None:
    """Wait until the JS expression `condition` holds in `page`, looked at after each DOM change."""
    page.evaluate(WAIT_JS, [condition, timeout_ms])


def _page_run(browser, url: str, prompt: str, args: argparse.Namespace) -> dict:
    """One Run to end in a fresh page (a new session) of `browser` on the served `url`: the card's
    figures and the run's own trace."""
    page = open_page(browser, url)
    run_to_end(page, prompt, label=args.label, budget=args.budget, tokens=args.tokens, precision=args.precision,
               settle_s=args.settle)
    # a fixed-size run's verdict waits for the plain run of its prompt, timed after the run
    wait_until(page, "!document.querySelector('#stats .card.speed .sub')?.textContent.includes('measuring')",
               timeout_ms=300_000)
    cards = page.evaluate("() => Object.fromEntries([...document.querySelectorAll('#stats .card')]"
                          ".map(c => [c.querySelector('.k')?.textContent.trim(), c.querySelector('.v')?.textContent]))")
    card = page.locator("#stats").inner_text()
    verdict = page.locator("#stats .card.speed .sub").first.inner_text()
    status = page.locator("#status").inner_text()
    steps = _traced_steps(page, url)
    page.close()
    values = {"tokens": float(cards["tokens"]), "steps": float(cards["steps"]),
              "tokens_per_s": float(cards["tokens / s"])}
    page_ms = next((line for line in card.splitlines() if "page:" in line), "")
    ratio = re.match(r"\s*([0-9.]+)\s*×", verdict)
    return {"steps": int(values["steps"]), "tokens": int(values["tokens"]),
            "ms_per_step": 1000 * values["tokens"] / values["tokens_per_s"] / values["steps"], "page": page_ms,
            "verdict": verdict.strip(), "vs_plain": float(ratio.group(1)) if ratio else None, "status": status.strip(),
            "trace": steps}


def _served_api(prompt: str, args: argparse.Namespace) -> dict:
    """The same run served to `gradio_client` (no browser on the cores): its trace's step times."""
    with served_app(env=SERVED_ENV) as (url, _):
        return _api_run(_api_client(url), prompt, args)


def _api_client(url: str) -> "gradio_client.Client":
    """A `gradio_client` on the served page (imported here: the browser mode needs none)."""
    import gradio_client

    return gradio_client.Client(url, verbose=False, download_files=False)


def _api_run(client, prompt: str, args: argparse.Namespace) -> dict:
    """One run through `client` from a fresh start (Reset first): its trace's step times."""
    client.predict(api_name="/reset")
    list(client.submit(prompt, strategy=args.strategy, budget=args.budget, precision=args.precision,
                       max_new_tokens=args.tokens, api_name="/run"))
    steps = _trace_stats(_downloaded_steps(client.predict(api_name="/trace")["url"]))
    return {"steps": None, "ms_per_step": steps["mean_ms"], "vs_plain": None, "trace": steps}


def _alternations(row: dict, spec: str, args: argparse.Namespace) -> dict:
    """`args.pairs` alternations of one benchmark run and one served run (`gradio_client`, or a fresh
    page in one Chromium; one server up throughout): each pair's ratios and the medians. The VM's speed
    drifts between minutes, so a pair is measured within a minute and the pairs are summarised by their
    medians."""
    prompt = row["turns"][0]
    with served_app(env=SERVED_ENV) as (url, _):
        if args.client == "api":
            client = _api_client(url)
            return _pairs(row, spec, args, lambda: _api_run(client, prompt, args))
        with sync_playwright() as pw:
            browser = chromium(pw)
            return _pairs(row, spec, args, lambda: _page_run(browser, url, prompt, args))


def _pairs(row: dict, spec: str, args: argparse.Namespace, served_run: Callable[[], dict]) -> dict:
    """`args.pairs` served runs, each between two benchmark runs of a benchmark process kept up beside
    the server (`BenchWorker`: the benchmark's own decode and clock), and the summary `_alternations`
    returns: each served run is compared with the mean of the benchmark runs just before and after it
    (some 10 s apart), so the VM's drift between minutes stays out of the ratio. Both sides warm up
    first: one benchmark run and one served run are dropped (a fresh browser compiles the page's
    scripts for seconds after its first page loads; a fresh server meets its first run)."""
    pairs = []
    with BenchWorker(row["turns"][0], spec, args.precision, args.tokens) as bench:
        served_run()
        before = quiet_then(bench.run)
        for _ in range(args.pairs):
            live = quiet_then(served_run)["trace"]
            after = quiet_then(bench.run)
            bench_ms = (before["ms_per_step"] + after["ms_per_step"]) / 2
            bench_ms_per_token = (before["ms_per_token"] + after["ms_per_token"]) / 2
            pairs.append({"bench_ms_per_step": [before["ms_per_step"], after["ms_per_step"]],
                          "live_ms_per_step": live["mean_ms"], "step_ratio": round(live["mean_ms"] / bench_ms, 3),
                          "token_ratio": round(live["ms_per_token"] / bench_ms_per_token, 3),
                          "bench_mix": after["mix"], "live_mix": live["mix"], "live_steps": live["steps"],
                          "live_slow_at": live["slow_at"], "live_excess_ms": live["excess_ms"]})
            before = after
    return {"spec": spec, "precision": args.precision, "client": args.client, "pairs": pairs,
            "median_step_ratio": statistics.median(p["step_ratio"] for p in pairs),
            "median_token_ratio": statistics.median(p["token_ratio"] for p in pairs)}


def quiet_then(run: Callable[[], dict], busy_below: float = 0.1, window_s: float = 0.3,
               timeout_s: float = 30.0) -> dict:
    """`run()` once the machine is quiet: its CPUs busy less than `busy_below` of a `window_s` window
    (at most `timeout_s` of waiting). After a page's run the server works on for a second or two (the
    run's last views, its plain yardstick), and a benchmark run beside that measured 2-10x slow."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _busy_fraction(window_s) >= busy_below:
        pass
    return run()


def _busy_fraction(window_s: float) -> float:
    """The machine's CPUs' busy share over the next `window_s` seconds (/proc/stat; 0 where absent)."""
    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        idle = values[3] + values[4]  # idle and iowait
        return sum(values) - idle, sum(values)
    if not os.path.exists("/proc/stat"):
        return 0.0
    busy0, total0 = ticks()
    time.sleep(window_s)
    busy1, total1 = ticks()
    return (busy1 - busy0) / max(total1 - total0, 1)


class BenchWorker:
    """A benchmark process kept up for alternations: it loads the model and weights as `core.bench` does
    and, for each `run()`, decodes the prompt with the strategy by the benchmark's own `run_one` (its
    decode and its clock), answering the run's ms a step and a token. One warm-up run is dropped."""

    def __init__(self, prompt: str, spec: str, precision: str, tokens: int) -> None:
        self.command = [sys.executable, "-m", "offline.live_vs_bench", "--bench-worker", json.dumps(
            {"prompt": prompt, "spec": spec, "precision": precision, "tokens": tokens})]

    def __enter__(self) -> "BenchWorker":
        self.process = subprocess.Popen(self.command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.run()
        return self

    def run(self) -> dict:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark worker ended (exit code {self.process.wait()})")
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _bench_worker(job: dict) -> None:
    """`--bench-worker`: the other end of `BenchWorker` (a run for each line on stdin, a JSON line out)."""
    from core.model import ModelConfig, load_base_model
    from offline.bench import Prompt, load_head_set, parse_strategy, run_one
    from core.accept import AcceptConfig
    from core.decoder import DecodeConfig

    base = load_base_model(ModelConfig(dtype=job["precision"]))
    heads, _ = load_head_set(base)
    config = DecodeConfig(max_new_tokens=job["tokens"], accept=AcceptConfig(rule="greedy"))
    strategy = parse_strategy(job["spec"], config)
    prompt = Prompt(id="live-vs-bench", text=job["prompt"], category="")
    for _ in sys.stdin:
        row, _ = run_one(base, heads, prompt, job["spec"], strategy, job["tokens"])
        print(json.dumps(_run_timing(row.phase_seconds, row.steps, row.new_tokens, row.step_nodes)), flush=True)


def _downloaded_steps(url: str) -> list[dict]:
    """The steps of the JSON trace the page serves at `url`."""
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read().decode("utf-8"))["steps"]


def _traced_steps(page, url: str) -> dict:
    """The run's steps as its own JSON trace times them (Export -> Build JSON trace): ms a step."""
    page.get_by_text("Export", exact=True).first.click()  # the button sits in a closed accordion
    page.locator("#trace-btn").click()
    link = page.locator("#trace-file a").first
    link.wait_for(timeout=60_000)
    return _trace_stats(_downloaded_steps(urllib.parse.urljoin(url, link.get_attribute("href"))))


def _trace_stats(steps: list[dict]) -> dict:
    """Mean and median ms a step by the steps' own clock, the first tree step and the slow steps."""
    ms = [1000 * step["times"]["total"] for step in steps]
    tokens = sum(len(step["new_tokens"]) for step in steps)
    median = statistics.median(ms)
    first_tree = next((i for i, step in enumerate(steps) if step["times"]["verify"] and step["outcome"]["tree"]
                       .get("paths")), None)
    slow = [round(t, 1) for t in ms if t > SLOW_STEP * median]
    # where the slow steps fall: a browser's click and first redraw land on a run's first steps
    slow_at = [i for i, t in enumerate(ms) if t > SLOW_STEP * median]
    return {"steps": len(ms), "mean_ms": round(statistics.fmean(ms), 2), "median_ms": round(median, 2),
            "ms_per_token": round(sum(ms) / tokens, 3),
            "mix": _step_mix([len(step["outcome"]["tree"].get("paths", [])) for step in steps]),
            "first_tree_step_ms": round(ms[first_tree], 1) if first_tree is not None else None,
            "slow_steps": len(slow), "slow_ms": slow, "slow_at": slow_at,
            "excess_ms": round(sum(t - median for t in ms if t > SLOW_STEP * median), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="81")
    parser.add_argument("--strategy", default="dynamic")
    parser.add_argument("--label", default="dynamic", help="the strategy's label in the page's radio")
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--client", choices=("browser", "api"), default="browser",
                        help="drive the page in Chromium (default) or call the same server through gradio_client")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds the page rests once set up, before Run is clicked (browser mode)")
    parser.add_argument("--pairs", type=int, default=0,
                        help="this many alternations of a benchmark run and a served run, one server up "
                             "throughout (else one served run between two benchmarks)")
    parser.add_argument("--bench-worker", default=None, help=argparse.SUPPRESS)  # BenchWorker's other end
    args = parser.parse_args(argv)
    if args.bench_worker:
        _bench_worker(json.loads(args.bench_worker))
        return
    rows = [json.loads(line) for line in (REPO / "assets/data/mt_bench.jsonl").read_text().splitlines() if line.strip()]
    row = next(r for r in rows if str(r["question_id"]) == args.question)
    # a sized strategy at the page's budget; `auto` takes it as its ceiling (the grammar's default, 63)
    spec = args.strategy if "auto" in args.strategy else f"{args.strategy}:{args.budget}"
    if args.pairs:
        print(json.dumps(_alternations(row, spec, args), indent=1))
        return
    before = _bench(row, spec, args.precision, args.tokens)
    live = (_served_api if args.client == "api" else _live)(row["turns"][0], args)
    after = _bench(row, spec, args.precision, args.tokens)
    bench_ms = (before["ms_per_step"] + after["ms_per_step"]) / 2
    bench_ms_per_token = (before["ms_per_token"] + after["ms_per_token"]) / 2
    bench_vs_plain = (before["vs_plain"] + after["vs_plain"]) / 2
    print(json.dumps({"spec": spec, "precision": args.precision, "bench_before": before, "live": live,
                      "bench_after": after, "live_over_bench": round(live["ms_per_step"] / bench_ms, 3),
                      "trace_median_over_bench": round(live["trace"]["median_ms"] / bench_ms, 3),
                      "per_token_live_over_bench": round(live["trace"]["ms_per_token"] / bench_ms_per_token, 3),
                      "client": args.client,
                      "verdict_live_over_bench": (round(live["vs_plain"] / bench_vs_plain, 3)
                                                  if live["vs_plain"] else None)}, indent=1))


if __name__ == "__main__":
    main()
