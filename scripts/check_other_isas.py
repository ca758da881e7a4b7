"""The kernels for instruction sets this CPU may not have: compiled, and where this CPU can run them, compared.

The kernels build with `-march=native`, so a machine compiles only its own branch of the source (the
AVX512 lanes, the AVX2 halves, or the generic vectors with software fp16 conversions). This script
(1) compiles the source for a Sapphire Rapids (AVX512, AMX), a Zen 3 (AVX2) and a generic x86-64 CPU
(`-fsyntax-only`: errors only), and (2) builds the generic x86-64 module and checks that its gguf-q8
and fp32 forwards (a prompt, then a 5-node tree with its logits, and the cache's keys) are bitwise the
native build's. Run it after changing `core/engine/kernels/exact.cpp`:

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python scripts/check_other_isas.py [--no-run]
"""
from __future__ import annotations

import argparse
import subprocess
import sysconfig
from pathlib import Path

import torch
from torch.utils import cpp_extension

from core.engine.build import CFLAGS, LDFLAGS, SOURCE, load_kernels
from core.engine.exact import GGUF_MODES, ExactLlama
from core.model import CACHE_DIR, ModelConfig, load_base_model
from core.paths import gguf_location

ARCHES = ("sapphirerapids", "znver3", "x86-64")


def compile_for(arch: str) -> str:
    """The compiler's errors for `-march=arch` ('' when none)."""
    includes = [f"-I{path}" for path in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]]
    flags = [flag for flag in CFLAGS if not flag.startswith("-march")] + [f"-march={arch}", "-fsyntax-only"]
    command = ["g++", *flags, "-DTORCH_EXTENSION_NAME=check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
               str(SOURCE)]
    result = subprocess.run(command, capture_output=True, text=True)
    return "\n".join(line for line in result.stderr.splitlines() if "error" in line)


def generic_module():
    """The kernels built for a generic x86-64 (cached under /tmp/kernel_builds/generic)."""
    folder = Path("/tmp/kernel_builds/generic")
    folder.mkdir(parents=True, exist_ok=True)
    flags = [flag if flag != "-march=native" else "-march=x86-64" for flag in CFLAGS]
    return cpp_extension.load(name="generic_exact", sources=[str(SOURCE)], extra_cflags=flags,
                              extra_ldflags=list(LDFLAGS), build_directory=str(folder), verbose=False)


def forwards(engine: ExactLlama, ids: torch.Tensor) -> list[torch.Tensor]:
    """A prompt's hidden states, a 5-node tree's on top and its logits, the cache's keys."""
    cache = engine.new_cache(len(ids) + 8)
    prompt = engine.forward(ids, torch.arange(len(ids)), cache)  # [n, H]
    mask = torch.ones(5, 5, dtype=torch.bool).tril_()  # [5, 5] a chain with one branch
    mask[3, 1] = False
    tree = engine.forward(torch.tensor([100, 200, 300, 400, 500]), torch.arange(len(ids), len(ids) + 5), cache,
                          tree_mask=mask)  # [5, H]
    return [prompt, tree, engine.project(tree), cache.keys.clone()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="compile only")
    args = parser.parse_args()
    failed = False
    for arch in ARCHES:
        errors = compile_for(arch)
        print(f"-march={arch}: " + ("compiles" if not errors else "ERRORS\n" + errors), flush=True)
        failed |= bool(errors)
    if failed or args.no_run:
        raise SystemExit(1 if failed else 0)
    native, generic = load_kernels(CACHE_DIR), generic_module()
    folder, name = gguf_location()
    for mode in ("gguf-q8", "fp32"):
        base = load_base_model(ModelConfig(dtype=mode))
        path = folder / name if mode in GGUF_MODES else None
        ids = torch.tensor(base.chat_ids("Name three trees and say why leaves change colour in autumn."))
        native_out, generic_out = (forwards(ExactLlama(base.engine.lean, kernels, mode, path), ids)
                                   for kernels in (native, generic))
        same = all(torch.equal(a, b) for a, b in zip(native_out, generic_out))
        print(f"{mode}: {native.ISA} and {generic.ISA} builds " + ("bitwise equal" if same else "DIFFER"), flush=True)
        failed |= not same
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
