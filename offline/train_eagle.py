"""Training the EAGLE-style draft layer with training-time test.

    python -m offline.eagle_features          # once: the three states per answer position (data/eagle/)
    python -m offline.train_eagle --out assets/eagle --num-heads 3   # num-heads: the training-time-test steps
    python -m offline.train_eagle --init assets/eagle --epochs 1   # continue the shipped layer on more data

Batches are whole answers (the layer attends over the answer so far). Step 1 reads the base
model's fused features and predicts the token after next; steps 2..`ttt_steps` read the layer's
own previous output (what drafting deeper feeds it), each against the teacher's top-32 there over
the draft vocabulary, weighted decay^(step-1). Resumable (checkpoints in data/checkpoints).

Evaluation on the held-out answers (MT-Bench, the second set), per depth: top-1 / top-5 with the
true tokens on the path ("given the path") and with its own greedy guesses ("fed its own guesses");
either way every state after depth 1 is the layer's own, as when drafting. Held-out accuracy
decides what ships, never training loss.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from core.drafters.eagle import (EAGLE_BEAM, EAGLE_DEPTH, EagleConfig, EagleLayer, eagle_taps,
                                 grow_eagle_tree, init_from_base, load_eagle)
from core.drafters.grown import GrownTree, accepted_depth, cut_grown
from core.drafters.layers import KVRows
from core.families import EAGLE
from core.strategy import StrategySpec
from core.drafters.medusa import DraftProjection
from core.machine import cpu_name
from core.model import BaseModel, ModelConfig, load_base_model
from offline.eagle_features import FusedFeatures, extract, load_features
from offline.train import (CHECKPOINTS, TrainConfig, TrainVocab, draft_loss, fit, frequency_vocab, held_out_sets, parse_config,
                           repo_path, start_heads, train_vocab)

DEFAULTS = TrainConfig(data="assets/distill/distill.jsonl.gz,assets/distill/distill_clean.jsonl.gz",
                       out="assets/eagle", family="eagle", batch_size=16, lr=1e-3, decay=0.8, draft_vocab=8192,
                       num_heads=3)  # num_heads: the training-time-test steps (the depths trained)
TOP = 5
BUDGETS = (16, 32, 64)  # tree sizes the simulation reports
WIDTH = 32  # children of the root (the decoder's default top_m)
LOSS_SHARE = 0.5  # rows of a step that the loss reads (module docstring)


def answer_batch(features: FusedFeatures, starts: torch.Tensor, lengths: torch.Tensor, answers: torch.Tensor,
                 extra: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Answers `answers` padded: features [B, T, 3H] fp32, global row index [B, T + extra] (clamped
    into each answer; masked by the lengths), lengths [B]."""
    lens = lengths[answers]  # [B]
    width = int(lens.max())
    offsets = torch.arange(width + extra)  # [T + extra]
    rows = starts[answers][:, None] + torch.minimum(offsets[None], (lens - 1)[:, None])  # [B, T + extra]
    low, mid, high = (part[rows[:, :width]].float() for part in (features.low, features.mid, features.high))
    return torch.cat([low, mid, high], dim=-1), rows, lens


