"""A run as a versioned JSON trace, and back: everything the views draw, so a trace replays without a model.

Format (version 3), one JSON object:
- `version`: 3; `kind`: "medusa-tree-lab-trace";
- `facts`: the run as the views see it (`viz.facts.RunFacts`): `prompt`, `strategy` (core.strategy
  grammar), `settings` (every setting by name), `output_ids`, `first_text`, `text`, `token_bytes`
  (hex bytes of every token drawn, so labels join byte-level pieces as live), `stats` (the speed
  card: tokens/s, the ratio to plain decoding and its basis), `check` (the plain-greedy comparison),
  `ar` (the recorded plain-decoding baseline: per-token seconds or a one-token estimate), `state`,
  `note`, `finished`, `stop_reason`, `model`, `heads`;
- `steps`: one `core.records.StepRecord` per step, field by field: the run's `family` and the step's
  `kind` (what it verified: "tree", "plain" or "chains"), the heads' top-m tokens and
  probabilities, the verified tree (`outcome`: rank paths, scores, node tokens and texts, sources,
  accepted path, bonus token, the base model's argmax after each node), the fixed-tree
  counterfactual (`comparison`), the other heads family's tree on the same context (`rival`: Hydra
  beside Medusa or Medusa beside Hydra), the whole tree the drafters proposed where the step
  verified a part of it (`proposal`; absent in older traces), phase times, the controller's state;
- `meta`: free-form extras (the run summary, the DecodeConfig, prefill time; a gallery entry adds
  `title`, `notice` and per-step `notes`).

Version 2 (a step's `strategy` held its family or, for a plain or chains-only step, "autoregressive" or
"lookup") is read by rewriting its steps (`upgrade_trace`).

`to_jsonable` writes init fields that do not start with an underscore (CandidateTree keeps an index
and cached buffers), tensors as lists and non-finite floats as null. `load_trace` rebuilds the same
record types and checks what drawing relies on: a malformed trace is a `TraceError` with a message.
"""
from __future__ import annotations

import dataclasses
import html
import json
import math
import re
from enum import Enum
from typing import Any, Mapping

from core.families import AUTOREGRESSIVE, FAMILIES
from core.records import PhaseTimes, StepKind, StepRecord, TreeOutcome
from core.strategy import MAX_DEPTH, MAX_TOP_M, MAX_TREE_ROWS, StrategyError, parse_strategy
from core.tree import CandidateTree
from viz.facts import ArBaseline, RunFacts, RunStats

TRACE_VERSION = 3
TRACE_KIND = "medusa-tree-lab-trace"
MAX_TRACE_BYTES = 8_000_000  # a 1024-token run with 256-node trees is about 3 MB
MAX_TRACE_STEPS = 1100
# what the live page can draw, so what a trace may hold (its arrays are checked against these)
MAX_TREE_NODES = MAX_TREE_ROWS - 1
MAX_TOKEN_ID = 2**31 - 1
TREE_KINDS = frozenset(FAMILIES) | {"fixed", "dynamic"}
NUMERIC_SETTINGS = ("budget", "top_m", "depth", "temperature", "max_new_tokens")


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
    if isinstance(value, Enum):
        return value.value
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


def _between(value: Any, low: float, high: float, what: str) -> float:
    """A finite number in [low, high] (None stands for a missing one: NaN, drawn as such)."""
    number = _float(value)
    if value is not None and not low <= number <= high:
        raise ValueError(f"{what} must be between {low:g} and {high:g}, got {number:g}")
    return number


