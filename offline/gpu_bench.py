"""The exact engine's cost on a CUDA GPU: a plain step, the verify cost of 1-64 tree rows (CUDA
graphs and eager), the weight-read time, plain decoding's tokens per second beside transformers'
`generate`, and bitwise checks of tree rows against one-token steps, per precision.

    python -m offline.gpu_bench --out runs/gpu_bench.json

It times the shipped model where its package is installed, else a model of the shipped model's
exact shapes with random weights (`--shape-only`): the time of a step does not depend on the
weights' values. Needs a CUDA GPU and Triton.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from core.engine.gpu import GpuExactLlama
from core.engine.lean import LeanLlama
from core.machine import median_ms

VERIFY_ROWS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 256  # cached positions before each timed step
DECODE_TOKENS = 128


@dataclass
class ModeReport:
    """What one precision measured (ms are medians)."""

    mode: str
    weight_mb: float
    weight_read_ms: float  # the weights' bytes at the copy bandwidth this GPU measured
    plain_step_ms: float  # one token: forward + logits, CUDA graphs
    plain_step_eager_ms: float
    verify_ms: dict[int, float] = field(default_factory=dict)  # tree rows -> ms (graphs)
    verify_eager_ms: dict[int, float] = field(default_factory=dict)
    verify_ratio: dict[int, float] = field(default_factory=dict)  # verify_ms / plain_step_ms
    plain_tokens_per_s: float = 0.0  # the engine's greedy loop, one token a step
    generate_tokens_per_s: float = 0.0  # transformers' generate on the same weights (sdpa, bf16/fp32)
    rows_bitwise: bool = False  # a 64-node tree's rows equal their one-token steps


def shipped_shape_model(dtype: torch.dtype) -> torch.nn.Module:
    """The shipped SmolLM2-135M's architecture with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                  max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                  rope_theta=100000.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to("cuda").eval()


def load_model(mode: str, shape_only: bool) -> tuple[torch.nn.Module, str]:
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    if not shape_only:
        from core.model import ModelConfig, load_base_model
        from core.paths import gguf_location
        if gguf_location() is not None:
            base = load_base_model(ModelConfig(dtype=mode, device="cuda", engine="lean"))
            return base.model, base.source
    return shipped_shape_model(dtype), "SmolLM2-135M shapes, random weights"


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written per second), GB/s."""
    source = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), 20, source.device)
    return 2 * source.numel() / (ms / 1e3) / 1e9


def tree_mask(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bushy tree of `rows` nodes (node i's parent (i - 1) // 3) and its depths."""
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    depths = torch.zeros(rows, dtype=torch.long)
    for i in range(rows):
        mask[i, i] = True
        if i:
            parent = (i - 1) // 3
            mask[i] |= mask[parent]
            depths[i] = depths[parent] + 1
    return mask, depths


def time_verify(engine: GpuExactLlama, rows: int, repeats: int = 30) -> float:
    """Median ms of one verify of `rows` tree rows (forward + logits of every row) after CONTEXT positions."""
    cache = engine.new_cache()
    engine.forward(torch.randint(0, 1000, (CONTEXT,)), torch.arange(CONTEXT), cache)
    mask, depths = tree_mask(rows)
    tokens = torch.randint(0, 1000, (rows,))
    mask = mask if rows > 1 else None

    def verify() -> None:
        engine.project(engine.forward(tokens, CONTEXT + depths, cache, mask))
        cache.crop(CONTEXT)

    verify()
    return median_ms(verify, repeats, engine.device)


def rows_bitwise(engine: GpuExactLlama) -> bool:
    """A 64-node tree after CONTEXT positions: its deepest node's row against one-token steps."""
    prefix = torch.randint(0, 1000, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    mask, depths = tree_mask(64)
    tokens = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(1))
    cache = engine.new_cache()
    engine.forward(prefix, torch.arange(CONTEXT), cache)
    tree = engine.project(engine.forward(tokens, CONTEXT + depths, cache, mask))
    node = int(depths.argmax())
    path = mask[node].nonzero().flatten().tolist()
    cache.crop(CONTEXT)
    for step, index in enumerate(path):
        plain = engine.project(engine.forward(tokens[index:index + 1], torch.tensor([CONTEXT + step]), cache))
    return bool(torch.equal(tree[node], plain[0]))


