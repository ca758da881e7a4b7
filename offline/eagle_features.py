"""The EAGLE drafter's training features: three of the base model's hidden states per answer position.

    python -m offline.eagle_features --data assets/distill/distill.jsonl.gz,assets/distill/distill_clean.jsonl.gz

At answer position j the base model's states at the token before answer[j] are captured: the
residual stream entering the decoder layers `eagle_taps` names (low, middle) and the final normed hidden
state (high: what the lm_head reads), each bf16, with the teacher's top-32 there. Answers whose
generation kept them (`offline.datagen` captures the taps while it writes) are read
from `<data>.features/`; the others take one teacher-forced forward per batch of answers. Written
in shards under `data/eagle/` so a stopped run resumes where it stopped. Answers are never committed
(only their token ids are: docs/DATA.md).
"""
from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from core.drafters.eagle import eagle_taps
from core.model import REPO_ROOT, BaseModel, ModelConfig, load_base_model
from offline.datagen import TEACHER_TOP, AnswerFeatures, features_dir, load_captured
from offline.train import padded_rows

FEATURES_DIR = REPO_ROOT / "data" / "eagle"
SHARD_ANSWERS = 256  # answers per shard (a stopped extraction loses at most one shard)


@dataclass
class FusedFeatures:
    """Per answer position j: the three states before answer[j] and what follows."""

    low: torch.Tensor  # [N, H] bf16
    mid: torch.Tensor  # [N, H] bf16
    high: torch.Tensor  # [N, H] bf16: the final normed hidden state (it predicted answer[j])
    tokens: torch.Tensor  # [N] long: answer[j]
    remaining: torch.Tensor  # [N] long: answer positions after j (0 at an answer's last position)
    teacher_ids: torch.Tensor  # [N, 32] int32: the base model's top-32 next tokens at j
    teacher_probs: torch.Tensor  # [N, 32] fp16

    @property
    def starts(self) -> torch.Tensor:
        """[A] the first position of every answer."""
        ends = torch.nonzero(self.remaining == 0).flatten()  # [A]
        return torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1] + 1])


def read_rows(path: Path) -> list[dict]:
    """Rows of a JSONL file, gzip-compressed or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def concat(parts: list[FusedFeatures]) -> FusedFeatures:
    return FusedFeatures(**{name: torch.cat([getattr(p, name) for p in parts])
                            for name in FusedFeatures.__dataclass_fields__})


@torch.inference_mode()
def extract(base: BaseModel, rows: list[dict], batch_size: int = 8) -> FusedFeatures:
    """One fp32 forward per batch of prompt + answer (right padded), states of every answer position."""
    parts = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids, mask = padded_rows(chunk)  # [b, T] each
        out = base.model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        low, mid = (out.hidden_states[t] for t in eagle_taps(len(out.hidden_states) - 1))  # [b, T, H] each
        for i, row in enumerate(chunk):
            first, count = len(row["prompt_ids"]) - 1, len(row["answer_ids"])
            region = slice(first, first + count)
            high = out.last_hidden_state[i, region]  # [count, H]
            top = torch.topk(torch.softmax(base.lm_head(high).float(), dim=-1), TEACHER_TOP, dim=-1)
            parts.append(FusedFeatures(low=low[i, region].bfloat16(), mid=mid[i, region].bfloat16(),
                                       high=high.bfloat16(), tokens=torch.tensor(row["answer_ids"]),
                                       remaining=torch.arange(count - 1, -1, -1),
                                       teacher_ids=top.indices.int(), teacher_probs=top.values.half()))
    return concat(parts)


def shard_path(data: Path, index: int) -> Path:
    return FEATURES_DIR / f"{data.name.split('.')[0]}-{index:04d}.pt"


def from_captured(row: dict, captured: AnswerFeatures) -> FusedFeatures:
    """One answer's features as the generator captured them while writing it (no forward): its
    tapped streams are the low and middle states, its hidden state the high one."""
    count = len(row["answer_ids"])
    low, mid = captured.tapped  # [count, H] each
    return FusedFeatures(low=low, mid=mid, high=captured.hidden, tokens=torch.tensor(row["answer_ids"]),
                         remaining=torch.arange(count - 1, -1, -1), teacher_ids=captured.teacher_ids,
                         teacher_probs=captured.teacher_probs)


def shard_features(base: BaseModel | None, rows: list[dict], captured: dict[str, AnswerFeatures]) -> FusedFeatures:
    """The features of `rows`: read from what generation captured where it kept the taps, else
    from one teacher-forced forward per batch (similar lengths batched together: less padding)."""
    kept, rest = [], []
    for row in rows:
        found = captured.get(row["id"])
        (kept if found is not None and found.tapped is not None else rest).append(row)
    rest.sort(key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))
    parts = [from_captured(r, captured[r["id"]]) for r in kept]
    if rest:
        if base is None:
            raise ValueError(f"{len(rest)} answers have no captured taps and no model was given to extract them")
        parts.append(extract(base, rest))
    return concat(parts)


def extract_file(base: BaseModel | None, data: Path, limit: int = 0) -> None:
    """Every shard of `data` not on disk yet (answers of >= 2 tokens, in file order); answers whose
    generation captured the taps (`offline.datagen`, `<data>.features/`) need no forward."""
    captured = load_captured(data, tapped=True)[1] if features_dir(data).exists() else {}
    rows = [r for r in read_rows(data) if len(r["answer_ids"]) >= 2]
    rows = rows[:limit] if limit else rows
    FEATURES_DIR.mkdir(parents=True, exist_ok=True)
    shards = range(0, len(rows), SHARD_ANSWERS)
    for index in tqdm(shards, desc=f"EAGLE features {data.name}"):
        path = shard_path(data, index // SHARD_ANSWERS)
        if path.exists():
            continue
        partial = path.with_suffix(".partial")
        torch.save(asdict(shard_features(base, rows[index:index + SHARD_ANSWERS], captured)), partial)
        partial.replace(path)


def load_features(data: list[Path]) -> FusedFeatures:
    """Every shard on disk of the files `data`, in order."""
    parts = []
    for path in data:
        for shard in sorted(FEATURES_DIR.glob(f"{path.name.split('.')[0]}-*.pt")):
            # mapped, not read: the shards stay in the page cache while `concat` copies them once
            # (2.65M positions are ~9 GB; reading them all before the copy would need twice that)
            parts.append(FusedFeatures(**torch.load(shard, weights_only=True, mmap=True)))
    if not parts:
        raise FileNotFoundError(f"no EAGLE features under {FEATURES_DIR}: run python -m offline.eagle_features")
    return concat(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="assets/distill/distill.jsonl.gz,assets/distill/distill_clean.jsonl.gz")
    parser.add_argument("--limit", type=int, default=0, help="answers per file (0: all)")
    args = parser.parse_args()
    base = load_base_model(ModelConfig(dtype="fp32", device="cpu", engine="hf"))
    for name in args.data.split(","):
        extract_file(base, REPO_ROOT / name, args.limit)


if __name__ == "__main__":
    main()
