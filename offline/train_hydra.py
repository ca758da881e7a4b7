"""Training Hydra heads on the same self-distillation features as the Medusa heads.

    python -m offline.train_hydra --data data/distill_chat.jsonl --out assets/hydra

Head k (1-based) at answer position j reads the hidden state that predicted answer[j] (the
step's root) and the embeddings of answer[j..j+k-1] (teacher-forced: the model's own greedy
tokens are the path), and learns the base model's distribution for answer[j+k] over the
draft vocabulary (the loss of `offline.train.draft_loss`), weight decay^(k-1).

Evaluation on the held-out answers, per depth: top-k given the true path (what counts on an
accepted path), top-1 fed the heads' own greedy guesses, and tokens per step of the grown tree
at several budgets beside the Medusa heads' dynamic tree on the same answers.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from core.drafters.medusa import MedusaHeads, default_heads
from core.drafters.grown import GrownTree, accepted_depth, cut_grown
from core.drafters.hydra import HYDRA_BEAM, HydraConfig, HydraHeads, grow_tree, load_hydra_heads
from core.model import BaseModel
from core.precision import fast_bf16_batched
from core.strategy import DYNAMIC, HYDRA, StrategySpec
from offline.simulate import parse_tree_spec, simulate
from offline.train import (Augment, Features, TrainConfig, TrainVocab, depth_vocabs, draft_coverage, draft_loss,
                           features_fingerprint, fit, frequency_vocab, parse_config, run_training, start_heads,
                           train_vocab)

BUDGETS = (16, 32, 64)
BEAM = HYDRA_BEAM  # as the decoder grows its trees by default
WIDTH = 32  # the decoder's default top_m: children of the root


def hydra_loss(heads: HydraHeads, vocabs: list[TrainVocab], embed_weight: torch.Tensor, features: Features, index: torch.Tensor,
               decay: float, augment: Augment = Augment()) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy of every head at positions `index`, and per-head top-1; `augment`
    corrupts the hidden states and the path embeddings (Hydra++'s noise on the path)."""
    hidden = augment(features.hidden[index].float())  # [B, H]
    if heads.prefix is not None:
        hidden = prefix_states(heads, hidden, index, features, augment)  # [B, H]
    total = hidden.new_zeros(())
    accuracy = []
    for k in range(1, heads.config.num_heads + 1):
        valid = features.remaining[index] >= k  # answer[j+k] exists  [B]
        if not bool(valid.any()):
            continue  # a batch of answer ends: nothing for this head
        rows = index[valid]  # [b]
        path = features.tokens[rows[:, None] + torch.arange(k)]  # [b, k]: answer[j..j+k-1]
        states = heads.head_state(k, hidden[valid], augment(embed_weight[path]))  # [b, H]
        loss, hits = draft_loss(states, vocabs[k - 1], features, rows + k)
        total = total + decay ** (k - 1) * loss
        accuracy.append(float(hits.float().mean()))
    return total, accuracy


def prefix_states(heads: HydraHeads, hidden: torch.Tensor, index: torch.Tensor, features: Features,
                  augment: Augment = Augment()) -> torch.Tensor:
    """The prefix layer's output at each position of a batch (hidden [B, H] at `index`), run
    causally over each stretch of consecutive positions of one answer, as decoding sees it: a
    stretch that starts inside its answer (`answer_order` cuts answers into stretches, and a batch
    boundary cuts one too) gets the answer's earlier positions as context, without outputs."""
    remaining = features.remaining
    breaks = (index[1:] != index[:-1] + 1) | (remaining[index[:-1]] == 0)  # [B-1]: a new stretch at t+1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(breaks).flatten() + 1])  # [R]
    lengths = torch.diff(torch.cat([starts, torch.tensor([len(index)])])).tolist()  # R stretch lengths
    pieces, contexts = [], []
    for stretch, first in zip(hidden.split(lengths), index[starts].tolist()):
        begin = first
        while begin > 0 and remaining[begin - 1] != 0:  # back to the answer's first position
            begin -= 1
        context = augment(features.hidden[begin:first].float())  # [c, H]
        pieces.append(torch.cat([context, stretch]))  # [c + n, H]
        contexts.append(first - begin)
    full = torch.tensor([len(piece) for piece in pieces], device=hidden.device)  # [R]
    out = heads.context_states(nn.utils.rnn.pad_sequence(pieces, batch_first=True), full)  # [R, T, H]
    return torch.cat([row[skip:skip + n] for row, skip, n in zip(out, contexts, lengths)])  # [B, H]


