"""Training Medusa-1 heads on the frozen base model by self-distillation.

    python -m offline.train --data data/distill_chat.jsonl --out assets/heads

1. Features: the last hidden state at every answer position, plus the base model's own top-32
   next-token distribution there (the soft target). Captured by the generator while it wrote
   the answers (`offline.datagen`); for older data without them, one batched forward of the
   frozen base over prompt + answer (`--extract-missing`), cached to disk.
2. Heads: head k (1-based) at position t learns the base distribution for token t+k+1 (the
   distribution the base model has at position t+k): cross-entropy to the renormalised top-32
   teacher probabilities, loss weight 0.8^(k-1). The base lm_head is shared and frozen.
3. Evaluation: per-head top-1 / top-5 accuracy on the base model's fp32 greedy answers to the
   80 MT-Bench questions and to the 63 prompts of the second set (never trained on), written to
   `report.json` next to the weights.

Training is resumable: a checkpoint (weights, optimiser, step) is written every few hundred
steps under `data/checkpoints/` and picked up by a rerun with the same settings.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from offline.datagen import TEACHER_TOP, generate_batch, load_captured
from core.drafters.medusa import DEFAULT_HEADS_DIR, HeadsConfig, MedusaHeads, load_heads
from core.machine import cpu_name
from core.model import REPO_ROOT, BaseModel, ModelConfig, load_base_model
from core.precision import default_precision, fast_bf16_batched
from core.verify import VerifyOutput
from offline.ship_heads import write_calibrated_tree
from offline.simulate import head_proposals, sequence_states

MT_BENCH = REPO_ROOT / "assets" / "data" / "mt_bench.jsonl"
SECOND_SET = REPO_ROOT / "assets" / "data" / "spec_mix.jsonl"
RESULTS = REPO_ROOT / "assets" / "results"
CHECKPOINTS = REPO_ROOT / "data" / "checkpoints"
CHECKPOINT_EVERY = 200  # optimiser steps between checkpoints


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (all recorded in the report)."""

    data: str = "data/distill_chat.jsonl"  # comma-separated JSONL files of the generator
    out: str = "assets/heads"
    family: str = "medusa"  # medusa (python -m offline.train) | hydra (python -m offline.train_hydra)
    num_heads: int = 4
    num_layers: int = 1
    epochs: float = 1.0
    batch_size: int = 1024
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # gradients clipped to this norm (0: off); Hydra++ diverged without
    dropout: float = 0.0  # on the heads' inputs while training (Hydra++ used 0.2)
    noise: float = 0.0  # Gaussian noise on the heads' inputs while training, times their RMS (0: none)
    decay: float = 0.8
    max_positions: int = 0  # 0: all
    seed: int = 0
    eval_tokens: int = 128
    draft_vocab: int = 16384  # tokens the heads rank at decode time (0: all)
    depth_vocab: str = ""  # rows each head ranks, comma-separated (e.g. 16384,8192,4096,4096); "": all
    extract_missing: bool = False  # rows without captured features: one forward each (slow)
    prefix_layer: bool = False  # Hydra only: Hydra++'s prefix attention layer ...
    prefix_stretch: int = 0  # ... trained on batches of stretches of this many positions of an answer (0: whole answers)
    init: str = ""  # a heads folder to start from (its weights and draft vocabulary; same settings): "" starts fresh
    # the base model's precision for extracted features and the held-out scores ("": the page's on this
    # machine, core.precision.default_precision): the hidden states the heads will read when decoding
    precision: str = ""

    @property
    def depth_sizes(self) -> tuple[int, ...]:
        """`depth_vocab` as sizes (checked by the heads' config: `HeadsConfig.depth_vocab`)."""
        return tuple(int(n) for n in self.depth_vocab.split(",") if n.strip())

    @property
    def augment(self) -> Augment:
        """The training-time corruption of the heads' inputs these settings ask for."""
        return Augment(dropout=self.dropout, noise=self.noise)


@dataclass(frozen=True)
class Augment:
    """Training-time corruption of the heads' inputs (hidden states, and Hydra's path embeddings):
    Gaussian noise at `noise` x the inputs' RMS, then dropout `dropout`. Off at zero; never at decode time."""

    dropout: float = 0.0
    noise: float = 0.0

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.noise:
            inputs = inputs + torch.randn_like(inputs) * self.noise * inputs.pow(2).mean().sqrt()
        return F.dropout(inputs, self.dropout) if self.dropout else inputs


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


