"""Does a trained EAGLE layer ship? Its held-out report against the shipped one's, figure by figure.

    python -m offline.eagle_verdict data/eagle_candidate/report.json             # against assets/eagle
    python -m offline.eagle_verdict NEW/report.json --shipped OLD/report.json

Held-out accuracy decides what ships, never training loss (issue 45). The rule, on every held-out set
both reports measured (MT-Bench, the second set): the candidate's tokens per step of the exact greedy
simulation is at least the shipped layer's at every tree size, and its top-1 fed its own guesses,
averaged over the depths, is at least the shipped one's. Prints every figure side by side (given the
path and own guesses, top-1 by depth; tokens per step) and the verdict; exits 0 when it ships, 1 when not.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from core.model import REPO_ROOT

SHIPPED_REPORT = REPO_ROOT / "assets" / "eagle" / "report.json"


@dataclass(frozen=True)
class Figure:
    """One held-out number of both reports."""

    held_out: str  # "mt_bench", "second_set"
    name: str  # e.g. "own guesses top-1, depth 3", "tokens per step, eagle:64"
    candidate: float
    shipped: float
    decides: bool  # part of the shipping rule (tokens per step, own guesses' mean)

    @property
    def better_or_equal(self) -> bool:
        return self.candidate >= self.shipped


@dataclass(frozen=True)
class Verdict:
    figures: list[Figure]

    @property
    def ships(self) -> bool:
        deciding = [f for f in self.figures if f.decides]
        return bool(deciding) and all(f.better_or_equal for f in deciding)

    def table(self) -> str:
        """The figures as a markdown table, the deciding ones marked."""
        lines = ["| held out | figure | candidate | shipped | change |", "|---|---|---|---|---|"]
        for f in self.figures:
            mark = " (decides)" if f.decides else ""
            lines.append(f"| {f.held_out} | {f.name}{mark} | {f.candidate:.3f} | {f.shipped:.3f} | "
                         f"{f.candidate - f.shipped:+.3f} |")
        return "\n".join(lines)


def _top1(report: dict, held_out: str, kind: str) -> list[float]:
    return report["held_out"][held_out][kind]["top1"]


def compare(candidate: dict, shipped: dict) -> Verdict:
    """Every held-out figure the two reports share, and which of them decide (module docstring)."""
    figures = []
    for held_out in sorted(set(candidate["held_out"]) & set(shipped["held_out"])):
        for kind, label in (("given_path", "given the path"), ("own_guesses", "own guesses")):
            new, old = _top1(candidate, held_out, kind), _top1(shipped, held_out, kind)
            figures += [Figure(held_out, f"{label} top-1, depth {d + 1}", a, b, decides=False)
                        for d, (a, b) in enumerate(zip(new, old))]
        own = [_top1(r, held_out, "own_guesses") for r in (candidate, shipped)]
        depths = min(map(len, own))
        own_mean = [sum(o[:depths]) / depths for o in own]
        figures.append(Figure(held_out, f"own guesses top-1, mean of depths 1-{depths}", *own_mean, decides=True))
        new_steps, old_steps = (r["held_out"][held_out]["tokens_per_step"] for r in (candidate, shipped))
        figures += [Figure(held_out, f"tokens per step, {size}", new_steps[size], old_steps[size], decides=True)
                    for size in sorted(set(new_steps) & set(old_steps), key=lambda s: int(s.split(":")[1]))]
    return Verdict(figures)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("candidate", type=Path, help="the trained layer's report.json")
    parser.add_argument("--shipped", type=Path, default=SHIPPED_REPORT)
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in (args.candidate, args.shipped)]
    verdict = compare(*reports)
    print(verdict.table())
    print(f"\n{args.candidate}: {'ships' if verdict.ships else 'does not ship'} (against {args.shipped})")
    sys.exit(0 if verdict.ships else 1)


if __name__ == "__main__":
    main()
