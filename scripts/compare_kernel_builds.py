"""Two versions of the exact kernels' source, side by side: bitwise the same products, and how long.

Builds each source (under /tmp/kernel_builds/<name>, the flags of core.engine.build), asserts that
every weight format gives bitwise the same product from both for every row count, and prints the
ms of the shipped model's 30 layers of products (random weights, median of 5) per format and row
count, old/new (the gguf-q8 formats, Q4_1 / Q8_0 blocks times 8-bit inputs, where both builds have
them); with --no-check the times alone, for a change meant to change the numbers (check those
against tests/test_exact.py's references instead); with --forward, the same for the shipped model's
whole forward and logits (gguf-q8, gguf and fp32; 1, 16 and 64 new rows under a random tree mask over
a 150-token cache). Run it alone (it times):

    git show HEAD:core/engine/kernels/exact.cpp > /tmp/old.cpp
    PYTHONPATH=. .venv/bin/python scripts/compare_kernel_builds.py /tmp/old.cpp core/engine/kernels/exact.cpp \
        [--rows 1,2,4,8,16,32,64] [--forward [--contexts 150,1400] [--modes gguf-q8] [--counts 1,2,16]]
        [--no-check]

(`--rows ''` skips the products.) The forward's first call over each context is the prefill, timed once.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import ModuleType

import torch

from core.engine.build import CFLAGS, LDFLAGS
from core.engine.exact import BF16, F32, Q4_1, Q8_0, random_weight
from core.engine.lean import median_ms
from core.model import ModelConfig, load_base_model
from core.paths import gguf_location
from core.precision import PLAIN_STEP_SHAPES

LAYERS = 30  # the shipped model's
# name -> (weight format, 8-bit inputs: mode gguf-q8)
FORMATS = {"fp32": (F32, False), "bf16": (BF16, False), "q4_1": (Q4_1, False), "q8_0": (Q8_0, False),
           "q4_1+q8": (Q4_1, True), "q8_0+q8": (Q8_0, True)}


def build(source: Path, name: str) -> ModuleType:
    from torch.utils import cpp_extension
    folder = Path("/tmp/kernel_builds") / name
    folder.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(CFLAGS),
                              extra_ldflags=list(LDFLAGS), build_directory=str(folder), verbose=False)


def compare(modules: list[ModuleType], rows: list[int], check: bool = True) -> None:
    generator = torch.Generator().manual_seed(0)
    for name, (fmt, int8) in FORMATS.items():
        try:
            weights = [[random_weight(module, fmt, out, width, torch.Generator().manual_seed(k), int8_activations=int8)
                        for k, (out, width) in enumerate(PLAIN_STEP_SHAPES * LAYERS)] for module in modules]
        except TypeError:  # a build from before gguf-q8
            print(f"{name:7} (not in both builds)")
            continue
        cells = []
        for count in rows:
            inputs = {width: torch.randn(count, width, generator=generator) for _, width in PLAIN_STEP_SHAPES}
            for old, new in zip(weights[0][:len(PLAIN_STEP_SHAPES)], weights[-1][:len(PLAIN_STEP_SHAPES)]):
                x = inputs[old.in_features]
                assert not check or torch.equal(modules[0].matmul(x, old), modules[-1].matmul(x, new)), (name, count)
            times = [median_ms(lambda: [module.matmul(inputs[w.in_features], w) for w in layer_weights], 5)
                     for module, layer_weights in zip(modules, weights)]
            cells.append(f"{count}: " + " / ".join(f"{ms:.1f}" for ms in times))
        print(f"{name:7} " + "   ".join(cells), flush=True)


def interleaved_ms(calls: list, rounds: int = 7) -> list[float]:
    """Each call's median ms over `rounds` rounds of a median of 3, the calls taking turns within each
    round (so a drift of the machine's speed falls on every call alike)."""
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, sample in zip(calls, samples):
            sample.append(median_ms(call, 3))
    return [sorted(sample)[len(sample) // 2] for sample in samples]


def compare_forwards(modules: list[ModuleType], context: int = 150, check: bool = True,
                     modes: tuple[str, ...] = ("gguf-q8", "gguf", "fp32"), counts: tuple[int, ...] = (1, 16, 64)) -> None:
    from core.engine.exact import GGUF_MODES, ExactLlama
    location = gguf_location()
    for mode in modes:
        base = load_base_model(ModelConfig(dtype=mode))
        gguf = location[0] / location[1] if mode in GGUF_MODES and location else None
        engines = [ExactLlama(base.engine.lean, module, mode, gguf) for module in modules]
        caches = [engine.new_cache(capacity=context + max(counts)) for engine in engines]
        prompt = torch.arange(1000, 1000 + context) % 40000
        prefills, prefill_ms = [], []
        for engine, cache in zip(engines, caches):
            started = time.perf_counter()
            prefills.append(engine.forward(prompt, torch.arange(context), cache))
            prefill_ms.append(1000 * (time.perf_counter() - started))
        assert not check or torch.equal(prefills[0], prefills[1]), (mode, "prefill")
        cells = [f"prefill {prefill_ms[0]:.0f} / {prefill_ms[1]:.0f}"]
        for count in counts:
            generator = torch.Generator().manual_seed(count)
            mask = torch.ones(count, count, dtype=torch.bool).tril_() & (torch.rand(count, count, generator=generator) < .7)
            mask |= torch.eye(count, dtype=torch.bool)  # [n, n] a random tree-like mask, each row sees itself
            tokens = torch.randint(100, 40000, (count,), generator=generator)
            results, forwards = [], []
            for engine, cache in zip(engines, caches):
                def forward(engine=engine, cache=cache) -> torch.Tensor:
                    cache.crop(context)
                    return engine.forward(tokens, torch.arange(context, context + count), cache, tree_mask=mask)
                hidden = forward()
                results.append((hidden, engine.project(hidden)))
                forwards.append(forward)
            assert not check or all(torch.equal(a, b) for a, b in zip(*results)), (mode, count)
            times = interleaved_ms(forwards)
            cells.append(f"{count} rows {times[0]:.1f} / {times[1]:.1f}")
        equal = "hidden states and logits bitwise equal" if check else "not checked (--no-check)"
        print(f"{mode} forward over {context} cached tokens, ms old / new ({equal}): " + ", ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--forward", action="store_true", help="also the shipped model's forward, old / new")
    parser.add_argument("--contexts", default="150", help="--forward: cached tokens under the new rows (comma list)")
    parser.add_argument("--modes", default="gguf-q8,gguf,fp32", help="--forward: precisions (comma list)")
    parser.add_argument("--counts", default="1,16,64", help="--forward: new rows (comma list)")
    parser.add_argument("--no-check", action="store_true", help="time only: the change is meant to change numbers")
    args = parser.parse_args()
    modules = [build(args.old, "compare_old"), build(args.new, "compare_new")]
    checked = "not checked (--no-check)" if args.no_check else "asserted"
    print(f"ISA {modules[0].ISA} / {modules[1].ISA}, {torch.get_num_threads()} threads; ms of {LAYERS} layers' "
          f"products, old / new (bitwise equal: {checked})")
    if args.rows:
        compare(modules, [int(r) for r in args.rows.split(",")], check=not args.no_check)
    if args.forward:
        for context in (int(c) for c in args.contexts.split(",")):
            compare_forwards(modules, context, check=not args.no_check, modes=tuple(args.modes.split(",")),
                             counts=tuple(int(c) for c in args.counts.split(",")))


if __name__ == "__main__":
    main()
