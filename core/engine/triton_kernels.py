"""Row-invariant GPU kernels (Triton) for the exact engine on CUDA.

Every output element is reduced in one fixed order whatever the number of rows in the call: the
tiles are fixed per weight (never chosen by the row count), the reduction over the inner dimension
runs block after block in one program (no split-K), and the row count is never a compile-time
specialisation (`do_not_specialize`), so a row of an n-row tree verify is computed by the same
instructions, in the same order, as the one-token step at that position.

- `matmul`: x [M, K] fp32 times a weight [N, K] (fp32 or bf16, widened in registers) in fp32
  arithmetic (`input_precision="ieee"`: no TF32 rounding of the inputs);
- `rms_norm`: one program per row;
- `tree_attention`: one program per (row, query head); each query reduces exactly the keys it sees
  in position order (the cached positions, then its ancestors), over blocks aligned to position 0,
  with an online softmax: what a one-token step at that position computes, bit for bit.

This module imports triton; `core.engine.gpu` imports it only where a CUDA device is present (or
the Triton interpreter is asked for).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MATMUL_BLOCK_M = 16
MATMUL_BLOCK_K = 64
ATTENTION_BLOCK = 64  # key positions per block: blocks start at multiples of this position


def matmul_block_n(out_features: int) -> int:
    """Output columns per program: fixed by the weight's shape alone (never by the row count)."""
    return 32 if out_features <= 4096 else 128