def answer_order(remaining: torch.Tensor, seed: int, stretch: int = 0) -> torch.Tensor:
    """Every position, in stretches of `stretch` consecutive positions of one answer (0: whole
    answers), the stretches in a shuffled order. Short stretches mix many answers into a batch
    (whole-answer batches hold 4-5 answers and cost ~.03 top-1 at every depth);
    `prefix_states` gives each stretch its answer's earlier positions as context."""
    ends = torch.nonzero(remaining == 0).flatten() + 1  # [A] one past each answer's last position
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1]])  # [A]
    pieces = [torch.arange(start, end) for start, end in zip(starts.tolist(), ends.tolist())]
    if stretch > 0:
        pieces = [piece for answer in pieces for piece in answer.split(stretch)]
    shuffled = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(seed))  # [P]
    return torch.cat([pieces[p] for p in shuffled.tolist()])


def train_hydra(base: BaseModel, features: Features, config: TrainConfig,
                checkpoint: Path | None = None) -> HydraHeads:
    """Hydra heads trained on `features` (draft vocabulary: the most frequent answer tokens)."""
    vocab_size = base.model.config.vocab_size
    draft_size = min(config.draft_vocab, vocab_size)
    torch.manual_seed(config.seed)
    model_config = base.model.config
    heads = HydraHeads(HydraConfig(num_heads=config.num_heads, num_layers=config.num_layers,
                                   hidden_size=model_config.hidden_size, vocab_size=vocab_size,
                                   draft_vocab_size=draft_size, depth_vocab=config.depth_sizes,
                                   prefix_layer=config.prefix_layer, prefix_heads=model_config.num_attention_heads,
                                   prefix_mlp=model_config.intermediate_size))
    start_heads(heads, config.init, load_hydra_heads, frequency_vocab(features.tokens, draft_size, vocab_size))
    vocab = train_vocab(base.lm_head.weight, heads.draft_vocab if draft_size else None, bf16=fast_bf16_batched())
    vocabs = depth_vocabs(vocab, heads.config.depth_vocab, config.num_heads)
    embed_weight = base.model.get_input_embeddings().weight.detach().float()  # [V, H]
    # the prefix layer reads an answer's positions in order: batches of stretches of answers
    order = answer_order(features.remaining, config.seed, config.prefix_stretch) if config.prefix_layer else None
    fit(heads, lambda index: hydra_loss(heads, vocabs, embed_weight, features, index, config.decay, config.augment),
        features.hidden.shape[0], config, checkpoint, features_fingerprint(features), order=order)
    return heads.eval().requires_grad_(False)


@torch.inference_mode()
def _answer_states(base: BaseModel, heads: HydraHeads, row: dict) -> torch.Tensor:
    """[L, H] what the heads read at answer position j, for every j: the hidden state that
    predicts answer[j] (one teacher-forced forward), through the prefix layer if the heads have one."""
    seq = torch.tensor([row["prompt_ids"] + row["answer_ids"]], device=base.device)
    hidden = base.model.model(input_ids=seq).last_hidden_state[0]  # [P+L, H]
    first = len(row["prompt_ids"]) - 1
    return heads.context_states(hidden[first:first + len(row["answer_ids"])].to(next(heads.parameters()).dtype))


@torch.inference_mode()
def hydra_accuracy(base: BaseModel, heads: HydraHeads, rows: list[dict], top: int = 10
                   ) -> tuple[list[list[float]], list[float]]:
    """(acc[k][r]: head k+1's target within its top-(r+1) given the true path; own[k]: head k+1's
    top-1 right when fed the heads' own greedy guesses as the path)."""
    embed = base.model.get_input_embeddings()
    projection = heads.draft_projection(base.lm_head)
    depth = heads.config.num_heads
    hits, own_hits, counts = torch.zeros(depth, top), torch.zeros(depth), torch.zeros(depth)
    for row in rows:
        answer = torch.tensor(row["answer_ids"])  # [L]
        hidden = _answer_states(base, heads, row)  # [L, H]
        own_path = answer[:, None]  # [L, 1] the root
        for k in range(1, depth + 1):
            valid = len(answer) - k  # positions j with a target answer[j+k]
            if valid <= 0:
                break
            true_path = torch.stack([answer[i:i + valid] for i in range(k)], dim=-1)  # [valid, k]
            target = answer[k:k + valid]  # [valid]
            ranked = _top_ids(heads, k, hidden[:valid], embed(true_path), projection, top)  # [valid, top]
            hits[k - 1] += (ranked == target[:, None]).cumsum(1).clamp(max=1).sum(0).float()
            guesses = _top_ids(heads, k, hidden, embed(own_path), projection, 1)[:, 0]  # [L]
            own_hits[k - 1] += (guesses[:valid] == target).sum()
            counts[k - 1] += valid
            own_path = torch.cat([own_path, guesses[:, None]], dim=-1)  # [L, k+1]
    return (hits / counts.clamp_min(1)[:, None]).tolist(), (own_hits / counts.clamp_min(1)).tolist()


