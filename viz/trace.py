"""A run as a JSON trace: every StepRecord, converted field by field (no core import needed).

`dataclasses.asdict` is not used because it deep-copies everything and would trip over
private and cached fields (CandidateTree keeps an index and cached buffers); here only init
fields that do not start with an underscore are written, tensors become lists and
non-finite floats become null (JSON has no NaN).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from core.records import StepRecord

TRACE_VERSION = 1


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
    if record.comparison is not None:
        data["comparison"]["accepted_length"] = record.comparison.accepted_length
    return data


def trace_dict(records: Sequence[StepRecord], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The whole run: `meta` (prompt, settings, model, output, checks) and every step."""
    return {"version": TRACE_VERSION, "meta": to_jsonable(meta), "steps": [record_to_dict(r) for r in records]}


def trace_json(records: Sequence[StepRecord], meta: Mapping[str, Any]) -> str:
    """`trace_dict` as indented, strict JSON (UTF-8 text, non-ASCII kept)."""
    return json.dumps(trace_dict(records, meta), ensure_ascii=False, indent=1, allow_nan=False)
