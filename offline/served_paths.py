"""Where does a served step lose time? One process loads the model and serves the page, then decodes the same
prompt and strategy several ways in turn, each timed by the steps' own clock (the speed card's and the
benchmark's): the benchmark's session in this process (`bench`), the page's Run to end asked over HTTP by
`curl` (a client that costs nothing: `curl`), the same beside an idle page in Chromium (`idle-page`), and Run to
end clicked in Chromium (`chromium`). One process and alternation keep the VM's drift out of the comparison
(it moves 10-20 % between minutes). Not a test (it times); figures go in docs/RESULTS.md.

    python -m offline.served_paths --rounds 8
    python -m offline.served_paths --modes bench,curl --strategy dynamic:auto+lookup --rounds 10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Callable

from playwright.sync_api import sync_playwright

import app
import labstate
from core.decoder import PageViews, decode
from core.records import StepRecord
from core.tensor_thread import run_on_tensor_thread
from labstate.runs import prepare
from labstate.shared import cost_profile
from offline.bench import PHASES
from offline import live_vs_bench
from offline.served import REPO, free_port

MODES = ("bench", "curl", "idle-page", "chromium")


def step_stats(records: list[StepRecord]) -> dict:
    """The run's mean step (ms, the card's basis) and its median plain step's verify (ms)."""
    steps = [1000 * sum(getattr(r.times, phase) for phase in PHASES) for r in records]
    plain = [1000 * r.times.verify for r in records if r.outcome.tree.num_nodes == 0]
    return {"mean_ms": round(statistics.fmean(steps), 3),
            "plain_verify_ms": round(statistics.median(plain), 3) if plain else None, "steps": len(steps)}


class Paths:
    """The served app in this process and the ways to decode one prompt with it."""

    def __init__(self, prompt: str, raw: dict) -> None:
        self.prompt, self.raw = prompt, raw
        self.settings = labstate.parse_settings(raw)
        self.prepared = prepare(prompt, self.settings)
        self.profile = cost_profile(self.prepared.runtime, wait=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        app.build_demo().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                                **app.launch_kwargs())
        self.run_inputs = self._run_inputs()
        self.browser = None

    def _run_inputs(self) -> list:
        """The /run endpoint's inputs in order: its defaults, with this prompt and these settings."""
        info = json.loads(self._curl(f"{self.url}/gradio_api/info"))
        params = info["named_endpoints"]["/run"]["parameters"]
        values = {p["parameter_name"]: p.get("parameter_default") for p in params}
        values.update(prompt=self.prompt, **self.raw)
        return [values[p["parameter_name"]] for p in params]

    @staticmethod
    def _curl(*args: str) -> str:
        return subprocess.run(["curl", "-s", *args], capture_output=True, text=True, check=True).stdout

    def bench(self) -> list[StepRecord]:
        """The benchmark's session (no page views, no texts) on the tensor thread."""
        rt, prepared = self.prepared.runtime, self.prepared
        session = run_on_tensor_thread(decode, rt.base, rt.heads_for(prepared.config.strategy), prepared.prompt_ids,
                                       prepared.config, self.profile, page=PageViews(texts=False))
        return session.records

    def curl(self) -> list[StepRecord]:
        """Run to end through /gradio_api/call/run (the page's handler, a client that costs nothing)."""
        key = f"served-paths-{time.time_ns()}"
        body = json.dumps({"data": self.run_inputs, "session_hash": key})
        event = json.loads(self._curl("-X", "POST", "-H", "Content-Type: application/json", "-d", body,
                                      f"{self.url}/gradio_api/call/run"))["event_id"]
        self._curl("-N", f"{self.url}/gradio_api/call/run/{event}")
        return app.SESSIONS.get(key).run.session.records

    def idle_page(self) -> list[StepRecord]:
        """`curl` with the page open and idle in Chromium on the same machine."""
        page = self._open_page()
        try:
            page.wait_for_timeout(1500)  # the page settles (its opening tweens)
            return self.curl()
        finally:
            page.close()

    def chromium(self) -> list[StepRecord]:
        """Run to end clicked in a fresh page (a new session) in Chromium on the same machine."""
        before = set(app.SESSIONS.keys())
        page = self._open_page()
        try:
            live_vs_bench.run_to_end(page, self.prompt, label=labstate.strategy_labels()[self.settings.ui_strategy],
                                     budget=self.settings.budget, tokens=self.settings.max_new_tokens,
                                     precision=self.settings.precision)
        finally:
            page.close()
        new = [key for key in app.SESSIONS.keys() if key not in before]
        return app.SESSIONS.get(new[-1]).run.session.records

    def _open_page(self):
        if self.browser is None:
            self.browser = live_vs_bench.chromium(sync_playwright().start())
        return live_vs_bench.open_page(self.browser, self.url)

    def mode(self, name: str) -> Callable[[], list[StepRecord]]:
        return {"bench": self.bench, "curl": self.curl, "idle-page": self.idle_page, "chromium": self.chromium}[name]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="81")
    parser.add_argument("--strategy", default="dynamic:auto+lookup")
    parser.add_argument("--budget", type=int, default=63)
    parser.add_argument("--precision", default="gguf-q8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    rows = [json.loads(line) for line in (REPO / "assets/data/mt_bench.jsonl").read_text().splitlines() if line.strip()]
    prompt = next(r for r in rows if str(r["question_id"]) == args.question)["turns"][0]
    paths = Paths(prompt, {"strategy": args.strategy, "budget": args.budget, "precision": args.precision,
                           "max_new_tokens": args.tokens})
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for round_ in range(args.rounds):
        for name in modes:
            runs[name].append(step_stats(paths.mode(name)()))
            print(round_, name, runs[name][-1], flush=True)
    medians = {name: statistics.median(r["mean_ms"] for r in rs) for name, rs in runs.items()}
    base = medians.get("bench") or next(iter(medians.values()))
    print(json.dumps({"strategy": args.strategy, "precision": args.precision, "rounds": args.rounds, "runs": runs,
                      "median_mean_ms": medians,
                      "over_bench": {name: round(m / base, 3) for name, m in medians.items()}}, indent=1), flush=True)
    os._exit(0)  # the launched server and the browser end with the process


if __name__ == "__main__":
    main()
