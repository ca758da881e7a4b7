"""Training Medusa-1 heads on the frozen base model by self-distillation.

    python -m core.train --data data/distill.jsonl --out assets/heads

1. Features: one batched bf16 forward of the frozen base over prompt + answer gives the last
   hidden state at every answer position, plus the base model's own top-32 next-token
   distribution there (the soft target). Cached to disk.
2. Heads: head k (1-based) at position t learns the base distribution for token t+k+1 (the
   distribution the base model has at position t+k): cross-entropy to the renormalised top-32
   teacher probabilities, loss weight 0.8^(k-1). The base lm_head is shared and frozen.
3. Evaluation: per-head top-1 / top-5 accuracy on the base model's fp32 greedy answers to the
   80 MT-Bench questions (never trained on), written to `report.json` next to the weights.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from core.datagen import generate_batch
from core.heads import HeadsConfig, MedusaHeads
from core.model import REPO_ROOT, BaseModel, ModelConfig, load_base_model
from core.simulate import head_proposals

TEACHER_TOP = 32
MT_BENCH = REPO_ROOT / "assets" / "data" / "mt_bench.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (all recorded in the report)."""

    data: str = "data/distill.jsonl"
    out: str = "assets/heads"
    num_heads: int = 4
    num_layers: int = 1
    epochs: float = 1.0
    batch_size: int = 1024
    lr: float = 3e-3
    weight_decay: float = 0.0
    decay: float = 0.8
    max_positions: int = 0  # 0: all
    seed: int = 0
    eval_tokens: int = 128
    draft_vocab: int = 16384  # tokens the heads rank at decode time (0: all)


@dataclass
class Features:
    """Hidden states at answer positions and what each head must predict there."""

    hidden: torch.Tensor  # [N, H] bf16, position j of an answer
    remaining: torch.Tensor  # [N] long: answer tokens after position j's target (j+k valid iff k < remaining)
    tokens: torch.Tensor  # [N] long: the token position j's hidden state predicts (answer[j])
    teacher_ids: torch.Tensor  # [N, 32] int: the base model's top-32 next tokens at j
    teacher_probs: torch.Tensor  # [N, 32] float16: their probabilities


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


@torch.inference_mode()
def extract_features(base: BaseModel, rows: list[dict], batch_size: int = 8) -> Features:
    """One batched forward of the frozen base over each prompt + answer (right padded)."""
    hidden, remaining, tokens, teacher_ids, teacher_probs = [], [], [], [], []
    rows = sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))
    for start in tqdm(range(0, len(rows), batch_size), desc="features"):
        chunk = [r for r in rows[start:start + batch_size] if len(r["answer_ids"]) >= 2]
        if not chunk:
            continue
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [b, T]
        mask = torch.zeros(len(seqs), width, dtype=torch.long)  # [b, T]
        for i, seq in enumerate(seqs):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        states = base.model.model(input_ids=ids.to(base.device), attention_mask=mask.to(base.device)).last_hidden_state
        for i, row in enumerate(chunk):
            first, count = len(row["prompt_ids"]) - 1, len(row["answer_ids"])
            region = states[i, first:first + count]  # [count, H]: hidden at t predicts answer[j]
            top = torch.topk(torch.softmax(base.lm_head(region).float(), dim=-1), TEACHER_TOP, dim=-1)
            hidden.append(region.to(torch.bfloat16).cpu())
            remaining.append(torch.arange(count - 1, -1, -1))
            tokens.append(torch.tensor(row["answer_ids"]))
            teacher_ids.append(top.indices.int().cpu())
            teacher_probs.append(top.values.half().cpu())
    return Features(hidden=torch.cat(hidden), remaining=torch.cat(remaining), tokens=torch.cat(tokens),
                    teacher_ids=torch.cat(teacher_ids), teacher_probs=torch.cat(teacher_probs))


@dataclass(frozen=True)
class TrainVocab:
    """The rows of the frozen lm_head the heads learn to rank (their draft vocabulary, or all)."""

    weight: torch.Tensor  # [V', H]
    index_of: torch.Tensor  # [V] long: each vocabulary id's row in `weight`, -1 if not drafted


def train_vocab(lm_head_weight: torch.Tensor, token_ids: torch.Tensor | None) -> TrainVocab:
    """A TrainVocab over `token_ids` [V'] (None: the whole vocabulary)."""
    vocab_size = lm_head_weight.shape[0]
    if token_ids is None:
        return TrainVocab(weight=lm_head_weight, index_of=torch.arange(vocab_size))
    index_of = torch.full((vocab_size,), -1, dtype=torch.long)
    index_of[token_ids] = torch.arange(len(token_ids))
    return TrainVocab(weight=lm_head_weight[token_ids].contiguous(), index_of=index_of)