def plain_rate(engine: GpuExactLlama) -> float:
    """Tokens per second of the engine's greedy loop (a step: forward, logits, argmax to the host)."""
    cache = engine.new_cache()
    token = engine.project(engine.forward(torch.arange(64), torch.arange(64), cache))[-1].argmax()
    start = time.perf_counter()
    for step in range(DECODE_TOKENS):
        logits = engine.project(engine.forward(token.view(1).cpu(), torch.tensor([64 + step]), cache))
        token = logits[0].argmax()
    torch.cuda.synchronize()
    return DECODE_TOKENS / (time.perf_counter() - start)


def generate_rate(model: torch.nn.Module) -> float:
    """Tokens per second of transformers' greedy `generate` (its own cache and kernels)."""
    ids = torch.arange(64, device="cuda")[None]
    kwargs = dict(max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    return DECODE_TOKENS / (time.perf_counter() - start)


def measure(mode: str, shape_only: bool, bandwidth: float) -> tuple[ModeReport, str]:
    model, source = load_model(mode, shape_only)
    engine = GpuExactLlama(LeanLlama(model), mode)
    report = ModeReport(mode=mode, weight_mb=round(engine.weight_bytes / 1e6, 1),
                        weight_read_ms=round(engine.weight_bytes / (bandwidth / 2 * 1e9) * 1e3, 4),
                        plain_step_ms=0.0, plain_step_eager_ms=0.0)
    for graphs in (True, False):
        engine.graphs_enabled = graphs
        times = {rows: round(time_verify(engine, rows), 3) for rows in VERIFY_ROWS}
        if graphs:
            report.verify_ms, report.plain_step_ms = times, times[1]
        else:
            report.verify_eager_ms, report.plain_step_eager_ms = times, times[1]
    report.verify_ratio = {rows: round(ms / report.plain_step_ms, 2) for rows, ms in report.verify_ms.items()}
    engine.graphs_enabled = True
    report.rows_bitwise = rows_bitwise(engine)
    report.plain_tokens_per_s = round(plain_rate(engine), 1)
    report.generate_tokens_per_s = round(generate_rate(model), 1)
    return report, source


def kernel_profile(mode: str, rows: int = 1, steps: int = 5) -> str:
    """The GPU time per kernel of `steps` eager forwards of `rows` tree rows (plus logits) after
    CONTEXT positions, by torch's profiler: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    model, _ = load_model(mode, shape_only=True)
    engine = GpuExactLlama(LeanLlama(model), mode, graphs=False)
    cache = engine.new_cache()
    engine.forward(torch.randint(0, 1000, (CONTEXT,)), torch.arange(CONTEXT), cache)
    mask, depths = tree_mask(rows)
    tokens = torch.randint(0, 1000, (rows,))

    def verify() -> None:
        engine.project(engine.forward(tokens, CONTEXT + depths, cache, mask if rows > 1 else None))
        cache.crop(CONTEXT)

    verify()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            verify()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu_bench.json")
    parser.add_argument("--modes", default="bf16,fp32")
    parser.add_argument("--shape-only", action="store_true", help="random weights of the shipped model's shapes")
    parser.add_argument("--profile", action="store_true", help="only print the GPU time per kernel of eager steps")
    args = parser.parse_args()
    if args.profile:
        for mode in args.modes.split(","):
            for rows in (1, 64):
                print(f"{mode}, {rows} rows, 5 eager steps:\n{kernel_profile(mode, rows)}", flush=True)
        return
    bandwidth = copy_bandwidth_gbs()
    reports, source = [], ""
    for mode in args.modes.split(","):
        report, source = measure(mode, args.shape_only, bandwidth)
        reports.append(report)
        print(json.dumps(asdict(report)), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": source,
              "copy_gbs": round(bandwidth, 1), "context": CONTEXT, "modes": [asdict(r) for r in reports]}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