def _int(value: Any, what: str = "a whole number", low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_TOKEN_ID:
        raise ValueError(f"{what} must be a whole number from {low} to {MAX_TOKEN_ID}, got {str(value)[:24]}")
    return value


def _ints(value: Any, limit: int | None = None, low: int = 0) -> list[int]:
    if not isinstance(value, list) or (limit is not None and len(value) > limit):
        raise TypeError("expected a list of whole numbers" + (f" (at most {limit})" if limit is not None else ""))
    return [_int(v, low=low) for v in value]


def _strs(value: Any) -> list[str]:
    if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
        raise TypeError("expected a list of texts")
    return list(value)


def _outcome(data: dict) -> TreeOutcome:
    tree_data = data["tree"]
    if not isinstance(tree_data["paths"], list) or len(tree_data["paths"]) > MAX_TREE_NODES:
        raise ValueError(f"a tree holds at most {MAX_TREE_NODES} nodes")
    paths = [tuple(_ints(p, MAX_TREE_NODES)) for p in tree_data["paths"]]
    scores = None if tree_data.get("scores") is None else [_float(s) for s in tree_data["scores"]]
    kind = tree_data.get("kind", "fixed")
    if kind not in TREE_KINDS:
        raise ValueError(f"unknown tree kind {str(kind)[:24]!r}")
    tree = CandidateTree(paths=paths, scores=scores, kind=kind)
    outcome = TreeOutcome(
        tree=tree, node_tokens=_ints(data["node_tokens"]), node_scores=[_float(s) for s in data["node_scores"]],
        accepted_nodes=_ints(data["accepted_nodes"]), bonus_token=_int(data["bonus_token"], "a bonus token"),
        node_texts=_strs(data.get("node_texts", [])), bonus_text=str(data.get("bonus_text", "")),
        lookup_rank=None if data.get("lookup_rank") is None else _int(data["lookup_rank"], "a lookup rank"),
        chain_sources=tuple(_strs(data.get("chain_sources", []))),
        head_scores=[None if s is None else _float(s) for s in data.get("head_scores", [])],
        base_top_tokens=_ints(data.get("base_top_tokens", []), MAX_TREE_ROWS, low=-1))  # -1: not known
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


def _family(name: object) -> str:
    if name not in FAMILIES:
        raise ValueError(f"a step's family must be one of {sorted(FAMILIES)}")
    return str(name)


def upgrade_trace(data: dict) -> dict:
    """A version-2 trace as version 3: each step's `strategy` (its family, or "autoregressive" / "lookup" for a
    step that verified the root or the chains alone) becomes the run's `family` and the step's `kind`."""
    family = parse_strategy(data["facts"]["strategy"]).family
    kinds = {AUTOREGRESSIVE: StepKind.PLAIN.value, "lookup": StepKind.CHAINS.value}
    steps = [{**{k: v for k, v in step.items() if k != "strategy"}, "family": family,
              "kind": kinds.get(step.get("strategy"), StepKind.TREE.value)}
             if isinstance(step, dict) else step for step in data.get("steps", [])]
    return {**data, "version": TRACE_VERSION, "steps": steps}


def _step(data: dict, number: int) -> StepRecord:
    times = {name: _between(data["times"].get(name, 0.0), 0.0, 3600.0, f"a step's {name} seconds")
             for name in ("heads", "tree", "verify", "accept", "commit", "compare")}
    head_rows, prob_rows = data.get("head_token_ids", []), data.get("head_probs", [])
    if not isinstance(head_rows, list) or not isinstance(prob_rows, list) or len(head_rows) > MAX_DEPTH + 1:
        raise ValueError(f"a step holds at most {MAX_DEPTH + 1} rows of head guesses")
    heads = [_ints(row, MAX_TOP_M) for row in head_rows]
    probs = [[_between(p, 0.0, 1.0, "a head's probability") for p in row] for row in prob_rows]
    if [len(r) for r in heads] != [len(r) for r in probs]:
        raise ValueError("head tokens and probabilities differ in shape")
    top = data.get("top_logits")
    record = StepRecord(
        index=_int(data["index"], "a step index"), family=_family(data["family"]), kind=StepKind(data["kind"]),
        context_length=_int(data["context_length"], "a context length"),
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
            checked[name] = int(_between(value, -2**53, 2**53, f"stats.{name}")) if value is not None else default
        else:  # floats, and vs_plain, which may be absent (None)
            checked[name] = None if value is None and default is None else _between(value, -1e12, 1e12, f"stats.{name}")
    return RunStats(**checked)


def _scalars(value: Any, what: str) -> dict[str, Any]:
    """A flat mapping of JSON scalars (settings, the greedy check): what the summary prints."""
    if not isinstance(value, dict) or any(isinstance(v, (dict, list)) for v in value.values()):
        raise TypeError(f"{what}: expected names with plain values")
    return dict(value)


def _facts(data: dict, steps: list[StepRecord], meta: dict) -> RunFacts:
    run_stats = _run_stats(dict(data["stats"]))
    ar = data.get("ar")
    baseline = None if ar is None else ArBaseline(
        step_seconds=[_between(s, 1e-9, 3600.0, "a plain step's seconds") for s in ar.get("step_seconds", [])],
        seconds_per_token=None if ar.get("seconds_per_token") is None
        else _between(ar["seconds_per_token"], 1e-9, 3600.0, "plain decoding's seconds a token"))
    output_ids = _ints(data["output_ids"])
    if not output_ids:
        raise ValueError("a run holds at least the prefill's token")
    token_bytes = {int(k): bytes.fromhex(v) for k, v in dict(data.get("token_bytes", {})).items()}
    notes = {int(k) - 1: str(v) for k, v in dict(meta.get("notes", {})).items()}
    settings = _scalars(data["settings"], "settings")
    for name in NUMERIC_SETTINGS:
        if name in settings:
            _between(settings[name], 0, 10**6, f"settings.{name}")
    return RunFacts(prompt=str(data["prompt"]), spec=parse_strategy(data["strategy"]), settings=settings,
                    records=steps, output_ids=output_ids, first_text=str(data.get("first_text", "")),
                    text=str(data.get("text", "")), token_bytes=token_bytes, stats=run_stats,
                    check=_scalars(data.get("check", {}), "check"), ar=baseline, state=str(data.get("state", "recorded")),
                    note=str(data.get("note", "")), finished=bool(data.get("finished", False)),
                    stop_reason=str(data.get("stop_reason", "")), model=str(data.get("model", "")),
                    heads=str(data.get("heads", "")), recording=str(meta.get("title", "an exported run")),
                    step_notes=notes, notice=str(meta.get("notice", "")))


_MARKDOWN_MARKS = re.compile(r"([\\\[\]()!])")  # links and images


def inert_text(text: str) -> str:
    """`text` shown as written where the page renders Markdown with HTML: HTML's specials as entities,
    Markdown's link and image marks escaped, and "://" spelt as an entity so that no bare address is
    linked (no tag, link or image comes from it)."""
    escaped = _MARKDOWN_MARKS.sub(r"\\\1", html.escape(text, quote=False))
    return escaped.replace("://", "&#58;//")  # no bare address becomes a link either


def _inert_facts(facts: RunFacts) -> RunFacts:
    def inert(value: Any) -> Any:
        return inert_text(value) if isinstance(value, str) else value
    return dataclasses.replace(
        facts, recording=inert(facts.recording), notice=inert(facts.notice), note=inert(facts.note),
        state=inert(facts.state), stop_reason=inert(facts.stop_reason), model=inert(facts.model),
        heads=inert(facts.heads), settings={k: inert(v) for k, v in facts.settings.items()},
        check={k: inert(v) for k, v in facts.check.items()},
        step_notes={k: inert(v) for k, v in facts.step_notes.items()})


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
    if data["version"] not in (2, TRACE_VERSION):
        raise TraceError(f"this trace is version {data['version']!r}; this lab replays version {TRACE_VERSION} "
                         f"(export the run again from a current lab)")
    return data


def load_trace(raw: str | bytes, untrusted: bool = False) -> Trace:
    """A trace from its JSON text; TraceError (with the reason) for anything this lab cannot replay.
    `untrusted` (an upload): its free texts (title, notes, state, settings...) are made inert, shown as
    written, never as Markdown or HTML (a shared trace must not load images or change the layout)."""
    data = _parse(raw)
    try:
        data = upgrade_trace(data) if data["version"] == 2 else data
        steps_data, meta = data["steps"], dict(data.get("meta") or {})
        if not isinstance(steps_data, list) or len(steps_data) > MAX_TRACE_STEPS:
            raise ValueError(f"steps must be a list of at most {MAX_TRACE_STEPS}")
        steps = [_step(step, number) for number, step in enumerate(steps_data)]
        facts = _facts(data["facts"], steps, meta)
        return Trace(facts=_inert_facts(facts) if untrusted else facts, meta=meta)
    except StrategyError as error:
        raise TraceError(f"the trace's strategy is not in the grammar: {error}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as error:
        what = f"missing field {error}" if isinstance(error, KeyError) else str(error)
        raise TraceError(inert_text(f"the trace is damaged or not from this lab ({what[:160]})")) from None