def ttt_loss(layer: EagleLayer, embed: torch.Tensor, vocab: TrainVocab, features: FusedFeatures,
             starts: torch.Tensor, lengths: torch.Tensor, answers: torch.Tensor, steps: int, decay: float
             ) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss of every step over a batch of answers, and per-step top-1."""
    fused, rows, lens = answer_batch(features, starts, lengths, answers, steps)
    width = fused.shape[1]
    embeds = embed[features.tokens[rows]]  # [B, T + steps, H]: answer[t] at t
    outputs = layer.ttt_states(fused, lens, steps, lambda step, _: embeds[:, step - 1:step - 1 + width])
    total, accuracy = fused.new_zeros(()), []
    offsets = torch.arange(width)
    for step, states in enumerate(outputs, start=1):
        valid = offsets[None] + step < lens[:, None]  # [B, T]: answer[t + step] exists
        if not bool(valid.any()):
            break
        # the projection onto the draft vocabulary is most of the cost: a random half of the rows
        # judges each step (an unbiased estimate of the full loss, half the work)
        valid = valid & (torch.rand(valid.shape) < LOSS_SHARE)
        target = rows[:, step:step + width][valid]  # [b] the row of answer[t + step]
        loss, hits = draft_loss(layer.draft_states(states[valid]), vocab, features, target)
        total = total + decay ** (step - 1) * loss
        accuracy.append(float(hits.float().mean()))
    return total, accuracy


def length_batches(lengths: torch.Tensor, batch: int, seed: int) -> torch.Tensor:
    """Answer indices in batches of similar length (less padding), the batches in random order."""
    order = torch.argsort(lengths, stable=True)
    chunks = list(order.split(batch))
    random.Random(seed).shuffle(chunks)
    return torch.cat(chunks)


def train_eagle(base: BaseModel, features: FusedFeatures, config: TrainConfig, checkpoint: Path | None = None
                ) -> EagleLayer:
    """A draft layer trained on `features` (module docstring)."""
    model_config = base.model.config
    torch.manual_seed(config.seed)
    vocab_size = model_config.vocab_size
    layer = EagleLayer(EagleConfig(
        hidden_size=model_config.hidden_size, num_heads=model_config.num_attention_heads,
        kv_heads=model_config.num_key_value_heads, head_dim=model_config.hidden_size // model_config.num_attention_heads,
        intermediate=model_config.intermediate_size, vocab_size=vocab_size,
        draft_vocab_size=min(config.draft_vocab, vocab_size), taps=eagle_taps(model_config.num_hidden_layers),
        rope_theta=float(model_config.rope_parameters["rope_theta"]), eps=float(model_config.rms_norm_eps)))
    init_from_base(layer, base.model)
    start_heads(layer, config.init, load_eagle, frequency_vocab(features.tokens, layer.config.draft_vocab_size, vocab_size))
    vocab = train_vocab(base.lm_head.weight, layer.draft_vocab)
    embed = base.model.get_input_embeddings().weight.detach().float()
    starts = features.starts
    lengths = features.remaining[starts] + 1  # [A]
    fingerprint = str(int(features.tokens.sum())) + f"-{len(features.tokens)}"
    fit(layer, lambda answers: ttt_loss(layer, embed, vocab, features, starts, lengths, answers,
                                        config.num_heads, config.decay),
        len(starts), config, checkpoint, fingerprint, order=length_batches(lengths, config.batch_size, config.seed))
    return layer.eval().requires_grad_(False)


@torch.inference_mode()
def depth_accuracy(layer: EagleLayer, base: BaseModel, features: FusedFeatures, depths: int,
                   own_guesses: bool) -> dict[str, list[float]]:
    """Top-1 / top-5 by depth over every answer of `features` (module docstring)."""
    embed = base.model.get_input_embeddings().weight.float()
    projection = layer.draft_projection(base.lm_head)
    starts = features.starts
    lengths = features.remaining[starts] + 1
    hits = torch.zeros(depths, TOP)
    counts = torch.zeros(depths)
    for answer in range(len(starts)):
        fused, rows, lens = answer_batch(features, starts, lengths, torch.tensor([answer]), depths)
        width = fused.shape[1]
        tokens = features.tokens[rows]  # [1, T + depths]
        guesses = _states_fed(layer, fused, embed, tokens, lens, depths, projection, own_guesses)
        for depth, top in enumerate(guesses, start=1):
            valid = width - depth  # positions with a target answer[t + depth]
            if valid <= 0:
                break
            target = tokens[0, depth:depth + valid]  # [valid]
            match = top[0, :valid] == target[:, None]  # [valid, TOP]
            hits[depth - 1] += match.cumsum(dim=1).clamp(max=1).sum(dim=0).float()
            counts[depth - 1] += valid
    accuracy = hits / counts.clamp_min(1)[:, None]  # [depths, TOP]
    return {"top1": accuracy[:, 0].tolist(), "top5": accuracy[:, TOP - 1].tolist()}


def _states_fed(layer: EagleLayer, fused: torch.Tensor, embed: torch.Tensor, tokens: torch.Tensor,
                lens: torch.Tensor, depths: int, projection: DraftProjection, own_guesses: bool) -> list[torch.Tensor]:
    """Each depth's top-5 vocabulary ids [1, T, 5]; the path's tokens are the true ones, or (own
    guesses) from depth 2 on the layer's own top-1 at the depth before, at the same row."""
    width = fused.shape[1]
    embeds = embed[tokens]  # [1, T + depths, H]

    def top_ids(states: torch.Tensor) -> torch.Tensor:
        logits = projection.rows_logits(layer.draft_states(states), projection.weight.shape[0])
        return projection.vocabulary_ids(logits.topk(TOP, dim=-1).indices)  # [1, T, 5]

    def read_tokens(step: int, previous: torch.Tensor | None) -> torch.Tensor:
        if step == 1 or not own_guesses:
            return embeds[:, step - 1:step - 1 + width]
        return embed[top_ids(previous)[..., 0]]

    return [top_ids(states) for states in layer.ttt_states(fused, lens, depths, read_tokens)]