def _answer_features(answer_ids: list[int], hidden: torch.Tensor, teacher_ids: torch.Tensor,
                     teacher_probs: torch.Tensor) -> Features:
    count = len(answer_ids)
    return Features(hidden=hidden.to(torch.bfloat16), remaining=torch.arange(count - 1, -1, -1),
                    tokens=torch.tensor(answer_ids), teacher_ids=teacher_ids.int(),
                    teacher_probs=teacher_probs.half())


def features_fingerprint(features: Features) -> str:
    """A short hash of what every position must predict (a changed dataset changes it)."""
    digest = hashlib.sha1(features.tokens.numpy().tobytes())
    digest.update(features.remaining.numpy().tobytes())
    return digest.hexdigest()[:16]


def concat_features(parts: list[Features]) -> Features:
    """One Features of many answers, in order (an answer's positions stay contiguous)."""
    return Features(**{name: torch.cat([getattr(p, name) for p in parts]) for name in Features.__dataclass_fields__})


def padded_rows(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt + answer ids, right padded: ids and attention mask, [b, T] long each."""
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [b, T]
    mask = torch.zeros(len(seqs), width, dtype=torch.long)  # [b, T]
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    return ids, mask


@torch.inference_mode()
def extract_features(base: BaseModel, rows: list[dict], batch_size: int = 8, bf16: bool = False) -> Features:
    """The features of each prompt + answer. On the exact engine: its own forward, one row at a time
    (`sequence_states`: the numbers the drafters read on the page, in its precision); else one batched
    transformers forward (right padded), under CPU bf16 autocast when `bf16` (2-3x faster where bf16
    is fast; the hidden states are stored in bf16 anyway)."""
    if base.exact:
        return concat_features([_features_of(row, sequence_states(base, row["prompt_ids"] + row["answer_ids"]))
                                for row in tqdm(rows, desc=f"features ({base.engine.mode})")
                                if len(row["answer_ids"]) >= 2])
    fast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and base.device.type == "cpu")
    parts = []
    rows = sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))
    for start in tqdm(range(0, len(rows), batch_size), desc="features"):
        chunk = [r for r in rows[start:start + batch_size] if len(r["answer_ids"]) >= 2]
        if not chunk:
            continue
        ids, mask = padded_rows(chunk)  # [b, T] each
        with fast:
            states = base.model.model(input_ids=ids.to(base.device), attention_mask=mask.to(base.device)).last_hidden_state
        for i, row in enumerate(chunk):
            parts.append(_features_of(row, VerifyOutput(states[i], lambda h: base.lm_head(h.to(base.lm_head.weight.dtype)))))
    return concat_features(parts)


def _features_of(row: dict, states: VerifyOutput) -> Features:
    """One answer's features from the forward over its prompt + answer: the hidden state that
    predicts each answer token and the model's top next tokens there (full precision: the target)."""
    first, count = len(row["prompt_ids"]) - 1, len(row["answer_ids"])
    rows = list(range(first, first + count))  # hidden at t predicts answer[j]
    top = torch.topk(torch.softmax(states.logits(rows), dim=-1), TEACHER_TOP, dim=-1)  # [count, top]
    return _answer_features(row["answer_ids"], states.hidden[first:first + count].cpu(), top.indices.cpu(),
                            top.values.cpu())


@dataclass
class DataCard:
    """What the training data holds (aggregate figures only: the text is never committed)."""

    files: list[str]
    answers: int
    tokens: int
    captured: int  # answers whose features the generator captured
    extracted: int  # answers whose features were computed afterwards
    sources: dict[str, int]  # answers per source family


def load_training_features(base: BaseModel, paths: list[Path], extract_missing: bool) -> tuple[Features, DataCard]:
    """Features of every answer in `paths`: captured ones as they are, the others extracted
    (cached beside the file) when `extract_missing`, else skipped."""
    parts: list[Features] = []
    card = DataCard(files=[str(p) for p in paths], answers=0, tokens=0, captured=0, extracted=0, sources={})
    for path in paths:
        rows, found = load_captured(path)
        rows = [r for r in rows if len(r["answer_ids"]) >= 2]
        missing = [r for r in rows if r["id"] not in found]
        # features must cover their answer position for position; anything else is left out
        lengths = {row["id"]: len(row["answer_ids"]) for row in rows}
        found = {i: f for i, f in found.items() if len(f.hidden) == lengths.get(i, -1)}
        for row in rows:
            if row["id"] in found:
                f = found[row["id"]]
                parts.append(_answer_features(row["answer_ids"], f.hidden, f.teacher_ids, f.teacher_probs))
        used = [r for r in rows if r["id"] in found]
        card.captured += len(used)
        if missing and extract_missing:
            cache = path.with_suffix(f".extracted-{base.config.dtype}.pt")  # features differ by precision
            if cache.exists():
                extracted = Features(**torch.load(cache, weights_only=True))
            else:
                extracted = extract_features(base, missing, bf16=fast_bf16_batched())
                torch.save(asdict(extracted), cache)
            parts.append(extracted)
            used += missing
            card.extracted += len(missing)
        for row in used:
            family = row["source"].split("/")[0]
            card.sources[family] = card.sources.get(family, 0) + 1
    features = concat_features(parts)
    card.answers = card.captured + card.extracted
    card.tokens = int(features.hidden.shape[0])
    return features, card


@dataclass(frozen=True)
class TrainVocab:
    """The rows of the frozen lm_head the heads learn to rank (their draft vocabulary, or all)."""

    weight: torch.Tensor  # [V', H]
    index_of: torch.Tensor  # [V] long: each vocabulary id's row in `weight`, -1 if not drafted
    bf16: bool = False  # project under bf16 autocast (only where bf16 is fast: `core.precision.fast_bf16_batched`)

    def prefix(self, rows: int) -> "TrainVocab":
        """The first `rows` rows only (a deeper head's `depth_vocab`): tokens past them are not drafted."""
        if rows >= self.weight.shape[0]:
            return self
        index_of = torch.where(self.index_of < rows, self.index_of, torch.full_like(self.index_of, -1))
        return TrainVocab(weight=self.weight[:rows], index_of=index_of, bf16=self.bf16)


def depth_vocabs(vocab: TrainVocab, depth_vocab: tuple[int, ...], num_heads: int) -> list[TrainVocab]:
    """What each head (0-based list) ranks while training: its prefix of the draft vocabulary."""
    return [vocab.prefix(n) for n in depth_vocab] if depth_vocab else [vocab] * num_heads


def train_vocab(lm_head_weight: torch.Tensor, token_ids: torch.Tensor | None, bf16: bool = False) -> TrainVocab:
    """A TrainVocab over `token_ids` [V'] (None: the whole vocabulary)."""
    vocab_size = lm_head_weight.shape[0]
    weight = lm_head_weight.detach().float()
    if token_ids is None:
        return TrainVocab(weight=weight, index_of=torch.arange(vocab_size), bf16=bf16)
    index_of = torch.full((vocab_size,), -1, dtype=torch.long)
    index_of[token_ids] = torch.arange(len(token_ids))
    return TrainVocab(weight=weight[token_ids].contiguous(), index_of=index_of, bf16=bf16)


def draft_loss(states: torch.Tensor, vocab: TrainVocab, features: Features, target: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of `states` [b, H] against the teacher at positions `target` [b] (of any
    features with `teacher_ids`, `teacher_probs` and `tokens`: the heads' or the EAGLE layer's),
    over the draft vocabulary (a third of the lm_head rows: a third of the cost); teacher mass
    on undrafted tokens is dropped and renormalised, never mapped to another id. Returns the
    mean loss and, per row, whether the top-1 draft token is the model's own token there."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=vocab.bf16 and states.device.type == "cpu"):
        logits = F.linear(states, vocab.weight)  # [b, V']
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    teacher = vocab.index_of[features.teacher_ids[target].long()]  # [b, 32], -1: not drafted
    probs = features.teacher_probs[target].float() * (teacher >= 0)
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-9)  # [b, 32]
    loss = -(probs * log_probs.gather(1, teacher.clamp_min(0))).sum(dim=-1).mean()
    hits = logits.argmax(dim=-1) == vocab.index_of[features.tokens[target]]  # undrafted target: -1, a miss
    return loss, hits


def head_loss(heads: MedusaHeads, vocabs: list[TrainVocab], features: Features, index: torch.Tensor,
              decay: float, augment: Augment = Augment()) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy over heads for positions `index`, and per-head top-1 accuracy.

    Head k (0-based) at position j predicts answer[j+k+1], from the teacher at j+k+1, ranking
    `vocabs[k]` (`depth_vocabs`)."""
    hidden = augment(features.hidden[index].float())  # [B, H]
    states = heads.head_states(hidden)  # [K, B, H]
    total = hidden.new_zeros(())
    accuracy = []
    for k in range(states.shape[0]):
        valid = features.remaining[index] > k  # target j+k+1 exists  [B]
        if not bool(valid.any()):
            continue  # a batch of answer ends: nothing for this head (a mean over nothing is NaN)
        loss, hits = draft_loss(states[k][valid], vocabs[k], features, index[valid] + k + 1)
        total = total + decay ** k * loss
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


def fit(module: torch.nn.Module, batch_loss: Callable[[torch.Tensor], tuple[torch.Tensor, list[float]]],
        positions: int, config: TrainConfig, checkpoint: Path | None = None, data_fingerprint: str = "",
        order: torch.Tensor | None = None) -> torch.nn.Module:
    """AdamW with warm-up and cosine decay over shuffled positions (or `order`, e.g. whole answers
    in shuffled order); a progress bar shows loss and per-head top-1. With `checkpoint`, progress
    is saved every CHECKPOINT_EVERY steps and a run with the same settings resumes from it."""
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    used = positions if not config.max_positions else min(config.max_positions, positions)
    steps = max(1, int(config.epochs * used / config.batch_size))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    if order is None:
        order = torch.randperm(positions, generator=torch.Generator().manual_seed(config.seed))
    order = order[:used]
    first = 0
    # a checkpoint resumes only the same run: same settings, same data (positions and a
    # fingerprint of what each position must predict), same draft vocabulary
    fingerprint = {"positions": positions, "data": data_fingerprint,
                   "buffers": [b.sum().item() for b in module.buffers()]}
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        if saved["config"] == asdict(config) and saved.get("fingerprint") == fingerprint:
            module.load_state_dict(saved["module"])
            optimizer.load_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])
            first = saved["step"]
    bar = tqdm(range(first, steps), desc=f"training {config.family}", initial=first, total=steps)
    for step in bar:
        offset = (step * config.batch_size) % used
        loss, accuracy = batch_loss(order[offset:offset + config.batch_size])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # one batch is a few whole answers when a prefix layer trains: an outlier batch at the peak
        # learning rate sent a Hydra++ run from loss ~20 to 1,115 at step 300 without clipping
        norm = (torch.nn.utils.clip_grad_norm_(module.parameters(), config.max_grad_norm)
                if config.max_grad_norm > 0 else torch.zeros(()))
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", grad=f"{norm.item():.2f}",
                        top1="/".join(f"{a:.2f}" for a in accuracy))
        if checkpoint is not None and ((step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == steps):
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            partial = checkpoint.with_suffix(".partial")
            torch.save({"config": asdict(config), "fingerprint": fingerprint, "step": step + 1,
                        "module": module.state_dict(),
                        "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}, partial)
            partial.replace(checkpoint)
    return module


def start_heads(heads: torch.nn.Module, init: str, load: Callable[[Path], torch.nn.Module],
                fresh_vocab: torch.Tensor) -> None:
    """Where training starts: the trained heads in folder `init` (weights and draft vocabulary; a
    continued run on more data), else the zero-initialised `heads` with `fresh_vocab` (the data's
    most frequent tokens) as draft vocabulary. Raises ValueError when `init` holds other settings."""
    if not init:
        heads.draft_vocab.copy_(fresh_vocab)
        return
    trained = load(repo_path(init))
    if trained.config != heads.config:
        raise ValueError(f"--init {init}: its heads have other settings than this run's "
                         f"({trained.config} against {heads.config})")
    heads.load_state_dict(trained.state_dict())


def train_heads(base: BaseModel, features: Features, config: TrainConfig,
                checkpoint: Path | None = None) -> MedusaHeads:
    """Medusa heads trained on `features`. The heads' draft vocabulary (`config.draft_vocab` most
    frequent answer tokens) is what they rank at decode time and what the loss runs over."""
    vocab_size = base.model.config.vocab_size
    draft_size = min(config.draft_vocab, vocab_size)
    torch.manual_seed(config.seed)
    heads = MedusaHeads(HeadsConfig(num_heads=config.num_heads, num_layers=config.num_layers,
                                    hidden_size=base.model.config.hidden_size,
                                    vocab_size=vocab_size, draft_vocab_size=draft_size,
                                    depth_vocab=config.depth_sizes))
    start_heads(heads, config.init, load_heads, frequency_vocab(features.tokens, draft_size, vocab_size))
    vocab = train_vocab(base.lm_head.weight, heads.draft_vocab if draft_size else None, bf16=fast_bf16_batched())
    vocabs = depth_vocabs(vocab, heads.config.depth_vocab, config.num_heads)
    fit(heads, lambda index: head_loss(heads, vocabs, features, index, config.decay, config.augment),
        features.hidden.shape[0], config, checkpoint, features_fingerprint(features))
    return heads.eval().requires_grad_(False)


def eval_answers(base_fp32: BaseModel, questions: Path, max_new_tokens: int, cache: Path) -> list[dict]:
    """The base model's fp32 greedy answers to the first turn (or `prompt`) of every row of
    `questions` (cached in `cache`), batched by 8: the held-out evaluation text."""
    if cache.exists():
        return load_rows(cache)
    items = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    texts = [q["turns"][0] if "turns" in q else q["prompt"] for q in items]
    rows = []
    for start in tqdm(range(0, len(items), 8), desc=f"{questions.stem} answers (fp32)"):
        answers = generate_batch(base_fp32, texts[start:start + 8], max_new_tokens, sample=False)
        rows += [{"id": q.get("question_id", q.get("id")), "prompt_ids": base_fp32.chat_ids(text), "answer_ids": a}
                 for q, text, a in zip(items[start:start + 8], texts[start:start + 8], answers)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def held_out_sets(base_fp32: BaseModel, max_new_tokens: int) -> dict[str, list[dict]]:
    """The two evaluation sets' greedy answers (committed under assets/results)."""
    return {"mt_bench": eval_answers(base_fp32, MT_BENCH, max_new_tokens, RESULTS / "mt_bench_answers.jsonl"),
            "second_set": eval_answers(base_fp32, SECOND_SET, max_new_tokens, RESULTS / "spec_mix_answers.jsonl")}


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


