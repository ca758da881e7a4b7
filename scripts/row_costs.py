"""What a forward of n rows costs with the kernels chosen here, and with each kernel forced.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python scripts/row_costs.py [fp32|bf16]

Prints, for 1 / 2 / 4 / 8 new rows on a 200-token cache: the whole lean forward, its projections
alone (all layers, the chosen kernel per row bucket) and the vocabulary projection; then the
projections with every bucket forced to one kernel: it shows whether a row count runs kernels
chosen for another (core.engine.ROW_BUCKETS). Run it alone: it times.
"""
from __future__ import annotations

import sys

import torch

from core.engine import median_ms
from core.model import ModelConfig, load_base_model

CONTEXT = 200


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    engine = load_base_model(ModelConfig(dtype=dtype, device="cpu")).engine
    cache = engine.new_cache(512)
    ids = torch.randint(100, 10000, (CONTEXT,))
    engine.forward(ids, torch.arange(CONTEXT), cache)
    projections = engine.matmuls()[:-1]

    def forward(n: int):
        mask = torch.ones(n, n, dtype=torch.bool).tril_() if n > 1 else None  # [n, n] a chain

        def call() -> None:
            cache.crop(CONTEXT)
            engine.forward(ids[:n], torch.arange(CONTEXT, CONTEXT + n), cache, tree_mask=mask)
        return call

    def products(n: int, kernel: str | None = None):
        inputs = {m.weight.shape[1]: torch.randn(1, n, m.weight.shape[1], dtype=m.weight.dtype) for m in projections}

        def call() -> None:
            for m in projections:
                chosen = m.kernels
                if kernel is not None:
                    m.kernels = {bucket: kernel for bucket in chosen}
                m(inputs[m.weight.shape[1]])
                m.kernels = chosen
        return call

    print("chosen", {role: ms[0].kernels for role, ms in engine.roles().items()})
    for n in (1, 2, 4, 8):
        rows = torch.randn(n, engine.lm_head.weight.shape[1], dtype=engine.lm_head.weight.dtype)  # [n, H]
        print(f"{dtype} rows {n}: forward {median_ms(forward(n), 7):.1f} ms, products {median_ms(products(n), 7):.1f}, "
              f"lm_head {median_ms(lambda: engine.lm_head(rows), 7):.2f}")
    for kernel in ("linear", "wxt", "mkldnn"):
        if kernel == "mkldnn":
            if dtype != "fp32":
                continue
            for m in engine.matmuls():
                m.pack()
        print("forced", kernel, {n: round(median_ms(products(n, kernel), 5), 1) for n in (1, 2, 8)})


if __name__ == "__main__":
    main()