@torch.inference_mode()
def eagle_tokens_per_step(layer: EagleLayer, base: BaseModel, features: FusedFeatures,
                          budgets: tuple[int, ...] = BUDGETS) -> dict[str, float]:
    """Exact greedy simulation of the grown tree at each budget over the held-out answers (the base
    model's own greedy text, so a node is accepted exactly when it is the answer's next token):
    steps walk each answer, a step accepting its matched depth plus the bonus token."""
    embed = base.model.get_input_embeddings()
    projection = layer.draft_projection(base.lm_head)
    fused_all = torch.cat([features.low, features.mid, features.high], dim=-1).float()  # [N, 3H]
    totals = {b: [0, 0] for b in budgets}
    starts = features.starts.tolist()
    ends = starts[1:] + [len(features.tokens)]
    for start, end in tqdm(list(zip(starts, ends)), desc="EAGLE simulate"):
        answer = features.tokens[start:end].tolist()
        outputs, cache = layer.extend(None, fused_all[start:end], embed(features.tokens[start:end]))  # [L, H]
        grown_at: dict[int, GrownTree] = {}
        for budget in budgets:
            i, steps, emitted = 0, 0, 0
            while i < len(answer) - 1:
                if i not in grown_at:  # the cache as decoding holds it at answer position i
                    at_i = KVRows(keys=cache.keys[:, :i + 1], values=cache.values[:, :i + 1])
                    grown_at[i] = grow_eagle_tree(layer, embed, projection, at_i, outputs[i], budget=max(budgets),
                                                  width=WIDTH, beam=EAGLE_BEAM, depth=EAGLE_DEPTH)
                accepted = accepted_depth(cut_grown(grown_at[i], budget), answer, i)
                step = min(accepted + 1, len(answer) - 1 - i)
                steps, emitted, i = steps + 1, emitted + step, i + step
            totals[budget][0] += steps
            totals[budget][1] += emitted
    return {StrategySpec(family=EAGLE, budget=b).text: e / s for b, (s, e) in totals.items() if s}


def eagle_report(base: BaseModel, layer: EagleLayer, sets: dict[str, list[dict]], depths: int = 4) -> dict:
    """Held-out top-1 / top-5 by depth, given the path and fed its own guesses; tokens per step."""
    held_out = {}
    for name, rows in sets.items():
        rows = [r for r in rows if len(r["answer_ids"]) >= 2]
        features = extract(base, rows)
        held_out[name] = {"positions": int(features.tokens.shape[0]),
                          "given_path": depth_accuracy(layer, base, features, depths, own_guesses=False),
                          "own_guesses": depth_accuracy(layer, base, features, depths, own_guesses=True),
                          "tokens_per_step": eagle_tokens_per_step(layer, base, features)}
    return {"family": "eagle", "eval": "base fp32 greedy answers (128 new tokens); every state after depth 1 the layer's own",
            "draft_vocab": layer.config.draft_vocab_size, "held_out": held_out}


def main() -> None:
    config = parse_config(__doc__, DEFAULTS)
    random.seed(config.seed)
    started = time.time()
    base = load_base_model(ModelConfig(dtype="fp32", device="cpu", engine="hf"))
    features = load_features([repo_path(p) for p in config.data.split(",")])
    if config.max_positions:
        features = _first_positions(features, config.max_positions)
    times = {"features_s": round(time.time() - started, 1)}
    layer = train_eagle(base, features, config, CHECKPOINTS / f"eagle-{Path(config.out).name}.pt")
    times["train_s"] = round(time.time() - started - times["features_s"], 1)
    out = repo_path(config.out)
    layer.save(out)
    evaluated = time.time()
    report = eagle_report(base, layer, held_out_sets(base, config.eval_tokens))
    times["eval_s"] = round(time.time() - evaluated, 1)
    report = {"config": asdict(config), "answers": int(len(features.starts)), "tokens": int(features.tokens.shape[0]),
              "times": times, "cpu": cpu_name(), **report}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["held_out"], indent=1))


def _first_positions(features: FusedFeatures, positions: int) -> FusedFeatures:
    """The whole answers within the first `positions` rows."""
    ends = torch.nonzero(features.remaining == 0).flatten()
    cut = int(ends[ends < positions].max()) + 1 if bool((ends < positions).any()) else int(ends[0]) + 1
    return FusedFeatures(**{name: getattr(features, name)[:cut] for name in FusedFeatures.__dataclass_fields__})


if __name__ == "__main__":
    main()
