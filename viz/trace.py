"""A run as a versioned JSON trace, and back: everything the views draw, so a trace replays without a model.

Format (version 2), one JSON object:
- `version`: 2; `kind`: "medusa-tree-lab-trace";
- `facts`: the run as the views see it (`viz.facts.RunFacts`): `prompt`, `strategy` (core.strategy
  grammar), `settings` (every setting by name), `output_ids`, `first_text`, `text`, `token_bytes`
  (hex bytes of every token drawn, so labels join byte-level pieces as live), `stats` (the speed
  card: tokens/s, the ratio to plain decoding and its basis), `check` (the plain-greedy comparison),
  `ar` (the recorded plain-decoding baseline: per-token seconds or a one-token estimate), `state`,
  `note`, `finished`, `stop_reason`, `model`, `heads`;
- `steps`: one `core.records.StepRecord` per step, field by field: the heads' top-m tokens and
  probabilities, the verified tree (`outcome`: rank paths, scores, node tokens and texts, sources,
  accepted path, bonus token, the base model's argmax after each node), the fixed-tree
  counterfactual (`comparison`), the other heads family's tree on the same context (`rival`: Hydra
  beside Medusa or Medusa beside Hydra), the whole tree the drafters proposed where the step
  verified a part of it (`proposal`; absent in older traces), phase times, the controller's state;
- `meta`: free-form extras (the run summary, the DecodeConfig, prefill time; a gallery entry adds
  `title`, `notice` and per-step `notes`).

`to_jsonable` writes init fields that do not start with an underscore (CandidateTree keeps an index
and cached buffers), tensors as lists and non-finite floats as null. `load_trace` rebuilds the same
record types and checks what drawing relies on: a malformed trace is a `TraceError` with a message.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from core.records import PhaseTimes, StepRecord, TreeOutcome
from core.strategy import StrategyError, parse_strategy
from core.tree import CandidateTree
from viz.facts import ArBaseline, RunFacts, RunStats

TRACE_VERSION = 2
TRACE_KIND = "medusa-tree-lab-trace"
MAX_TRACE_BYTES = 8_000_000  # a 1024-token run with 256-node trees is about 3 MB
MAX_TRACE_STEPS = 1100


class TraceError(ValueError):
    """A file that is not a trace this lab can replay (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """A loaded trace: the run's facts (drawn like a live run's) and its meta."""

    facts: RunFacts
    meta: dict[str, Any]


def to_jsonable(value: Any) -> Any:
    """Plain JSON types from dataclasses, tuples, tensors, dicts and floats."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name))
                for f in dataclasses.fields(value) if f.init and not f.name.startswith("_")}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return to_jsonable(value.tolist())
    return str(value)


def record_to_dict(record: StepRecord) -> dict[str, Any]:
    """One step: the dataclass fields plus a few derived numbers (phase total, accepted length)."""
    data = to_jsonable(record)
    data["times"]["total"] = to_jsonable(record.times.total)
    data["outcome"]["accepted_length"] = record.outcome.accepted_length
    for name in ("comparison", "rival", "proposal"):
        if getattr(record, name) is not None:
            data[name]["accepted_length"] = getattr(record, name).accepted_length
    return data


def _drawn_tokens(facts: RunFacts) -> set[int]:
    tokens = set(facts.output_ids)
    for record in facts.records:
        tokens.update(record.outcome.node_tokens)
        tokens.add(record.outcome.bonus_token)
        tokens.update(t for row in record.head_token_ids for t in row)
        for other in (record.comparison, record.rival, record.proposal):
            if other is not None:
                tokens.update(other.node_tokens)
                tokens.add(other.bonus_token)
    return tokens


def facts_to_dict(facts: RunFacts) -> dict[str, Any]:
    """The run's facts without its steps (those go to `steps`)."""
    token_bytes = {str(t): facts.token_bytes[t].hex() for t in sorted(_drawn_tokens(facts)) if t in facts.token_bytes}
    return {"prompt": facts.prompt, "strategy": facts.spec.text, "settings": to_jsonable(facts.settings),
            "output_ids": list(facts.output_ids), "first_text": facts.first_text, "text": facts.text,
            "token_bytes": token_bytes, "stats": to_jsonable(facts.stats), "check": to_jsonable(facts.check),
            "ar": to_jsonable(facts.ar), "state": facts.state, "note": facts.note, "finished": facts.finished,
            "stop_reason": facts.stop_reason, "model": facts.model, "heads": facts.heads}


def trace_dict(facts: RunFacts, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The whole run: its facts, every step and `meta`."""
    return {"version": TRACE_VERSION, "kind": TRACE_KIND, "facts": facts_to_dict(facts),
            "steps": [record_to_dict(r) for r in facts.records], "meta": to_jsonable(meta)}


def trace_json(facts: RunFacts, meta: Mapping[str, Any]) -> str:
    """`trace_dict` as indented, strict JSON (UTF-8 text, non-ASCII kept)."""
    return json.dumps(trace_dict(facts, meta), ensure_ascii=False, indent=1, allow_nan=False)


# -- loading ----------------------------------------------------------------------------------------
def _float(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _ints(value: Any) -> list[int]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise TypeError("expected a list of whole numbers")
    return list(value)


def _strs(value: Any) -> list[str]:
    if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
        raise TypeError("expected a list of texts")
    return list(value)


def _outcome(data: dict) -> TreeOutcome:
    tree_data = data["tree"]
    paths = [tuple(_ints(p)) for p in tree_data["paths"]]
    scores = None if tree_data.get("scores") is None else [_float(s) for s in tree_data["scores"]]
    tree = CandidateTree(paths=paths, scores=scores, kind=str(tree_data.get("kind", "fixed")))
    outcome = TreeOutcome(
        tree=tree, node_tokens=_ints(data["node_tokens"]), node_scores=[_float(s) for s in data["node_scores"]],
        accepted_nodes=_ints(data["accepted_nodes"]), bonus_token=int(data["bonus_token"]),
        node_texts=_strs(data.get("node_texts", [])), bonus_text=str(data.get("bonus_text", "")),
        lookup_rank=None if data.get("lookup_rank") is None else int(data["lookup_rank"]),
        chain_sources=tuple(_strs(data.get("chain_sources", []))),
        head_scores=[None if s is None else _float(s) for s in data.get("head_scores", [])],
        base_top_tokens=_ints(data.get("base_top_tokens", [])))
    size = tree.num_nodes + 1
    if len(outcome.node_tokens) != size or len(outcome.node_scores) != size:
        raise ValueError(f"a tree of {tree.num_nodes} nodes needs {size} node tokens and scores")
    if outcome.node_texts and len(outcome.node_texts) != size:
        raise ValueError(f"a tree of {tree.num_nodes} nodes needs {size} node texts")
    nodes = outcome.accepted_nodes
    if not nodes or nodes[0] != 0 or any(not 0 <= n < size for n in nodes) or \
            any(tree.parents[child] != parent for parent, child in zip(nodes, nodes[1:])):
        raise ValueError("the accepted path must run from the root down the tree")
    return outcome


def _step(data: dict, number: int) -> StepRecord:
    times = {name: _float(data["times"].get(name, 0.0)) for name in ("heads", "tree", "verify", "accept", "commit",
                                                                      "compare")}
    heads = [_ints(row) for row in data.get("head_token_ids", [])]
    probs = [[_float(p) for p in row] for row in data.get("head_probs", [])]
    if [len(r) for r in heads] != [len(r) for r in probs]:
        raise ValueError("head tokens and probabilities differ in shape")
    top = data.get("top_logits")
    record = StepRecord(
        index=int(data["index"]), strategy=str(data["strategy"]), context_length=int(data["context_length"]),
        head_token_ids=heads, head_probs=probs, outcome=_outcome(data["outcome"]), new_tokens=_ints(data["new_tokens"]),
        times=PhaseTimes(**times), comparison=None if data.get("comparison") is None else _outcome(data["comparison"]),
        head_texts=[_strs(row) for row in data.get("head_texts", [])],
        top_logits=None if top is None else (_float(top[0]), _float(top[1])), controller=str(data.get("controller", "")),
        rival=None if data.get("rival") is None else _outcome(data["rival"]),
        proposal=None if data.get("proposal") is None else _outcome(data["proposal"]))
    if record.index != number:
        raise ValueError(f"step {number + 1} says it is step {record.index + 1}")
    return record


def _run_stats(stats: dict) -> RunStats:
    """The speed card's totals, each of its declared type (a number where a number is drawn)."""
    checked: dict[str, Any] = {}
    for name, default in dataclasses.asdict(RunStats()).items():
        if name not in stats:
            continue
        value = stats[name]
        if isinstance(default, str):
            if not isinstance(value, str):
                raise TypeError(f"stats.{name}: expected a text, got {type(value).__name__}")
            checked[name] = value
        elif isinstance(default, int):
            checked[name] = int(_float(value)) if value is not None else default
        else:  # floats, and vs_plain, which may be absent (None)
            checked[name] = None if value is None and default is None else _float(value)
    return RunStats(**checked)


def _scalars(value: Any, what: str) -> dict[str, Any]:
    """A flat mapping of JSON scalars (settings, the greedy check): what the summary prints."""
    if not isinstance(value, dict) or any(isinstance(v, (dict, list)) for v in value.values()):
        raise TypeError(f"{what}: expected names with plain values")
    return dict(value)


def _facts(data: dict, steps: list[StepRecord], meta: dict) -> RunFacts:
    run_stats = _run_stats(dict(data["stats"]))
    ar = data.get("ar")
    baseline = None if ar is None else ArBaseline(step_seconds=[_float(s) for s in ar.get("step_seconds", [])],
                                                  seconds_per_token=None if ar.get("seconds_per_token") is None
                                                  else _float(ar["seconds_per_token"]))
    output_ids = _ints(data["output_ids"])
    if not output_ids:
        raise ValueError("a run holds at least the prefill's token")
    token_bytes = {int(k): bytes.fromhex(v) for k, v in dict(data.get("token_bytes", {})).items()}
    notes = {int(k) - 1: str(v) for k, v in dict(meta.get("notes", {})).items()}
    settings = _scalars(data["settings"], "settings")
    return RunFacts(prompt=str(data["prompt"]), spec=parse_strategy(data["strategy"]), settings=settings,
                    records=steps, output_ids=output_ids, first_text=str(data.get("first_text", "")),
                    text=str(data.get("text", "")), token_bytes=token_bytes, stats=run_stats,
                    check=_scalars(data.get("check", {}), "check"), ar=baseline, state=str(data.get("state", "recorded")),
                    note=str(data.get("note", "")), finished=bool(data.get("finished", False)),
                    stop_reason=str(data.get("stop_reason", "")), model=str(data.get("model", "")),
                    heads=str(data.get("heads", "")), recording=str(meta.get("title", "an exported run")),
                    step_notes=notes, notice=str(meta.get("notice", "")))


def _parse(raw: str | bytes) -> dict:
    if len(raw) > MAX_TRACE_BYTES:
        raise TraceError(f"the file is {len(raw):,} bytes; traces up to {MAX_TRACE_BYTES:,} bytes are accepted")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise TraceError("not a trace: the file is not valid JSON (a trace is the .json the Export button "
                         "writes)") from None
    if not isinstance(data, dict) or data.get("kind", TRACE_KIND) != TRACE_KIND or "version" not in data:
        raise TraceError("not a Medusa Tree Lab trace: expected a JSON object with a version, facts and steps")
    if data["version"] != TRACE_VERSION:
        raise TraceError(f"this trace is version {data['version']!r}; this lab replays version {TRACE_VERSION} "
                         f"(export the run again from a current lab)")
    return data


def load_trace(raw: str | bytes) -> Trace:
    """A trace from its JSON text; TraceError (with the reason) for anything this lab cannot replay."""
    data = _parse(raw)
    try:
        steps_data, meta = data["steps"], dict(data.get("meta") or {})
        if not isinstance(steps_data, list) or len(steps_data) > MAX_TRACE_STEPS:
            raise ValueError(f"steps must be a list of at most {MAX_TRACE_STEPS}")
        steps = [_step(step, number) for number, step in enumerate(steps_data)]
        return Trace(facts=_facts(data["facts"], steps, meta), meta=meta)
    except StrategyError as error:
        raise TraceError(f"the trace's strategy is not in the grammar: {error}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        what = f"missing field {error}" if isinstance(error, KeyError) else str(error)
        raise TraceError(f"the trace is damaged or not from this lab ({what[:160]})") from None