def head_loss(heads: MedusaHeads, vocab: TrainVocab, features: Features, index: torch.Tensor,
              decay: float) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy over heads for positions `index`, and per-head top-1 accuracy.

    The softmax runs over the draft vocabulary the heads rank at decode time (a third of the
    lm_head rows: a third of the training cost); teacher mass on other tokens is dropped."""
    hidden = features.hidden[index].float()  # [B, H]
    states = heads.head_states(hidden)  # [K, B, H]
    total = hidden.new_zeros(())
    accuracy = []
    for k in range(states.shape[0]):
        valid = features.remaining[index] > k  # target j+k+1 exists  [B]
        target = index[valid] + k + 1  # teacher at position j+k+1 predicts answer[j+k+1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=states.device.type == "cpu"):
            logits = F.linear(states[k][valid], vocab.weight)  # [b, V']
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        teacher = vocab.index_of[features.teacher_ids[target].long()]  # [b, 32], -1: not drafted
        probs = features.teacher_probs[target].float() * (teacher >= 0)
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-9)  # [b, 32]
        loss = -(probs * log_probs.gather(1, teacher.clamp_min(0))).sum(dim=-1).mean()
        total = total + decay ** k * loss
        hits = logits.argmax(dim=-1) == vocab.index_of[features.tokens[target]]
        accuracy.append(float(hits.float().mean()))
    return total, accuracy


def frequency_vocab(answer_tokens: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens, most frequent first; ties and unseen tokens by id
    (a BPE's low ids are its earliest, most frequent merges). [size] long."""
    counts = torch.bincount(answer_tokens.long(), minlength=vocab_size).double()  # [V]
    ids = torch.arange(vocab_size, dtype=torch.double)
    # count first, lower id second: one stable descending sort on a combined key
    order = torch.argsort(counts * vocab_size - ids, descending=True)
    return order[:size].clone()