def _top_ids(heads: HydraHeads, depth: int, hidden: torch.Tensor, path_embeds: torch.Tensor, projection, top: int
             ) -> torch.Tensor:
    states = heads.head_state(depth, hidden.to(path_embeds.dtype), path_embeds)  # [n, H]
    return projection.vocabulary_ids(torch.topk(projection.logits(states, depth), top, dim=-1).indices)  # [n, top]


@torch.inference_mode()
def hydra_tokens_per_step(base: BaseModel, heads: HydraHeads, rows: list[dict], budgets=BUDGETS,
                          beam: int = BEAM, width: int = WIDTH) -> dict[str, float]:
    """Exact greedy simulation (as `offline.simulate`) of the grown tree at each budget: mean tokens per step."""
    embed = base.model.get_input_embeddings()
    projection = heads.draft_projection(base.lm_head)
    totals = {b: [0, 0] for b in budgets}
    for row in tqdm(rows, desc="hydra simulate"):
        answer = row["answer_ids"]
        hidden = _answer_states(base, heads, row)  # [L, H]
        grown_at: dict[int, GrownTree] = {}
        for budget in budgets:
            i, steps, emitted = 0, 0, 0
            while i < len(answer) - 1:
                if i not in grown_at:
                    grown_at[i] = grow_tree(heads, embed, projection, hidden[i], answer[i], budget=max(budgets),
                                            width=width, beam=beam, depth=heads.config.num_heads)
                grown = grown_at[i]
                accepted = accepted_depth(cut_grown(grown, budget), answer, i)
                step = min(accepted + 1, len(answer) - 1 - i)
                steps, emitted, i = steps + 1, emitted + step, i + step
            totals[budget][0] += steps
            totals[budget][1] += emitted
    return {StrategySpec(family=HYDRA, budget=b).text: e / s for b, (s, e) in totals.items() if s}


def hydra_report(base: BaseModel, heads: nn.Module, sets: dict[str, list[dict]]) -> dict:
    """Accuracy per depth (true path and own guesses) and tokens per step, beside the shipped
    Medusa heads' dynamic tree on the same answers."""
    medusa, _ = default_heads(base.model.config.hidden_size, base.model.config.vocab_size)
    held_out = {}
    for name, rows in sets.items():
        accuracy, own = hydra_accuracy(base, heads, rows)
        tokens = hydra_tokens_per_step(base, heads, rows)
        tokens.update(_medusa_tokens(base, medusa, rows))
        held_out[name] = {"positions": sum(len(r["answer_ids"]) for r in rows),
                          "draft_vocab_coverage": draft_coverage(heads, rows), "topk_accuracy": accuracy,
                          "top1": [a[0] for a in accuracy], "top5": [a[4] for a in accuracy],
                          "top1_own_guesses": own, "tokens_per_step": tokens}
    return {"family": "hydra", "eval": "base fp32 greedy answers (128 new tokens), teacher-forced; "
            f"tree grown with beam {BEAM}: {WIDTH} children of the root, {BEAM} of each deeper node", "draft_vocab": heads.config.draft_vocab_size,
            "held_out": held_out}


def _medusa_tokens(base: BaseModel, medusa: MedusaHeads, rows: list[dict]) -> dict[str, float]:
    specs = [parse_tree_spec(StrategySpec(family=DYNAMIC, budget=b).text) for b in BUDGETS]
    return simulate(base, medusa, rows, specs)


def main() -> None:
    config = parse_config(__doc__, TrainConfig(out="assets/hydra", family="hydra"))
    run_training(config, train_hydra, hydra_report)


if __name__ == "__main__":
    main()