@triton.jit(do_not_specialize=["rows"])
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, rows, out_features, in_features,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = offs_m < rows
    col_ok = offs_n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        k = start + offs_k
        k_ok = k < in_features
        x = tl.load(x_ptr + offs_m[:, None] * in_features + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + offs_n[None, :] * in_features + k[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0).to(tl.float32)  # [BK, BN]
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    where = offs_m[:, None] * out_features + offs_n[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:  # the residual stream's addition, after the whole sum (as `residual + x @ W.T`)
        acc = tl.load(residual_ptr + where, mask=ok, other=0.0) + acc
    tl.store(out_ptr + where, acc, mask=ok)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ weight.T (+ bias): x [M, K] fp32 (contiguous), weight [N, K], residual [M, N]
    fp32 or None -> [M, N] fp32, row-invariant."""
    rows, width = x.shape
    out_features = weight.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
    block_n = matmul_block_n(out_features)
    grid = (triton.cdiv(rows, MATMUL_BLOCK_M), triton.cdiv(out_features, block_n))
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, residual if residual is not None else out,
                         out, rows, out_features, width, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                         BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=block_n, BLOCK_K=MATMUL_BLOCK_K, num_warps=4)
    return out


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, q_out_ptr, keys_ptr, values_ptr,
                       cache_head_stride, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)  # query heads, then key/value heads
    dims = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = HEAD_DIM // 2
    partner = (dims + half) % HEAD_DIM
    sign = tl.where(dims < half, -1.0, 1.0)
    position = tl.load(positions_ptr + row)
    cos = tl.load(cos_ptr + position * HEAD_DIM + dims)
    sin = tl.load(sin_ptr + position * HEAD_DIM + dims)
    width: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    source = qkv_ptr + row * width + head * HEAD_DIM
    # RoPE as transformers applies it: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    rotated = tl.load(source + dims) * cos + (sign * tl.load(source + partner)) * sin
    if head < HEADS:
        tl.store(q_out_ptr + row * HEADS * HEAD_DIM + head * HEAD_DIM + dims, rotated)
    else:
        kv_head = head - HEADS
        slot = tl.load(slots_ptr + row)
        where = kv_head * cache_head_stride + slot * HEAD_DIM + dims
        tl.store(keys_ptr + where, rotated)
        tl.store(values_ptr + where, tl.load(source + KV_HEADS * HEAD_DIM + dims))


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate the queries and keys of qkv [M, (heads + 2 kv) * D] fp32 at `positions` [M] (cos/sin
    tables [P, D] fp32), write each row's keys and values into the cache layer (keys/values
    [kv_heads, capacity, D]) at `slots` [M]; returns the rotated queries [M, heads * D]."""
    rows = qkv.shape[0]
    kv_heads, _, head_dim = keys.shape
    q = torch.empty(rows, heads * head_dim, dtype=torch.float32, device=qkv.device)
    _rope_store_kernel[(rows, heads + kv_heads)](qkv, cos, sin, positions, slots, q, keys, values, keys.stride(0),
                                                 HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, num_warps=1)
    return q


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    gate = tl.load(gate_up_ptr + row * 2 * width + offs, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * width + offs, gate / (1.0 + tl.exp(-gate)) * up, mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [M, 2I] fp32 (gate first): [M, I] fp32."""
    rows, double = gate_up.shape
    width = double // 2
    out = torch.empty(rows, width, dtype=torch.float32, device=gate_up.device)
    _silu_mul_kernel[(rows, triton.cdiv(width, 1024))](gate_up, out, width, BLOCK=1024, num_warps=4)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    x = tl.load(x_ptr + row * width + offs, mask=ok, other=0.0)  # [BLOCK]
    mean_square = tl.sum(x * x, axis=0) / width
    inverse = 1.0 / tl.sqrt_rn(mean_square + eps)
    weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + offs, x * inverse * weight, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMS norm of each row of x [M, H] fp32 (contiguous), scaled by weight [H]: [M, H] fp32."""
    rows, width = x.shape
    if out is None:
        out = torch.empty_like(x)
    _rms_norm_kernel[(rows,)](x, weight, out, width, eps, BLOCK=triton.next_power_of_2(width), num_warps=4)
    return out


@triton.jit(do_not_specialize=["ancestors_stride"])
def _attention_kernel(q_ptr, q_row_stride, k_ptr, v_ptr, cache_head_stride, out_ptr,
                      last_ptr, tree_from_ptr, ancestors_ptr, ancestors_stride, scale,
                      GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * q_row_stride + head * HEAD_DIM + dims)  # [D]
    last = tl.load(last_ptr + row)  # the last position this row sees (its own)
    tree_from = tl.load(tree_from_ptr + row)  # positions from here are read from the row's ancestors
    keys = k_ptr + kv_head * cache_head_stride
    values = v_ptr + kv_head * cache_head_stride
    best = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for start in range(0, last + 1, BLOCK):
        positions = start + tl.arange(0, BLOCK)  # [BLOCK]
        seen = positions <= last
        in_tree = seen & (positions >= tree_from)
        slot = tl.load(ancestors_ptr + row * ancestors_stride + (positions - tree_from), mask=in_tree, other=0)
        slot = tl.where(in_tree, slot, positions)
        k = tl.load(keys + slot[:, None] * HEAD_DIM + dims[None, :], mask=seen[:, None], other=0.0)  # [BLOCK, D]
        scores = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK]
        scores = tl.where(seen, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best)  # [BLOCK]
        v = tl.load(values + slot[:, None] * HEAD_DIM + dims[None, :], mask=seen[:, None], other=0.0)
        total = total * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        best = new_best
    tl.store(out_ptr + row * HEADS * HEAD_DIM + head * HEAD_DIM + dims, acc / total)


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, last: torch.Tensor,
                   tree_from: torch.Tensor, ancestors: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query row over the keys it sees, in position order.

    q [M, >= heads * D] fp32 (row-major; extra columns ignored), keys/values [kv_heads, capacity, D]
    fp32 (the cache of one layer, new rows already written), last [M] int32 (the last position
    row i sees, its own), tree_from [M] int32 (positions >= this are read from the row's ancestors:
    `ancestors[i, p - tree_from[i]]` is the cache slot of position p; earlier positions sit at their
    own slot), ancestors [M, A] int32. Returns [M, heads * D] fp32."""
    rows = q.shape[0]
    kv_heads, _, head_dim = keys.shape
    heads = out.shape[1] // head_dim if out is not None else None
    if heads is None:
        raise ValueError("tree_attention needs `out` [M, heads * D] (its width gives the head count)")
    _attention_kernel[(rows, heads)](q, q.stride(0), keys, values, keys.stride(0), out, last, tree_from, ancestors,
                                     ancestors.stride(0), scale, GROUP=heads // kv_heads, HEADS=heads,
                                     HEAD_DIM=head_dim, BLOCK=ATTENTION_BLOCK, num_warps=4)
    return out
