"""The engine: forwards of a loaded base model, their KV caches and their kernels.

- `lean`: the Python forward of the Llama family (fused projections, a static cache, library
  kernels chosen per row count by measurement). It serves every forward where the exact kernels
  cannot be built (and the GPU engine's batched generation); exact up to float rounding.
- `exact`: the same forward through the row-invariant C++ kernels of `kernels/exact.cpp`,
  built once per machine by `build`: every row of a tree verify, and every slot's row of batched
  generation, is the number the plain one-token step computes, bit for bit, in fp32, bf16 and the
  GGUF's own 4-bit blocks.
"""
from core.engine.lean import (BUCKET_TIMING_ROWS, LEAN_MODEL_TYPES, REFERENCE_BUCKET, ROW_BUCKETS, TREE_ROWS_MARGIN,
                              FusedLayer, LeanLlama, Matmul, SlotCache, SlotStep, SlotView, StaticCache, fastest,
                              lean_unsupported_reason, time_kernels)
from core.machine import median_ms

__all__ = ["BUCKET_TIMING_ROWS", "LEAN_MODEL_TYPES", "REFERENCE_BUCKET", "ROW_BUCKETS", "TREE_ROWS_MARGIN", "FusedLayer",
           "LeanLlama", "Matmul", "SlotCache", "SlotStep", "SlotView", "StaticCache", "fastest", "lean_unsupported_reason",
           "median_ms", "time_kernels"]