def repo_path(path: str) -> Path:
    """A command-line path: as given when absolute, else under the repository root."""
    return Path(path) if Path(path).is_absolute() else REPO_ROOT / path


def _out_dir(config: TrainConfig) -> Path:
    return repo_path(config.out)


def _checkpoint(config: TrainConfig) -> Path:
    return CHECKPOINTS / f"{config.family}-{Path(config.out).name}.pt"


def parse_config(description: str, defaults: TrainConfig) -> TrainConfig:
    """A TrainConfig from the command line (every field is a flag)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in asdict(defaults).items():
        kind = (lambda text: text.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    return TrainConfig(**vars(parser.parse_args()))


def run_training(config: TrainConfig, train: Callable[[BaseModel, Features, TrainConfig, Path], torch.nn.Module],
                 evaluate: Callable[[BaseModel, torch.nn.Module, dict[str, list[dict]]], dict]) -> dict:
    """Features -> `train` -> save -> `evaluate` on the held-out sets -> report.json; returns the report."""
    random.seed(config.seed)
    times = {}
    started = time.time()
    base = load_base_model(ModelConfig(dtype=config.precision or default_precision(), device="cpu"))
    paths = [repo_path(p) for p in config.data.split(",")]
    features, card = load_training_features(base, paths, config.extract_missing)
    times["features_s"] = round(time.time() - started, 1)
    out = _out_dir(config)
    heads = train(base, features, config, _checkpoint(config))
    times["train_s"] = round(time.time() - started - times["features_s"], 1)
    heads.save(out)
    eval_started = time.time()
    sets = held_out_sets(base, config.eval_tokens)
    report = evaluate(base, heads, sets)
    times["eval_s"] = round(time.time() - eval_started, 1)
    report = {"config": asdict(config), "data": asdict(card), "times": times, "cpu": cpu_name(),
              "precision": base.config.dtype,
              "bf16_autocast": fast_bf16_batched(), **report}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("times", "held_out")}, indent=1))
    return report


def main() -> None:
    config = parse_config(__doc__, TrainConfig())
    report = run_training(config, train_heads, medusa_report)
    choices = calibrated_choices(report["held_out"]["mt_bench"]["topk_accuracy"], 63)
    (_out_dir(config) / "calibrated_tree.json").write_text(json.dumps(choices) + "\n")
    if _out_dir(config).resolve() == DEFAULT_HEADS_DIR.resolve():  # only shipped heads change the shipped tree
        write_calibrated_tree(choices)


def medusa_report(base: BaseModel, heads: MedusaHeads, sets: dict[str, list[dict]]) -> dict:
    """Per-head top-k accuracy on each held-out set (teacher-forced)."""
    held_out = {}
    for name, rows in sets.items():
        accuracy = head_accuracy(base, heads, rows)
        held_out[name] = {"positions": sum(len(r["answer_ids"]) for r in rows),
                          "draft_vocab_coverage": draft_coverage(heads, rows), "topk_accuracy": accuracy,
                          "top1": [a[0] for a in accuracy], "top5": [a[4] for a in accuracy]}
    return {"family": "medusa", "eval": "base fp32 greedy answers (128 new tokens), teacher-forced on the "
                                        f"{base.config.dtype} forward's hidden states",
            "draft_vocab": heads.config.draft_vocab_size, "held_out": held_out}


if __name__ == "__main__":
    main()