def train_heads(base: BaseModel, features: Features, config: TrainConfig) -> MedusaHeads:
    """AdamW with warm-up and cosine decay; a progress bar shows loss and per-head top-1.

    The heads' draft vocabulary (`config.draft_vocab` most frequent answer tokens) only narrows
    what they rank at decode time; training uses the whole vocabulary."""
    torch.manual_seed(config.seed)
    vocab_size = base.model.config.vocab_size
    draft_size = min(config.draft_vocab, vocab_size)
    heads = MedusaHeads(HeadsConfig(num_heads=config.num_heads, num_layers=config.num_layers,
                                    hidden_size=base.model.config.hidden_size,
                                    vocab_size=vocab_size, draft_vocab_size=draft_size))
    heads.draft_vocab.copy_(frequency_vocab(features.tokens, draft_size, vocab_size))
    vocab = train_vocab(base.lm_head.weight, heads.draft_vocab if draft_size else None)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    positions = features.hidden.shape[0] if not config.max_positions else min(config.max_positions, features.hidden.shape[0])
    steps = max(1, int(config.epochs * positions / config.batch_size))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(features.hidden.shape[0], generator=generator)[:positions]
    bar = tqdm(range(steps), desc="training")
    for step in bar:
        offset = (step * config.batch_size) % positions
        index = order[offset:offset + config.batch_size]
        loss, accuracy = head_loss(heads, vocab, features, index, config.decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{a:.2f}" for a in accuracy))
    return heads.eval().requires_grad_(False)


def mt_bench_answers(base_fp32: BaseModel, max_new_tokens: int, cache: Path) -> list[dict]:
    """The base model's fp32 greedy answers to the 80 MT-Bench first turns (cached), batched by 8."""
    if cache.exists():
        return load_rows(cache)
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    rows = []
    for start in tqdm(range(0, len(questions), 8), desc="MT-Bench answers (fp32)"):
        chunk = questions[start:start + 8]
        answers = generate_batch(base_fp32, [q["turns"][0] for q in chunk], max_new_tokens, sample=False)
        rows += [{"id": q.get("question_id"), "prompt_ids": base_fp32.chat_ids(q["turns"][0]), "answer_ids": a}
                 for q, a in zip(chunk, answers)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@torch.inference_mode()
def head_accuracy(base: BaseModel, heads: MedusaHeads, rows: list[dict], top: int = 10) -> list[list[float]]:
    """acc[k][r]: share of positions where head k+1's target is within its top-(r+1), ranked over
    the heads' draft vocabulary as the decoder ranks them. Teacher-forced."""
    hits = torch.zeros(heads.config.num_heads, top)
    counts = torch.zeros(heads.config.num_heads)
    draft = heads.draft_projection(base.lm_head)
    for row in rows:
        count = len(row["answer_ids"])
        _, top_ids = head_proposals(base, heads, row["prompt_ids"], row["answer_ids"], top, draft)  # [count, K, top]
        ranks = top_ids.transpose(0, 1)  # [K, count, top]
        answer = torch.tensor(row["answer_ids"])
        for k in range(heads.config.num_heads):
            valid = count - k - 1  # positions j with a target answer[j+k+1]
            if valid <= 0:
                continue
            match = ranks[k, :valid] == answer[k + 1:k + 1 + valid, None]  # [valid, top]
            hits[k] += match.cumsum(dim=1).clamp(max=1).sum(dim=0).float()
            counts[k] += valid
    return (hits / counts.clamp_min(1)[:, None]).tolist()


def draft_coverage(heads: MedusaHeads, rows: list[dict]) -> float:
    """Share of the answer tokens in `rows` that the heads' draft vocabulary contains."""
    tokens = torch.tensor([t for row in rows for t in row["answer_ids"]])
    if not heads.config.draft_vocab_size:
        return 1.0
    return float(torch.isin(tokens, heads.draft_vocab).float().mean())


def calibrated_choices(accuracy: list[list[float]], budget: int) -> list[list[int]]:
    """Medusa's greedy tree construction from per-head top-k accuracies.

    The value of path (r1..rd) is the product over depths of P(head d's target is exactly its
    rank-rd token). Start from [0]; repeatedly add the neighbouring path (first child or next
    sibling of a node already in the tree) with the largest value.
    """
    exact = [[acc[0]] + [acc[r] - acc[r - 1] for r in range(1, len(acc))] for acc in accuracy]

    def value(path: tuple[int, ...]) -> float:
        return math.prod(exact[d][r] for d, r in enumerate(path))

    chosen: list[tuple[int, ...]] = [(0,)]
    frontier = set()
    while len(chosen) < budget:
        last = chosen[-1]
        if len(last) < len(exact):
            frontier.add(last + (0,))
        if last[-1] + 1 < len(exact[0]):
            frontier.add(last[:-1] + (last[-1] + 1,))
        if not frontier:
            break
        best = max(sorted(frontier), key=value)
        frontier.discard(best)
        chosen.append(best)
    return [list(p) for p in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in asdict(TrainConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    config = TrainConfig(**vars(parser.parse_args()))
    random.seed(config.seed)
    started = time.time()
    base = load_base_model(ModelConfig(dtype="bf16", device="cpu"))
    feature_file = Path(config.data).with_suffix(".features.pt")
    if feature_file.exists():
        features = Features(**torch.load(feature_file, weights_only=True))
    else:
        features = extract_features(base, load_rows(Path(config.data)))
        torch.save(asdict(features), feature_file)
    feature_seconds = time.time() - started
    heads = train_heads(base, features, config)
    train_seconds = time.time() - started - feature_seconds
    out = REPO_ROOT / config.out if not Path(config.out).is_absolute() else Path(config.out)
    heads.save(out)
    base_fp32 = load_base_model(ModelConfig(dtype="fp32", device="cpu"))
    eval_rows = mt_bench_answers(base_fp32, config.eval_tokens, Path(config.data).parent / "mt_bench_answers.jsonl")
    accuracy = head_accuracy(base_fp32, heads, eval_rows)
    report = {
        "config": asdict(config),
        "train_positions": int(features.hidden.shape[0]),
        "train_answers_tokens": int(features.hidden.shape[0]),
        "feature_seconds": round(feature_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "eval": "base fp32 greedy answers to the 80 MT-Bench first turns, "
                f"{config.eval_tokens} new tokens, teacher-forced",
        "eval_positions": sum(len(r["answer_ids"]) for r in eval_rows),
        "draft_vocab": heads.config.draft_vocab_size,
        "draft_vocab_coverage": draft_coverage(heads, eval_rows),
        "topk_accuracy": accuracy,
        "top1": [a[0] for a in accuracy],
        "top5": [a[4] for a in accuracy],
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    trees_file = REPO_ROOT / "assets" / "trees.json"
    trees = json.loads(trees_file.read_text())
    trees["trees"]["calibrated"] = calibrated_choices(accuracy, 63)
    trees["calibrated_note"] = "calibrated: Medusa's greedy construction from the shipped heads' MT-Bench top-k accuracies"
    trees_file.write_text(json.dumps(trees) + "\n")
    print(json.dumps({k: report[k] for k in ("top1", "top5", "feature_seconds", "train_seconds")}, indent=2))


if __name__ == "__main__":
    main()
