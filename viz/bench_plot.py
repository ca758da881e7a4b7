"""Benchmark results (the JSON written by `python -m offline.bench`) as figures and a Markdown table.

    python -m viz.bench_plot assets/results/bench_bf16.json [more.json ...] --html assets/results/bench.html
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from viz.style import new_figure

PHASES = ("heads", "tree", "verify", "accept", "commit")


def bench_figure(result: dict, title: str = "") -> go.Figure:
    """Tokens/s (with speed-up vs autoregressive) and tokens per step, one bar per strategy.

    Strategies that record no tokens per step (transformers' own `hf:*` peers) get no bar there
    rather than a 0.00 one; value labels sit above the bars with room to spare.
    """
    summary = result["summary"]
    names = list(summary)
    speed = [summary[n]["tokens_per_s"] for n in names]
    ratio = [summary[n].get("speedup_vs_ar") for n in names]
    stepped = [n for n in names if summary[n].get("mean_accepted")]
    per_step = [summary[n]["mean_accepted"] for n in stepped]
    figure = make_subplots(rows=1, cols=2, subplot_titles=("tokens / s (label: vs plain)", "tokens per step"),
                           horizontal_spacing=0.1)
    figure.add_bar(x=names, y=speed, text=[f"{r:.2f}×" if r else "" for r in ratio], textposition="outside",
                   cliponaxis=False, marker_color="#4c6ef5", name="tokens/s", row=1, col=1)
    figure.add_bar(x=stepped, y=per_step, text=[f"{v:.2f}" for v in per_step], textposition="outside",
                   cliponaxis=False, marker_color="#37b24d", name="tokens/step", row=1, col=2)
    figure.update_yaxes(range=[0, 1.25 * max(speed, default=1.0)], row=1, col=1)
    figure.update_yaxes(range=[0, 1.25 * max(per_step, default=1.0)], row=1, col=2)
    figure.update_xaxes(tickangle=-35, tickfont={"size": 11})
    dtype = result.get("config", {}).get("dtype", "")
    count = result.get("config", {}).get("prompt_count") or result.get("config", {}).get("limit")
    figure.update_layout(title={"text": title or f"{prompt_set_name(result)}, {dtype}, {count} prompts",
                                "y": 0.97, "yanchor": "top"},
                         showlegend=False, height=460, margin=dict(t=90, b=140, l=50, r=20))
    return figure


STATE_COLOURS = {"normal": "#4c6ef5", "probing": "#fab005", "backing off": "#adb5bd", "exploring": "#e64980",
                 "": "#4c6ef5"}


def stepped_strategies(result: dict) -> list[str]:
    """Strategies whose rows carry a controller state per step (the adaptive ones)."""
    return list(dict.fromkeys(row["strategy"] for row in result.get("rows", []) if any(row.get("step_state", []))))


def step_trace_figure(result: dict, strategy: str) -> go.Figure:
    """Per prompt (one row each), per step: a marker sized by the nodes verified and coloured by
    the controller's state (normal, probing, backing off, exploring); hover: tokens and verify ms."""
    rows = [row for row in result.get("rows", []) if row["strategy"] == strategy and row.get("step_state")]
    figure = new_figure()
    for state, colour in STATE_COLOURS.items():
        if not state:
            continue
        xs, ys, sizes, texts = [], [], [], []
        for row in rows:
            for step, (nodes, tokens, ms, seen) in enumerate(zip(row["step_nodes"], row["step_tokens"],
                                                                 row["step_verify_ms"], row["step_state"])):
                if seen == state:
                    xs.append(step)
                    ys.append(f"prompt {row['prompt_id']}")
                    sizes.append(4 + 2.2 * nodes ** 0.5)
                    texts.append(f"step {step}: {nodes} nodes, {tokens} tokens, verify {ms:.0f} ms")
        if xs:
            figure.add_scatter(x=xs, y=ys, mode="markers", name=state, text=texts, hoverinfo="text",
                               marker={"color": colour, "size": sizes, "line": {"width": 0}})
    figure.update_layout(title={"text": f"{strategy}: tree size (marker area) and controller state per step",
                                "y": 0.98, "yanchor": "top"},
                         xaxis_title="step", height=max(260, 60 + 26 * len(rows)),
                         legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
                         margin=dict(t=80, b=50, l=110, r=20))
    return figure


PROMPT_SETS = {"mt_bench": "MT-Bench", "spec_mix": "Spec mix (translation, summaries, RAG, math, QA, extraction, code)",
               "adversarial": "Adversarial prompts"}


def prompt_set_name(result: dict) -> str:
    """The prompt set a result was measured on, in words (from its prompts file)."""
    stem = Path(result.get("config", {}).get("prompts", "mt_bench")).stem
    return PROMPT_SETS.get(stem, stem)


def result_order(name: str) -> tuple[int, int, str]:
    """Sort key for result files: CPU before GPU, MT-Bench first within each, then by name."""
    flat = name.replace("_", "").replace("-", "").lower()
    return (1 if "gpu" in flat else 0, 0 if "mtbench" in flat else 1, name)


def bench_heading(result: dict) -> str:
    """A result's heading in words: the prompt set, its size, tokens, precision and machine."""
    config = result["config"]
    count = config.get("prompt_count") or config.get("limit") or "all"
    device = (result["device"].get("cuda") or result["device"].get("cpu_summary") or result["device"].get("cpu")
              or result["device"]["type"])
    detail = result["device"].get("engine_detail", "")
    device = f"{device} ({detail.split(':')[0]})" if detail.startswith("exact kernels") else device
    cut = (f" (cut off by its time limit after {count} of {config.get('prompts_planned')} prompts)"
           if result.get("complete") is False else "")
    return (f"#### {prompt_set_name(result)}: {count} prompts{cut}, {config['max_new_tokens']} new tokens, "
            f"{config['dtype']}, {device}")


def phase_figure(result: dict) -> go.Figure:
    """Milliseconds per step by phase, stacked, for the strategies that record phases."""
    summary = {n: s for n, s in result["summary"].items() if s.get("phase_ms_per_step")}
    figure = new_figure()
    for phase in PHASES:
        figure.add_bar(x=list(summary), y=[s["phase_ms_per_step"][phase] for s in summary.values()], name=phase)
    figure.update_layout(barmode="stack", title="ms per step by phase", yaxis_title="ms", height=380)
    return figure


def markdown_table(result: dict) -> str:
    """One row per strategy: tokens/step, tokens/s, speed-up vs AR, ms per step, identical share, and
    the largest top-2 logit gap of AR at a divergence (small: a rounding near-tie)."""
    lines = ["| strategy | tokens / step | tokens / s | vs plain | worst prompt | ms / step | same as plain "
             "| max gap at divergence |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        per_step = f"{s['mean_accepted']:.2f}" if s.get("mean_accepted") else "-"
        ms = f"{s['ms_per_step']:.1f}" if s.get("ms_per_step") else "-"
        same = f"{100 * s['identical_to_ar']:.0f} %" if s.get("identical_to_ar") is not None else "-"
        ratio = f"{s['speedup_vs_ar']:.2f}x" if s.get("speedup_vs_ar") else "-"
        gaps = s.get("divergence_logit_gaps") or []
        gap = f"{max(gaps):.3f} ({len(gaps)})" if gaps else "-"
        worst = f"{s['min_prompt_speedup']:.2f}x" if s.get("min_prompt_speedup") and name != "ar" else "-"
        lines.append(f"| {name} | {per_step} | {s['tokens_per_s']:.1f} | {ratio} | {worst} | {ms} | {same} | {gap} |")
    return "\n".join(lines)


def category_table(result: dict) -> str:
    """Speed-up over plain decoding per prompt category (rows: strategies), worst prompt in brackets."""
    summary = {n: s for n, s in result["summary"].items() if s.get("by_category")}
    categories = list(dict.fromkeys(c for s in summary.values() for c in s["by_category"]))
    if not categories:
        return ""
    lines = ["| strategy | " + " | ".join(categories) + " |", "|---" * (len(categories) + 1) + "|"]
    for name, s in summary.items():
        if name == "ar":
            continue
        cells = [s["by_category"].get(c) for c in categories]
        lines.append(f"| {name} | " + " | ".join(
            f"{c['speedup_vs_ar']:.2f}x ({c['min_prompt_speedup']:.2f}x)" if c else "-" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--html", type=Path, required=True)
    args = parser.parse_args()
    parts = []
    for number, path in enumerate(args.results):
        result = json.loads(path.read_text())
        parts.append(f"<h2>{path.name}</h2><pre>{markdown_table(result)}</pre>")
        # plotly.js embedded once (no network needed to view the report)
        parts.append(bench_figure(result, path.stem).to_html(full_html=False, include_plotlyjs=number == 0))
        parts.append(phase_figure(result).to_html(full_html=False, include_plotlyjs=False))
    args.html.write_text("<html><body>" + "\n".join(parts) + "</body></html>")
    for path in args.results:
        print(path.name)
        print(markdown_table(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
