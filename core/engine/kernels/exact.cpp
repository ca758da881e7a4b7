// Row-invariant kernels for the exact engine (core/engine/exact.py).
//
// Every number a row of an n-row forward produces is computed by the same instructions in the
// same order as when that row is the only one: that is what makes a tree verify's rows equal, bit
// for bit, to the plain one-token steps they stand for.
//   - products: each output element is one dot product over K, accumulated in 16 fixed lanes
//     (lane l sums k = l, l+16, ...) with fused multiply-adds, then summed by a fixed tree. Rows
//     are tiled only to reuse a weight block from cache; threads split output columns, never K.
//   - weights: fp32, bf16 (exact in fp32), or the GGUF's own Q8_0 / Q4_1 blocks dequantised into a
//     small per-thread buffer as gguf does it (d * q, then + m, each rounded: no fused add), so
//     those weights are bitwise the fp32 model's, and a gguf forward equals the fp32 one.
//   - attention: a query reduces exactly the keys it sees (the cache, then its tree ancestors and
//     itself, in position order), the same sequence a plain step at that position sees.
//   - norms, rotary, activations: per row, the same code for every row.
// The file is compiled with -ffp-contract=off so no compiler decides where a multiply-add fuses:
// fused only where written (vfma), everywhere else each operation rounds on its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16s8 __attribute__((vector_size(16)));
constexpr int LANES = 16;

// Tiles: R rows x C columns of accumulators, sized to the vector registers so none spills.
#if defined(__AVX512F__)
constexpr int TILE_ROWS = 6;  // 6 x 4 accumulators in 32 zmm registers
constexpr int tile_cols(int) { return 4; }
constexpr int direct_cols(int) { return 4; }
constexpr int64_t DIRECT_GROUP = 4;
constexpr int64_t DIRECT_ROWS = 4;  // up to this many rows, bf16 / quantised weights widen in registers
constexpr const char* ISA = "avx512";
#elif defined(__FMA__)
// AVX2 has 16 ymm registers and a v16f takes two, so the products run on 8-lane halves (HALF_LANES)
#define HALF_LANES 1
constexpr int TILE_ROWS = 4;  // 4 x 3 half accumulators and 3 weight halves: 15 of 16 registers
constexpr int tile_cols(int rows) { return rows == 1 ? 6 : rows == 2 ? 4 : 3; }
// quantised / bf16 weights widened in registers (a column's block is 4 registers, each row's
// accumulator 2) for every row count, 4 rows at a time: on a Zen 3 EPYC that beat widening a block
// of columns into a buffer at every count measured (Q4_1, the shipped model's layers: 4 rows 12 against
// 35 ms, 16 rows 46 against 65, 64 rows 172 against 197)
constexpr int direct_cols(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
constexpr int64_t DIRECT_GROUP = 4;
constexpr int64_t DIRECT_ROWS = INT64_MAX;
constexpr const char* ISA = "avx2+fma";
#else
constexpr int TILE_ROWS = 2;
constexpr int tile_cols(int) { return 2; }
constexpr int direct_cols(int) { return 2; }
constexpr int64_t DIRECT_GROUP = 2;
constexpr int64_t DIRECT_ROWS = 2;
constexpr const char* ISA = "generic";
#endif
constexpr int64_t COL_BLOCK = 16;  // output columns a thread dequantises and finishes at once

inline v16f vload(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
// x in every lane (a broadcast, not 0 + x, which would turn -0 into +0)
inline v16f vset(float x) { return v16f{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// a * b + c rounded once; the same result on every instruction set (std::fma is exact too)
inline v16f vfma(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  union U { v16f v; __m256 h[2]; };
  U ua{a}, ub{b}, uc{c}, r;
  r.h[0] = _mm256_fmadd_ps(ua.h[0], ub.h[0], uc.h[0]);
  r.h[1] = _mm256_fmadd_ps(ua.h[1], ub.h[1], uc.h[1]);
  return r.v;
#else
  v16f r;
  for (int i = 0; i < LANES; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// the 16 lanes summed by one fixed tree: lane l + lane l+8, then + l+4, + l+2, + l+1 (halves of
// the register added, so the tree is the same whatever the instruction set)
inline float hsum(v16f v) {
  union { v16f whole; v8f half[2]; } a{v};
  union { v8f whole; v4f half[2]; } b{a.half[0] + a.half[1]};
  const v4f c = b.half[0] + b.half[1];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

inline float hmax(v16f v) {
  float t[LANES];
  std::memcpy(t, &v, sizeof t);
  float m = t[0];
  for (int i = 1; i < LANES; ++i) m = t[i] > m ? t[i] : m;
  return m;
}

// 16 bytes -> 16 floats (exact); spelt out because GCC converts byte vectors one element at a time
inline v16f u8_to_float(v16u8 q) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)q));
#else
  return __builtin_convertvector(__builtin_convertvector(q, v16i), v16f);
#endif
}
inline v16f s8_to_float(v16s8 q) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q));
#else
  return __builtin_convertvector(__builtin_convertvector(q, v16i), v16f);
#endif
}

inline v16f bf16_to_float(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
  typedef uint16_t v16u16 __attribute__((vector_size(32)));
  v16u16 h;
  std::memcpy(&h, p, sizeof h);
  return (v16f)(__builtin_convertvector(h, v16i) << 16);
#endif
}

inline v16f vmax(v16f a, v16f b) { return a > b ? a : b; }

// e^x per lane (Cephes' expf: range reduction by ln 2, degree-5 polynomial, 2^n by exponent bits);
// lane-independent, so an element's value never depends on where it sits in a vector
inline v16f vexp(v16f x) {
  x = vmax(x, vset(-87.0f));
  x = x < vset(88.0f) ? x : vset(88.0f);
  v16f fx = x * 1.44269504088896341f + 0.5f;
  v16i truncated = __builtin_convertvector(fx, v16i);
  v16f floored = __builtin_convertvector(truncated, v16f);
  floored = floored - __builtin_convertvector((floored > fx) & 1, v16f);  // floor
  x = x - floored * 0.693359375f;
  x = x - floored * -2.12194440e-4f;
  v16f z = x * x;
  v16f y = vset(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  v16i bits = (__builtin_convertvector(floored, v16i) + 127) << 23;
  return y * (v16f)bits;
}

// fp16 -> fp32 (exact either way): one instruction where the CPU has F16C
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    float f = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -f : f;
  }
  uint32_t bits = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13))
                                 : (sign | ((exponent + 112) << 23) | (mantissa << 13));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

enum Format : int { F32 = 0, BF16 = 1, Q8_0 = 2, Q4_1 = 3 };
constexpr int QBLOCK = 32;

// where element i of block b sits in the pair order of the 8-bit product (gguf-q8, below)
// (the pair's two blocks alternate in 4-byte groups: 32-bit lane l holds block 2p + l % 2)
inline int64_t pair_offset(int64_t b, int64_t i) {
  return (b / 2) * 64 + (i / 16) * 32 + 4 * (2 * ((i % 16) / 4) + b % 2) + i % 4;
}

int64_t row_bytes(int format, int64_t k) {
  switch (format) {
    case F32: return k * 4;
    case BF16: return k * 2;
    case Q8_0: return k / QBLOCK * 34;
    case Q4_1: return k / QBLOCK * 20;
  }
  TORCH_CHECK(false, "unknown weight format ", format);
}

// Block b (32 numbers) of one weight row as fp32, its first 16 in lo and the next 16 in hi: the one
// decoder every product path uses, so the buffered and the in-register paths read the same values.
// bf16 is the top half of fp32's bits; Q8_0 is d * q; Q4_1 is d * q, then + m (rounded apart, as
// gguf does), element j the low nibble of byte j and element j + 16 its high nibble.
template <int FMT>
inline void decode_block(const uint8_t* row, int64_t b, v16f& lo, v16f& hi) {
  if constexpr (FMT == BF16) {
    const uint8_t* block = row + b * 64;
    lo = bf16_to_float(block);
    hi = bf16_to_float(block + 32);
  } else if constexpr (FMT == Q4_1) {
    const uint8_t* block = row + b * 20;
    uint16_t dh, mh;
    std::memcpy(&dh, block, 2);
    std::memcpy(&mh, block + 2, 2);
    const v16f d = vset(half_to_float(dh)), m = vset(half_to_float(mh));
    v16u8 q;
    std::memcpy(&q, block + 4, 16);
    lo = u8_to_float(q & 0x0f) * d + m;
    hi = u8_to_float(q >> 4) * d + m;
  } else {
    const uint8_t* block = row + b * 34;
    uint16_t dh;
    std::memcpy(&dh, block, 2);
    const v16f d = vset(half_to_float(dh));
    v16s8 q0, q1;
    std::memcpy(&q0, block + 2, 16);
    std::memcpy(&q1, block + 18, 16);
    lo = s8_to_float(q0) * d;
    hi = s8_to_float(q1) * d;
  }
}

// A weight [out, in] in one of the formats above (data: the raw rows, contiguous), with an
// optional fp32 bias [out].
struct Weight {
  int format;
  int64_t out, in, stride;
  torch::Tensor data, bias;
  const uint8_t* bytes;
  // 8-bit activations (mode gguf-q8): the product multiplies the blocks' integers by each input
  // row's 8-bit blocks; for it the blocks are also split into their quants [out, blocks * 16 | 32]
  // and fp16 scales [out, padded] (d; m for Q4_1), zero-padded to whole 8-lane vectors of blocks
  bool int8 = false;
  int64_t padded = 0, quant_stride = 0;
  torch::Tensor quants, scale_d, scale_m;
  const uint8_t* quant_bytes = nullptr;  // the tensors' data, read in the hot loops without a call
  const uint16_t *d16 = nullptr, *m16 = nullptr;

  Weight(int format_, torch::Tensor data_, int64_t out_, int64_t in_, c10::optional<torch::Tensor> bias_,
         bool int8_activations)
      : format(format_), out(out_), in(in_), data(data_.contiguous()), int8(int8_activations) {
    stride = row_bytes(format, in);
    TORCH_CHECK(in % LANES == 0, "input width ", in, " is not a multiple of ", LANES);
    TORCH_CHECK(format < Q8_0 || in % QBLOCK == 0, "quantised width ", in, " is not a multiple of 32");
    TORCH_CHECK(data.numel() * data.element_size() == out * stride, "weight bytes do not match its shape");
    bytes = static_cast<const uint8_t*>(data.data_ptr());
    if (bias_.has_value() && bias_->defined()) {
      bias = bias_->to(torch::kFloat32).contiguous();
      TORCH_CHECK(bias.numel() == out, "bias size");
    }
    if (int8) split_blocks();
  }

  // the blocks' quants in the pair order of the 8-bit product (int8_columns), zero-padded to whole
  // pairs, and their fp16 scales apart
  void split_blocks() {
    TORCH_CHECK(format == Q8_0 || format == Q4_1, "8-bit activations need Q8_0 or Q4_1 blocks");
    const int64_t blocks = in / QBLOCK, pairs = (blocks + 1) / 2, block_bytes = stride / blocks;
    const int64_t pair_bytes = format == Q4_1 ? 32 : 64;  // Q4_1: both blocks' 16 nibble bytes, interleaved
    padded = (blocks + 7) / 8 * 8;
    quants = torch::zeros({out, pairs * pair_bytes}, torch::kUInt8);
    scale_d = torch::zeros({out, padded}, torch::kInt16);
    scale_m = torch::zeros({out, format == Q4_1 ? padded : 0}, torch::kInt16);
    uint8_t* q = quants.data_ptr<uint8_t>();
    int16_t* d = scale_d.data_ptr<int16_t>();
    int16_t* m = scale_m.data_ptr<int16_t>();
    quant_bytes = q;
    quant_stride = pairs * pair_bytes;
    d16 = reinterpret_cast<const uint16_t*>(d);
    m16 = format == Q4_1 ? reinterpret_cast<const uint16_t*>(m) : nullptr;
    for (int64_t c = 0; c < out; ++c)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = bytes + c * stride + b * block_bytes;
        uint8_t* row = q + c * pairs * pair_bytes;
        std::memcpy(d + c * padded + b, block, 2);
        if (format == Q4_1) {
          std::memcpy(m + c * padded + b, block + 2, 2);
          for (int k = 0; k < 16; ++k) row[(b / 2) * 32 + 4 * (2 * (k / 4) + b % 2) + k % 4] = block[4 + k];
        } else {
          for (int i = 0; i < QBLOCK; ++i) row[pair_offset(b, i)] = block[2 + i];
        }
      }
  }

  // rows [first, first + count) of the weight as fp32 in dst [count, in] (or a pointer into the
  // fp32 weight itself); the values are exactly those gguf's dequantisation gives
  const float* rows(int64_t first, int64_t count, float* dst) const {
    const uint8_t* src = bytes + first * stride;
    if (format == F32) return reinterpret_cast<const float*>(src);
    for (int64_t r = 0; r < count; ++r, src += stride) dequantize_row(src, dst + r * in);
    return dst;
  }

  // row r as fp32 in dst [in]
  void row_into(int64_t r, float* dst) const {
    const float* p = rows(r, 1, dst);
    if (p != dst) std::memcpy(dst, p, in * sizeof(float));
  }

  void dequantize_row(const uint8_t* src, float* dst) const {
    if (format == BF16 && in % QBLOCK) {  // bf16 widths need only be whole vectors
      for (int64_t k = 0; k < in; k += LANES) vstore(dst + k, bf16_to_float(src + 2 * k));
      return;
    }
    for (int64_t b = 0; b < in / QBLOCK; ++b, dst += QBLOCK) {
      v16f lo, hi;
      if (format == BF16) decode_block<BF16>(src, b, lo, hi);
      else if (format == Q8_0) decode_block<Q8_0>(src, b, lo, hi);
      else decode_block<Q4_1>(src, b, lo, hi);
      vstore(dst, lo);
      vstore(dst + 16, hi);
    }
  }
};

// out[r, c] = dot(x[r, :], w[c, :]) for a tile of R rows and C columns: accumulator (r, c) sees
// the same fused multiply-adds in the same order whatever R and C are
#if defined(HALF_LANES)
inline v8f vload8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8f vfma8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
// hsum of the v16f whose lanes 0-7 are lo and 8-15 hi: the same tree, from its first step on
inline float hsum_halves(v8f lo, v8f hi) {
  union { v8f whole; v4f half[2]; } b{lo + hi};
  const v4f c = b.half[0] + b.half[1];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// Lanes 0-7 over the whole of K, then lanes 8-15: each lane's fused multiply-adds are the same
// sequence as in one 16-lane pass (lanes never mix before the final sum), with half the registers.
template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* out, int64_t ldo, int64_t k) {
  v8f low[R][C];
  for (int h = 0; h < 2; ++h) {
    v8f acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = v8f{};
    for (int64_t i = 8 * h; i < k; i += LANES) {
      v8f wv[C];
      for (int c = 0; c < C; ++c) wv[c] = vload8(w + c * ldw + i);
      for (int r = 0; r < R; ++r) {
        const v8f xv = vload8(x + r * ldx + i);
        for (int c = 0; c < C; ++c) acc[r][c] = vfma8(xv, wv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        if (h == 0) low[r][c] = acc[r][c];
        else out[r * ldo + c] = hsum_halves(low[r][c], acc[r][c]);
      }
  }
}
#else
template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* out, int64_t ldo, int64_t k) {
  v16f acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = v16f{};
  for (int64_t i = 0; i < k; i += LANES) {
    v16f wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(w + c * ldw + i);
    for (int r = 0; r < R; ++r) {
      const v16f xv = vload(x + r * ldx + i);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum(acc[r][c]);
}
#endif

template <int R>
inline void tile_row_block(const float* x, int64_t ldx, const float* w, int64_t k, float* out, int64_t ldo,
                           int64_t cols) {
  constexpr int C = tile_cols(R);
  int64_t c = 0;
  for (; c + C <= cols; c += C) tile<R, C>(x, ldx, w + c * k, k, out + c, ldo, k);
  for (; c < cols; ++c) tile<R, 1>(x, ldx, w + c * k, k, out + c, ldo, k);
}

// A few rows through bf16 or quantised weights (a plain step, a small tree), widened in registers by
// decode_block, as the buffered path widens them, with the same fused multiply-adds per lane in the
// same order (a block's low half feeds lanes 0-15 at k = 32b + l, its high half at k = 32b + 16 + l),
// so the result is bitwise the same; the buffer's stores and reloads are saved.
#if defined(HALF_LANES)
// Block b of a row as four 8-lane registers, elements 0-7, 8-15, 16-23, 24-31: decode_block's values
// (d * q, then + m, each rounded), in the registers AVX2 has
template <int FMT>
inline void decode_block8(const uint8_t* row, int64_t b, __m256 w[4]) {
  if constexpr (FMT == BF16) {
    const uint8_t* block = row + b * 64;
    for (int k = 0; k < 4; ++k) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * k));
      w[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  } else if constexpr (FMT == Q4_1) {
    const uint8_t* block = row + b * 20;
    uint16_t dh, mh;
    std::memcpy(&dh, block, 2);
    std::memcpy(&mh, block + 2, 2);
    const __m256 d = _mm256_set1_ps(half_to_float(dh)), m = _mm256_set1_ps(half_to_float(mh));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k])), d), m);
  } else {
    const uint8_t* block = row + b * 34;
    uint16_t dh;
    std::memcpy(&dh, block, 2);
    const __m256 d = _mm256_set1_ps(half_to_float(dh));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
    const __m128i parts[4] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
    for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[k])), d);
  }
}

// The in-register path on 8-lane halves: lanes 0-7 take elements 0-7 then 16-23 of each block,
// lanes 8-15 elements 8-15 then 24-31, the order of the 16-lane path below
template <int FMT, int R, int C>
inline void direct_columns(const float* x, int64_t ldx, const uint8_t* w, int64_t stride, int64_t blocks,
                           float* out, int64_t ldo) {
  v8f low[R][C], high[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) low[r][c] = high[r][c] = v8f{};
  for (int64_t b = 0; b < blocks; ++b) {
    for (int c = 0; c < C; ++c) {
      __m256 wv[4];
      decode_block8<FMT>(w + c * stride, b, wv);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + b * QBLOCK;
        low[r][c] = vfma8(vload8(xb), (v8f)wv[0], low[r][c]);
        high[r][c] = vfma8(vload8(xb + 8), (v8f)wv[1], high[r][c]);
        low[r][c] = vfma8(vload8(xb + 16), (v8f)wv[2], low[r][c]);
        high[r][c] = vfma8(vload8(xb + 24), (v8f)wv[3], high[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum_halves(low[r][c], high[r][c]);
}
#else
template <int FMT, int R, int C>
inline void direct_columns(const float* x, int64_t ldx, const uint8_t* w, int64_t stride, int64_t blocks,
                           float* out, int64_t ldo) {
  v16f acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = v16f{};
  for (int64_t b = 0; b < blocks; ++b) {
    for (int c = 0; c < C; ++c) {
      v16f lo, hi;
      decode_block<FMT>(w + c * stride, b, lo, hi);
      for (int r = 0; r < R; ++r) {
        acc[r][c] = vfma(vload(x + r * ldx + b * QBLOCK), lo, acc[r][c]);
        acc[r][c] = vfma(vload(x + r * ldx + b * QBLOCK + 16), hi, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum(acc[r][c]);
}
#endif

template <int FMT, int R>
inline void direct_block(const float* x, const Weight& w, int64_t first, int64_t cols, float* out) {
  const uint8_t* rows = w.bytes + first * w.stride;
  const int64_t blocks = w.in / QBLOCK;
  constexpr int C = direct_cols(R);
  int64_t c = 0;
  for (; c + C <= cols; c += C)
    direct_columns<FMT, R, C>(x, w.in, rows + c * w.stride, w.stride, blocks, out + first + c, w.out);
  for (; c < cols; ++c)
    direct_columns<FMT, R, 1>(x, w.in, rows + c * w.stride, w.stride, blocks, out + first + c, w.out);
}


template <int FMT>
inline void direct_rows(const float* x, int64_t n, const Weight& w, int64_t first, int64_t cols, float* out) {
  // groups of up to DIRECT_GROUP rows: a block of columns' bytes (a few KB) stays in L1 between groups
  for (int64_t r = 0; r < n; r += DIRECT_GROUP) {
    const float* rows_x = x + r * w.in;
    float* rows_out = out + r * w.out;
    switch (std::min<int64_t>(n - r, DIRECT_GROUP)) {
      case 1: direct_block<FMT, 1>(rows_x, w, first, cols, rows_out); break;
      case 2: direct_block<FMT, 2>(rows_x, w, first, cols, rows_out); break;
      case 3: direct_block<FMT, 3>(rows_x, w, first, cols, rows_out); break;
      default: direct_block<FMT, 4>(rows_x, w, first, cols, rows_out); break;  // DIRECT_GROUP <= 4
    }
  }
}

// the last rows < TILE_ROWS in one tile of their own count (more accumulators in flight than row by
// row; each output element's arithmetic is the same either way)
inline void tail_rows(int64_t rows, const float* x, int64_t k, const float* w, float* out, int64_t ldo,
                      int64_t cols) {
  switch (rows) {
    case 1: tile_row_block<1>(x, k, w, k, out, ldo, cols); break;
    case 2: tile_row_block<2>(x, k, w, k, out, ldo, cols); break;
    case 3: tile_row_block<3>(x, k, w, k, out, ldo, cols); break;
    case 4: tile_row_block<4>(x, k, w, k, out, ldo, cols); break;
    default: tile_row_block<5>(x, k, w, k, out, ldo, cols); break;  // TILE_ROWS <= 6
  }
}


// ---- 8-bit activations (mode gguf-q8): llama.cpp's arithmetic, row-invariant ----------------------
// Each input row is cut into blocks of 32 and rounded to 8 bits per block, on its own (d = amax / 127,
// q = round(x / d), s = d * sum(q)): a row's integers never depend on the other rows. Blocks go in
// pairs (2p, 2p + 1): a pair's low halves (elements 0-15 of each) fill one 256-bit vector, the two
// blocks alternating in groups of 4 bytes, and its high halves another, weights and activations
// alike, so after the integer dot products (exact) 32-bit lane l holds block 2p + l % 2's sums and
// each lane's scale is one of two fp16 numbers read together. Per output element, per pair:
// acc = fma(isum * dw, dx, acc) in 8 float lanes, pairs in order, then the fixed 8-lane sum and
// Q4_1's minimum term (an 8-lane sum of mw * s over the blocks). The same sequence for every row,
// whatever the row count or the tile.
// Three implementations of that one arithmetic, chosen at run time (CPUID through
// __builtin_cpu_supports, never by the build's flags, so one build serves every x86 CPU and a test
// can force each in turn; `int8_paths()` lists this CPU's, `set_int8_path` picks one):
//   - scalar: plain C++, every CPU;
//   - avx2: maddubs / madd on 256-bit vectors, a tile of rows x columns straight from the weights;
//   - avx512-vnni: vpdpbusd on 512-bit vectors holding two output columns (8 lanes each), the weights
//     widened (nibbles to bytes, fp16 scales to floats, Q8_0's offset sums) in registers for a few rows
//     and once per thread and column block into a buffer for many (int8_rows_vnni), so the integer
//     work of a lane is two instructions and its float work the same three as on AVX2.
// An integer dot product is exact whatever computes it, so the three give the same bits.
enum Int8Path : int { INT8_SCALAR = 0, INT8_AVX2 = 1, INT8_VNNI = 2 };
constexpr const char* INT8_PATH_NAMES[] = {"scalar", "avx2", "avx512-vnni"};

#if defined(__x86_64__)
#define X86_INT8 1
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#else
#define X86_INT8 0
#endif

bool int8_path_available(int path) {
#if X86_INT8
  if (path == INT8_AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (path == INT8_VNNI)
    return int8_path_available(INT8_AVX2) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
#endif
  return path == INT8_SCALAR;
}

int best_int8_path() {
  for (int path : {INT8_VNNI, INT8_AVX2})
    if (int8_path_available(path)) return path;
  return INT8_SCALAR;
}

int g_int8_path = best_int8_path();  // set once at import, or by a test through set_int8_path
bool g_int8_auto = true;             // the path follows the row count (below)

// auto: avx512-vnni from 2 rows; one row (a plain step, bound by memory) measures the same either way
// and keeps avx2's tile. The shipped model's gguf-q8 forward + logits over a 100-token cache, one run,
// 2-core Zen 5, ms avx2 / avx512-vnni: 1 row 2.90 / 2.89, 2 rows 3.35 / 3.03, 4 rows 5.18 / 3.92,
// 8 rows 9.67 / 6.61, 16 rows 18.6 / 12.2, 64 rows 74.4 / 47.5.
constexpr int64_t VNNI_FEWEST_ROWS = 2;
constexpr int64_t VNNI_DIRECT_ROWS = 8;  // see int8_rows_vnni

inline int int8_path_for(int64_t n) {
  return g_int8_auto && n < VNNI_FEWEST_ROWS && g_int8_path == INT8_VNNI ? INT8_AVX2 : g_int8_path;
}

struct ActivationBlocks {
  int64_t n, blocks, pairs, padded;  // padded: blocks rounded up to whole 8-lane vectors
  std::vector<int8_t> q;             // [n, pairs * 64], pair order, zero in a padding block
  std::vector<float> scale;          // [n, pairs * 8]: d of block 2p in even lanes, of 2p + 1 in odd ones
  std::vector<float> sums;           // [n, padded]: each block's d * sum(q), zero past the last block
};

inline float hsum8_scalar(const float* v) {  // hsum8's tree, on scalars
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// one block of 32 inputs to 8 bits: its scale d = amax / 127, q = x / d rounded to nearest (ties to
// even: the CPU's rounding, the same in both versions), written at block b's places of the pair order
#if X86_INT8
AVX2_TARGET inline void quantize_block_avx2(const float* v, int64_t b, int8_t* q, float& d, int32_t& sum) {
  __m256 x[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  d = _mm_cvtss_f32(m) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  sum = _mm_cvtsi128_si32(t);
  // (packs work within 128-bit lanes: the permute puts the 32 bytes back in element order)
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  alignas(32) int8_t ordered[QBLOCK];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ordered), bytes);
  for (int i = 0; i < QBLOCK; i += 4) std::memcpy(q + pair_offset(b, i), ordered + i, 4);
}
#endif

inline void quantize_block_scalar(const float* v, int64_t b, int8_t* q, float& d, int32_t& sum) {
  float amax = 0.0f;
  for (int i = 0; i < QBLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
  d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  sum = 0;
  for (int i = 0; i < QBLOCK; ++i) {
    const int32_t value = static_cast<int32_t>(std::nearbyint(v[i] * inverse));
    q[pair_offset(b, i)] = static_cast<int8_t>(value);
    sum += value;
  }
}

// rows to 8-bit blocks, each row on its own; in parallel from QUANTIZE_PARALLEL_ROWS rows (a row's
// numbers never depend on which thread rounds it; below, a parallel region costs more than it saves:
// 2-core Zen 5, a 4-row forward 4.97 -> 7.25 ms with every product's rounding split)
constexpr int64_t QUANTIZE_PARALLEL_ROWS = 16;

ActivationBlocks quantize_rows(const float* x, int64_t n, int64_t k, int path) {
  const int64_t blocks = k / QBLOCK, pairs = (blocks + 1) / 2;
  ActivationBlocks a{n, blocks, pairs, (blocks + 7) / 8 * 8, {}, {}, {}};
  a.q.assign(n * pairs * 64, 0);
  a.scale.assign(n * pairs * 8, 0.0f);
  a.sums.assign(n * a.padded, 0.0f);
  auto round_rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* v = x + r * k + b * QBLOCK;
        int8_t* q = a.q.data() + r * pairs * 64;
        float d;
        int32_t sum;
#if X86_INT8
        if (path != INT8_SCALAR) quantize_block_avx2(v, b, q, d, sum);
        else quantize_block_scalar(v, b, q, d, sum);
#else
        quantize_block_scalar(v, b, q, d, sum);
#endif
        for (int64_t l = b % 2; l < 8; l += 2) a.scale[r * pairs * 8 + (b / 2) * 8 + l] = d;
        a.sums[r * a.padded + b] = d * static_cast<float>(sum);
      }
  };
  if (n < QUANTIZE_PARALLEL_ROWS) round_rows(0, n);
  else at::parallel_for(0, n, 1, round_rows);
  return a;
}

#if X86_INT8
AVX2_TARGET inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // v[i] + v[i + 4]
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));                                          // (0 + 2), (1 + 3)
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// Q4_1's minimum term: sum over blocks of m * (d * sum(q)), in 8 lanes, blocks in order
AVX2_TARGET inline __m256 minimum_sums(const uint16_t* m16, const float* sx, int64_t padded) {
  __m256 m = _mm256_setzero_ps();
  for (int64_t b = 0; b < padded; b += 8) {
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m16 + b)));
    m = _mm256_fmadd_ps(mw, _mm256_loadu_ps(sx + b), m);
  }
  return m;
}

// R rows x C columns: w the first column's quants (stride bytes apart), d16 / m16 its fp16 scales
template <int FMT, int R, int C>
AVX2_TARGET inline void int8_columns_avx2(const ActivationBlocks& a, int64_t row, const uint8_t* w, int64_t stride,
                                          const uint16_t* d16, const uint16_t* m16, int64_t padded, float* out,
                                          int64_t ldo) {
  const int64_t pairs = a.pairs, lane_stride = pairs * 8;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0f);
  constexpr int64_t pair_bytes = FMT == Q4_1 ? 32 : 64;
  for (int64_t p = 0; p < pairs; ++p) {
    // the bytes 4 column groups on, at this place: memory latency, not arithmetic, bounds a one-row
    // step (1 or 8 groups on did less)
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * C * stride + p * pair_bytes), _MM_HINT_T0);
    if constexpr (FMT == Q8_0)
      _mm_prefetch(reinterpret_cast<const char*>(w + 4 * C * stride + p * pair_bytes + 32), _MM_HINT_T0);
    __m256i low[C], high[C];
    __m256 dw[C];  // d of blocks 2p and 2p + 1, alternating, as the lanes hold them
    for (int c = 0; c < C; ++c) {
      int32_t both;
      std::memcpy(&both, d16 + c * padded + 2 * p, 4);
      dw[c] = _mm256_cvtph_ps(_mm_set1_epi32(both));
      if constexpr (FMT == Q4_1) {  // low nibbles: elements 0-15 of both blocks; high: 16-31
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * stride + p * 32));
        low[c] = _mm256_and_si256(v, nibble);
        high[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      } else {
        low[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * stride + p * 64));
        high[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * stride + p * 64 + 32));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = a.q.data() + (row + r) * pairs * 64 + p * 64;
      const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
      const __m256 dx = _mm256_loadu_ps(a.scale.data() + (row + r) * lane_stride + p * 8);
      for (int c = 0; c < C; ++c) {
        __m256i isum;
        if constexpr (FMT == Q4_1) {  // nibble x byte pairs stay within 16 bits, two halves too (<= 7620)
          const __m256i pairs16 = _mm256_add_epi16(_mm256_maddubs_epi16(low[c], x_low),
                                                   _mm256_maddubs_epi16(high[c], x_high));
          isum = _mm256_madd_epi16(pairs16, ones);
        } else {  // maddubs multiplies unsigned by signed bytes: Q8_0's sign moves onto the activation
          const __m256i lo = _mm256_maddubs_epi16(_mm256_sign_epi8(low[c], low[c]),
                                                  _mm256_sign_epi8(x_low, low[c]));
          const __m256i hi = _mm256_maddubs_epi16(_mm256_sign_epi8(high[c], high[c]),
                                                  _mm256_sign_epi8(x_high, high[c]));
          isum = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
        }
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), dw[c]);
        acc[r][c] = _mm256_fmadd_ps(scaled, dx, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float value = hsum8(acc[r][c]);
      if constexpr (FMT == Q4_1)
        value += hsum8(minimum_sums(m16 + c * padded, a.sums.data() + (row + r) * padded, padded));
      out[r * ldo + c] = value;
    }
}
#endif

// the same arithmetic on scalars (lane l of a pair: elements 4j..4j+3 and 16+4j..16+4j+3, j = l / 2, of
// block 2p + l % 2)
template <int FMT, int R, int C>
inline void int8_columns_scalar(const ActivationBlocks& a, int64_t row, const uint8_t* w, int64_t stride,
                                const uint16_t* d16, const uint16_t* m16, int64_t padded, float* out, int64_t ldo) {
  const int64_t pairs = a.pairs, lane_stride = pairs * 8;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int8_t* xq = a.q.data() + (row + r) * pairs * 64;
      const uint8_t* wq = w + c * stride;
      float acc[8] = {}, mins[8] = {};
      for (int64_t p = 0; p < pairs; ++p)
        for (int l = 0; l < 8; ++l) {
          int32_t isum = 0;
          for (int half = 0; half < 2; ++half)
            for (int i = 0; i < 4; ++i) {
              // pair order: 4-byte group l holds block 2p + l % 2 (`pair_offset`)
              const int64_t at = p * 64 + half * 32 + 4 * l + i;
              const uint8_t packed = wq[p * 32 + 4 * l + i];  // Q4_1: low nibbles the low half, high the high
              const int32_t wi = FMT == Q4_1 ? (half == 0 ? packed & 0x0f : packed >> 4)
                                             : static_cast<int8_t>(wq[at]);
              isum += wi * xq[at];
            }
          const float scaled = static_cast<float>(isum) * half_to_float(d16[c * padded + 2 * p + l % 2]);
          acc[l] = std::fma(scaled, a.scale[(row + r) * lane_stride + p * 8 + l], acc[l]);
        }
      float value = hsum8_scalar(acc);
      if (FMT == Q4_1) {
        for (int64_t b = 0; b < padded; ++b)
          mins[b % 8] = std::fma(half_to_float(m16[c * padded + b]), a.sums[(row + r) * padded + b], mins[b % 8]);
        value += hsum8_scalar(mins);
      }
      out[r * ldo + c] = value;
    }
}

template <int FMT, int R, int C, int PATH>
inline void int8_columns(const ActivationBlocks& a, int64_t row, const uint8_t* w, int64_t stride,
                         const uint16_t* d16, const uint16_t* m16, int64_t padded, float* out, int64_t ldo) {
#if X86_INT8
  if constexpr (PATH == INT8_AVX2) {
    int8_columns_avx2<FMT, R, C>(a, row, w, stride, d16, m16, padded, out, ldo);
    return;
  }
#endif
  int8_columns_scalar<FMT, R, C>(a, row, w, stride, d16, m16, padded, out, ldo);
}

template <int FMT, int R, int PATH>
inline void int8_block(const ActivationBlocks& a, int64_t row, const Weight& w, int64_t first, int64_t cols,
                       float* out) {
  // R * C accumulators, 2 C weight halves and C scales within 16 ymm registers (measured on a Zen 3:
  // 2 columns from 3 rows on spill, 4 at one row are slower)
  constexpr int C = FMT == Q4_1 && R <= 2 ? 2 : 1;
  const int64_t stride = w.quant_stride;
  const uint8_t* q = w.quant_bytes + first * stride;
  const uint16_t* m16 = FMT == Q4_1 ? w.m16 + first * w.padded : nullptr;
  float* o = out + row * w.out + first;
  int64_t c = 0;
  for (; c + C <= cols; c += C)
    int8_columns<FMT, R, C, PATH>(a, row, q + c * stride, stride, w.d16 + (first + c) * w.padded,
                                  m16 ? m16 + c * w.padded : nullptr, w.padded, o + c, w.out);
  for (; c < cols; ++c)
    int8_columns<FMT, R, 1, PATH>(a, row, q + c * stride, stride, w.d16 + (first + c) * w.padded,
                                  m16 ? m16 + c * w.padded : nullptr, w.padded, o + c, w.out);
}

template <int FMT, int PATH>
inline void int8_rows(const ActivationBlocks& a, const Weight& w, int64_t first, int64_t cols, float* out) {
  for (int64_t r = 0; r < a.n; r += 4) {
    switch (std::min<int64_t>(a.n - r, 4)) {
      case 1: int8_block<FMT, 1, PATH>(a, r, w, first, cols, out); break;
      case 2: int8_block<FMT, 2, PATH>(a, r, w, first, cols, out); break;
      case 3: int8_block<FMT, 3, PATH>(a, r, w, first, cols, out); break;
      default: int8_block<FMT, 4, PATH>(a, r, w, first, cols, out); break;
    }
  }
}

#if X86_INT8
// ---- avx512-vnni: two columns a register -------------------------------------------------------
// A column pair's pair p, widened once per thread and column block (VnniPair, 256 bytes): lanes
// 0-7 are column c, lanes 8-15 column c + 1 (c itself again for an odd last column, never stored).
// Q4_1: the nibbles as bytes (unsigned, vpdpbusd's first operand). Q8_0: the signed weights, and
// `base` = -128 * (a lane's 8 weights summed), so that starting each lane's integer sum there and
// multiplying by the activations + 128 (unsigned) leaves exactly the signed dot product.
struct alignas(64) VnniPair {
  __m512i low, high;
  __m512 dw;
  __m512i base;
};

struct VnniBuffer {
  std::vector<VnniPair> pairs;  // [column pairs, pairs]
  std::vector<__m512> mins;     // Q4_1: [column pairs, padded / 8], m of 8 blocks of each column
};

VNNI_TARGET inline __m512i two_columns(const uint8_t* w0, const uint8_t* w1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1)), 1);
}

VNNI_TARGET inline __m512 two_halves(const uint16_t* h0, const uint16_t* h1) {  // 8 fp16 of each column
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(h1)), 1));
}

// column pair (c0, c1)'s pair p as vpdpbusd takes it
template <int FMT>
VNNI_TARGET inline VnniPair widen_pair(const Weight& w, int64_t c0, int64_t c1, int64_t p) {
  constexpr int64_t pair_bytes = FMT == Q4_1 ? 32 : 64;
  const uint8_t* w0 = w.quant_bytes + c0 * w.quant_stride + p * pair_bytes;
  const uint8_t* w1 = w.quant_bytes + c1 * w.quant_stride + p * pair_bytes;
  VnniPair v;
  if constexpr (FMT == Q4_1) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i packed = two_columns(w0, w1);
    v.low = _mm512_and_si512(packed, nibble);
    v.high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    v.base = _mm512_setzero_si512();
  } else {
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    v.low = two_columns(w0, w1);
    v.high = two_columns(w0 + 32, w1 + 32);
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, v.low),
                                            offset, v.high);
    v.base = _mm512_sub_epi32(_mm512_setzero_si512(), sum);
  }
  int32_t d0, d1;
  std::memcpy(&d0, w.d16 + c0 * w.padded + 2 * p, 4);
  std::memcpy(&d1, w.d16 + c1 * w.padded + 2 * p, 4);
  v.dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32(d0)),
                                                 _mm_set1_epi32(d1), 1));
  return v;
}

// the bytes of pair p of columns c0 + PREFETCH_COLUMNS and the next one: a few rows are bound by memory's
// latency (2-core Zen 5, the shipped model's gguf-q8 forward of 4 rows: 4.44 -> 3.73 ms)
constexpr int64_t PREFETCH_COLUMNS = 8;

template <int FMT>
VNNI_TARGET inline void prefetch_ahead(const Weight& w, int64_t c0, int64_t p) {
  constexpr int64_t pair_bytes = FMT == Q4_1 ? 32 : 64;
  const uint8_t* ahead = w.quant_bytes + (c0 + PREFETCH_COLUMNS) * w.quant_stride + p * pair_bytes;
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(ahead + w.quant_stride), _MM_HINT_T0);
  if constexpr (FMT == Q8_0) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + w.quant_stride + 32), _MM_HINT_T0);
  }
}

// Q4_1: m of blocks 8g..8g+7 of columns c0 and c1
VNNI_TARGET inline __m512 widen_mins(const Weight& w, int64_t c0, int64_t c1, int64_t g) {
  return two_halves(w.m16 + c0 * w.padded + 8 * g, w.m16 + c1 * w.padded + 8 * g);
}

template <int FMT>
VNNI_TARGET inline void widen_vnni(const Weight& w, int64_t first, int64_t cols, int64_t pairs, VnniBuffer& dst) {
  const int64_t column_pairs = (cols + 1) / 2, groups = w.padded / 8;
  dst.pairs.resize(column_pairs * pairs);
  if constexpr (FMT == Q4_1) dst.mins.resize(column_pairs * groups);
  for (int64_t cp = 0; cp < column_pairs; ++cp) {
    const int64_t c0 = first + 2 * cp, c1 = std::min(c0 + 1, first + cols - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      prefetch_ahead<FMT>(w, c0, p);
      dst.pairs[cp * pairs + p] = widen_pair<FMT>(w, c0, c1, p);
    }
    if constexpr (FMT == Q4_1)
      for (int64_t g = 0; g < groups; ++g) dst.mins[cp * groups + g] = widen_mins(w, c0, c1, g);
  }
}

// Where a tile reads its column pairs: the thread's widened buffer (many rows: widened once, read by every
// row tile), or the weights themselves (a few rows: widened in registers, once per tile and pair)
struct FromBuffer {
  static constexpr bool in_registers = false;
  const VnniBuffer& buffer;
  int64_t pairs, groups, cp0;
  VNNI_TARGET const VnniPair& pair(int c, int64_t p) const { return buffer.pairs[(cp0 + c) * pairs + p]; }
  VNNI_TARGET __m512 mins(int c, int64_t g) const { return buffer.mins[(cp0 + c) * groups + g]; }
};

template <int FMT>
struct FromWeights {
  static constexpr bool in_registers = true;
  const Weight& w;
  int64_t first, last;  // the tile's first and last column
  VNNI_TARGET VnniPair pair(int c, int64_t p) const {
    prefetch_ahead<FMT>(w, first + 2 * c, p);
    return widen_pair<FMT>(w, first + 2 * c, std::min(first + 2 * c + 1, last), p);
  }
  VNNI_TARGET __m512 mins(int c, int64_t g) const {
    return widen_mins(w, first + 2 * c, std::min(first + 2 * c + 1, last), g);
  }
};

VNNI_TARGET inline __m512 broadcast8(const float* p) {  // 8 floats into both halves
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))));
}

// hsum8's tree on each half at once: lane 0 holds the low half's sum, lane 8 the high half's
VNNI_TARGET inline __m512 hsum8_halves(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));  // v[i] + v[i + 4]
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));        // (0 + 2), (1 + 3)
  return _mm512_add_ps(v, _mm512_movehdup_ps(v));          // + (1 + 3)
}

template <int FMT>
VNNI_TARGET inline void vnni_lanes(const VnniPair& pair, __m512i x_low, __m512i x_high, __m512 dx, __m512& acc) {
  __m512i isum;
  if constexpr (FMT == Q4_1)
    isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), pair.low, x_low), pair.high, x_high);
  else
    isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(pair.base, x_low, pair.low), x_high, pair.high);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), pair.dw), dx, acc);
}

// R rows x CP column pairs (the tile's `cols` columns from `first`), read through `src`
template <int FMT, int R, int CP, typename Source>
VNNI_TARGET inline void vnni_tile(const ActivationBlocks& a, int64_t row, const Source& src, const Weight& w,
                                  int64_t first, int64_t cols, float* out) {
  const int64_t pairs = a.pairs;
  __m512 acc[R][CP];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CP; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t p = 0; p < pairs; ++p) {
    VnniPair held[Source::in_registers ? CP : 1];
    if constexpr (Source::in_registers)
      for (int c = 0; c < CP; ++c) held[c] = src.pair(c, p);
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = a.q.data() + (row + r) * pairs * 64 + p * 64;
      __m512i x_low = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
      __m512i x_high = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32)));
      if constexpr (FMT == Q8_0) {  // x + 128, unsigned
        x_low = _mm512_xor_si512(x_low, offset);
        x_high = _mm512_xor_si512(x_high, offset);
      }
      const __m512 dx = broadcast8(a.scale.data() + (row + r) * pairs * 8 + p * 8);
      for (int c = 0; c < CP; ++c) {
        if constexpr (Source::in_registers) vnni_lanes<FMT>(held[c], x_low, x_high, dx, acc[r][c]);
        else vnni_lanes<FMT>(src.pair(c, p), x_low, x_high, dx, acc[r][c]);
      }
    }
  }
  const int64_t groups = w.padded / 8;
  for (int c = 0; c < CP; ++c)
    for (int r = 0; r < R; ++r) {
      __m512 total = hsum8_halves(acc[r][c]);
      if constexpr (FMT == Q4_1) {  // + the minimum term, its own 8 lanes and tree
        const float* sx = a.sums.data() + (row + r) * w.padded;
        __m512 mins = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) mins = _mm512_fmadd_ps(src.mins(c, g), broadcast8(sx + 8 * g), mins);
        total = _mm512_add_ps(total, hsum8_halves(mins));
      }
      float* o = out + (row + r) * w.out + first + 2 * c;
      o[0] = _mm512_cvtss_f32(total);
      if (2 * c + 1 < cols) o[1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(total, 2));
    }
}

// rows [row, row + R) of a column block: tiles of CP column pairs, then one pair at a time
template <int FMT, int R, int CP, typename MakeSource>
VNNI_TARGET inline void vnni_rows(const ActivationBlocks& a, int64_t row, const MakeSource& source, const Weight& w,
                                  int64_t first, int64_t cols, float* out) {
  int64_t c = 0;
  for (; c + 2 * CP <= cols; c += 2 * CP)
    vnni_tile<FMT, R, CP>(a, row, source(c, 2 * CP), w, first + c, 2 * CP, out);
  for (; c < cols; c += 2) {
    const int64_t width = std::min<int64_t>(2, cols - c);
    vnni_tile<FMT, R, 1>(a, row, source(c, width), w, first + c, width, out);
  }
}

template <int FMT, int CP, typename MakeSource>
VNNI_TARGET inline void vnni_row_groups(const ActivationBlocks& a, const MakeSource& source, const Weight& w,
                                        int64_t first, int64_t cols, float* out) {
  for (int64_t r = 0; r < a.n; r += 4) {
    switch (std::min<int64_t>(a.n - r, 4)) {
      case 1: vnni_rows<FMT, 1, CP>(a, r, source, w, first, cols, out); break;
      case 2: vnni_rows<FMT, 2, CP>(a, r, source, w, first, cols, out); break;
      case 3: vnni_rows<FMT, 3, CP>(a, r, source, w, first, cols, out); break;
      default: vnni_rows<FMT, 4, CP>(a, r, source, w, first, cols, out); break;
    }
  }
}

// Up to VNNI_DIRECT_ROWS rows each weight is read by few rows: widened in registers where it is used;
// beyond, widened once per thread and column block into the buffer every row tile reads.
template <int FMT>
VNNI_TARGET void int8_rows_vnni(const ActivationBlocks& a, const Weight& w, int64_t first, int64_t cols, float* out,
                                VnniBuffer& buffer) {
  if (a.n <= VNNI_DIRECT_ROWS) {
    // 2 column pairs: R x 2 accumulators, 2 x 4 widened registers and a row's 3 within 32 zmm
    vnni_row_groups<FMT, 2>(a, [&](int64_t c, int64_t width) {
      return FromWeights<FMT>{w, first + c, first + c + width - 1};
    }, w, first, cols, out);
    return;
  }
  widen_vnni<FMT>(w, first, cols, a.pairs, buffer);
  const int64_t groups = w.padded / 8;
  // 4 column pairs: R x 4 accumulators and a row's 3 registers, the weights read from the buffer
  vnni_row_groups<FMT, 4>(a, [&](int64_t c, int64_t) { return FromBuffer{buffer, a.pairs, groups, c / 2}; },
                          w, first, cols, out);
}
#else
struct VnniBuffer {};
#endif

inline void add_bias(const Weight& w, int64_t n, int64_t first, int64_t cols, float* out) {
  if (!w.bias.defined()) return;
  const float* b = w.bias.data_ptr<float>() + first;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < cols; ++c) out[i * w.out + first + c] += b[c];
}

// one column block of the 8-bit product by `path`
template <int FMT>
inline void int8_column_block(const ActivationBlocks& a, const Weight& w, int64_t first, int64_t cols, float* out,
                              int path, VnniBuffer& buffer) {
#if X86_INT8
  if (path == INT8_VNNI) return int8_rows_vnni<FMT>(a, w, first, cols, out, buffer);
  if (path == INT8_AVX2) return int8_rows<FMT, INT8_AVX2>(a, w, first, cols, out);
#endif
  int8_rows<FMT, INT8_SCALAR>(a, w, first, cols, out);
}

// out [n, w.out] = x [n, w.in] @ w.T (+ bias), the activations rounded to 8-bit blocks per row
void int8_matmul_into(const float* x, int64_t n, const Weight& w, float* out) {
  const int path = int8_path_for(n);
  const ActivationBlocks a = quantize_rows(x, n, w.in, path);
  const int64_t blocks = (w.out + COL_BLOCK - 1) / COL_BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local VnniBuffer buffer;  // kept by each thread: no allocation per product
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * COL_BLOCK, cols = std::min(COL_BLOCK, w.out - first);
      if (w.format == Q4_1) int8_column_block<Q4_1>(a, w, first, cols, out, path, buffer);
      else int8_column_block<Q8_0>(a, w, first, cols, out, path, buffer);
      add_bias(w, n, first, cols, out);
    }
  });
}

// out [n, w.out] = x [n, w.in] @ w.T (+ bias)
void matmul_into(const float* x, int64_t n, const Weight& w, float* out) {
  if (w.int8) return int8_matmul_into(x, n, w, out);
  const int64_t blocks = (w.out + COL_BLOCK - 1) / COL_BLOCK;
  // (bf16 in 32-number steps like a quantised block, where the width allows)
  const bool direct = (w.format >= Q8_0 || (w.format == BF16 && w.in % QBLOCK == 0)) && n <= DIRECT_ROWS;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(w.format == F32 || direct ? 0 : COL_BLOCK * w.in);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * COL_BLOCK, cols = std::min(COL_BLOCK, w.out - first);
      if (direct && w.format == Q4_1) {
        direct_rows<Q4_1>(x, n, w, first, cols, out);
      } else if (direct && w.format == Q8_0) {
        direct_rows<Q8_0>(x, n, w, first, cols, out);
      } else if (direct) {
        direct_rows<BF16>(x, n, w, first, cols, out);
      } else {
        const float* wb = w.rows(first, cols, scratch.data());  // [cols, in]
        int64_t r = 0;
        for (; r + TILE_ROWS <= n; r += TILE_ROWS)
          tile_row_block<TILE_ROWS>(x + r * w.in, w.in, wb, w.in, out + r * w.out + first, w.out, cols);
        if (r < n) tail_rows(n - r, x + r * w.in, w.in, wb, out + r * w.out + first, w.out, cols);
      }
      add_bias(w, n, first, cols, out);
    }
  });
}

void rms_norm_row(const float* x, const float* weight, float* y, int64_t h, float eps) {
  v16f acc{};
  for (int64_t i = 0; i < h; i += LANES) {
    const v16f v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  const float variance = hsum(acc) / static_cast<float>(h);
  const float inverse = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < h; ++i) y[i] = weight[i] * (x[i] * inverse);
}

// row-wise work of a few rows runs on the calling thread: a parallel region costs more than it
// saves there (the per-row arithmetic is the same either way)
constexpr int64_t PARALLEL_ROWS = 4;
constexpr int64_t PARALLEL_KEYS = 4096;  // attention: (row, head, key) triples below which one thread serves
template <typename F>
inline void for_rows(int64_t n, const F& f) {
  if (n < PARALLEL_ROWS) f(int64_t{0}, n);
  else at::parallel_for(0, n, 1, f);
}

void rms_norm(const float* x, const float* weight, float* y, int64_t n, int64_t h, float eps) {
  for_rows(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * h, weight, y + r * h, h, eps);
  });
}

// RoPE as transformers applies it: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
void rotate(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  float rotated[512];
  for (int64_t i = 0; i < half; ++i) {
    rotated[i] = -x[i + half];
    rotated[i + half] = x[i];
  }
  for (int64_t i = 0; i < d; ++i) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

struct Config {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;  // fp32 [H]
  Weight qkv, out, gate_up, down;
};

// Attention's two sums, each lane's fused multiply-adds in the order of a plain 16-lane loop, but
// several keys (scores) or value chunks (outputs) in flight at once, in registers: independent
// chains the CPU overlaps, where one chain at a time waited on each FMA's latency.
constexpr int KEYS_AT_ONCE = 4, CHUNKS_AT_ONCE = 4;

// scores[j] = dot(q, key[j]) * scale over d: lane l sums i = l, l + 16, ... then the fixed tree
template <int J>
inline void key_dots(const float* q, const float* const* key, int64_t d, float scale, float* scores) {
#if defined(HALF_LANES)
  v8f low[J], high[J];
  for (int j = 0; j < J; ++j) low[j] = high[j] = v8f{};
  for (int64_t i = 0; i < d; i += LANES) {
    const v8f q_low = vload8(q + i), q_high = vload8(q + i + 8);
    for (int j = 0; j < J; ++j) {
      low[j] = vfma8(q_low, vload8(key[j] + i), low[j]);
      high[j] = vfma8(q_high, vload8(key[j] + i + 8), high[j]);
    }
  }
  for (int j = 0; j < J; ++j) scores[j] = hsum_halves(low[j], high[j]) * scale;
#else
  v16f acc[J];
  for (int j = 0; j < J; ++j) acc[j] = v16f{};
  for (int64_t i = 0; i < d; i += LANES) {
    const v16f qv = vload(q + i);
    for (int j = 0; j < J; ++j) acc[j] = vfma(qv, vload(key[j] + i), acc[j]);
  }
  for (int j = 0; j < J; ++j) scores[j] = hsum(acc[j]) * scale;
#endif
}

// out[first, first + 16C) = sum over t of weight[t] * value(t)[...] (t ascending), times inverse
template <int C, typename ValueAt>
inline void weighted_values(const float* weight, int64_t total, const ValueAt& value_at, int64_t first, float inverse,
                            float* out) {
#if defined(HALF_LANES)
  v8f acc[2 * C];
  for (int c = 0; c < 2 * C; ++c) acc[c] = v8f{};
  for (int64_t t = 0; t < total; ++t) {
    const float* value = value_at(t) + first;
    const v8f w = (v8f)_mm256_set1_ps(weight[t]);  // a broadcast (0 + x would turn -0 into +0)
    for (int c = 0; c < 2 * C; ++c) acc[c] = vfma8(w, vload8(value + 8 * c), acc[c]);
  }
  for (int c = 0; c < 2 * C; ++c) {
    const v8f scaled = acc[c] * inverse;
    std::memcpy(out + first + 8 * c, &scaled, sizeof scaled);
  }
#else
  v16f acc[C];
  for (int c = 0; c < C; ++c) acc[c] = v16f{};
  for (int64_t t = 0; t < total; ++t) {
    const float* value = value_at(t) + first;
    const v16f w = vset(weight[t]);
    for (int c = 0; c < C; ++c) acc[c] = vfma(w, vload(value + c * LANES), acc[c]);
  }
  for (int c = 0; c < C; ++c) vstore(out + first + c * LANES, acc[c] * inverse);
#endif
}

// scores[0, total) -> e^(score - max) in place (padding to whole vectors: 0); returns 1 / their sum.
// Each in one fixed order: the max, then the exponentials and their 16-lane sum in key order.
inline float softmax_weights(float* scores, int64_t total) {
  const int64_t padded = (total + LANES - 1) / LANES * LANES;
  for (int64_t t = total; t < padded; ++t) scores[t] = -INFINITY;
  v16f top = vset(-INFINITY);
  for (int64_t t = 0; t < padded; t += LANES) top = vmax(top, vload(&scores[t]));
  const v16f peak = vset(hmax(top));
  v16f sum{};
  for (int64_t t = 0; t < padded; t += LANES) {
    v16f p = vexp(vload(&scores[t]) - peak);
    if (t + LANES > total)  // padding lanes weigh nothing
      for (int64_t l = total - t; l < LANES; ++l) p[l] = 0.0f;
    vstore(&scores[t], p);
    sum = sum + p;
  }
  return 1.0f / hsum(sum);
}

// one query row and head over the keys it sees: rows [0, past) of the cache, then the new rows
// `seen` (position order). scores -> max -> exp -> sum -> weighted values, each in one fixed order.
void attend_one(const float* q, const float* keys, const float* values, int64_t past, const int64_t* seen,
                int64_t seen_count, int64_t d, float scale, float* out, std::vector<float>& scores) {
  const int64_t total = past + seen_count, padded = (total + LANES - 1) / LANES * LANES;
  scores.resize(padded);
  auto key_at = [&](int64_t t) { return keys + (t < past ? t : past + seen[t - past]) * d; };
  int64_t t = 0;
  for (; t + KEYS_AT_ONCE <= total; t += KEYS_AT_ONCE) {
    const float* some[KEYS_AT_ONCE];
    for (int j = 0; j < KEYS_AT_ONCE; ++j) some[j] = key_at(t + j);
    key_dots<KEYS_AT_ONCE>(q, some, d, scale, &scores[t]);
  }
  for (; t < total; ++t) {
    const float* one[1] = {key_at(t)};
    key_dots<1>(q, one, d, scale, &scores[t]);
  }
  const float inverse = softmax_weights(scores.data(), total);
  const int64_t chunks = d / LANES;
  auto value_at = [&](int64_t t) { return values + (t < past ? t : past + seen[t - past]) * d; };
  int64_t c = 0;
  for (; c + CHUNKS_AT_ONCE <= chunks; c += CHUNKS_AT_ONCE)
    weighted_values<CHUNKS_AT_ONCE>(scores.data(), total, value_at, c * LANES, inverse, out);
  for (; c < chunks; ++c) weighted_values<1>(scores.data(), total, value_at, c * LANES, inverse, out);
}

#if !defined(HALF_LANES)
// Several queries of one KV group (its heads, one or more rows) that see the same first `shared` keys
// (the cache, then the new rows their `seen` lists have in common): each shared key and value is loaded
// once for all of them, and each query's arithmetic is attend_one's, term for term (a key's score is
// the same dot product; the softmax is softmax_weights; each output lane sums its keys in order).
constexpr int SHARED_QUERIES = 6;  // 6 x 4 accumulators and a value's 4 registers within 32 zmm

struct AttentionQuery {
  const float* q;
  const int64_t* seen;  // the new rows it sees, in position order
  int64_t seen_count;
  float* out;
};

void attend_shared(const AttentionQuery* queries, int count, const float* keys, const float* values, int64_t past,
                   int64_t shared_new, int64_t d, float scale, std::vector<float>* scores) {
  const int64_t shared = past + shared_new;
  auto position = [&](const AttentionQuery& query, int64_t t) { return t < past ? t : past + query.seen[t - past]; };
  for (int g = 0; g < count; ++g) scores[g].resize((past + queries[g].seen_count + LANES - 1) / LANES * LANES);
  for (int64_t t = 0; t < shared; ++t) {  // shared keys: loaded once, each query's score key_dots' own
    const float* key[1] = {keys + position(queries[0], t) * d};
    for (int g = 0; g < count; ++g) key_dots<1>(queries[g].q, key, d, scale, &scores[g][t]);
  }
  float inverse[SHARED_QUERIES];
  for (int g = 0; g < count; ++g) {  // each query's own keys, then its softmax
    const AttentionQuery& query = queries[g];
    const int64_t total = past + query.seen_count;
    for (int64_t t = shared; t < total; ++t) {
      const float* one[1] = {keys + position(query, t) * d};
      key_dots<1>(query.q, one, d, scale, &scores[g][t]);
    }
    inverse[g] = softmax_weights(scores[g].data(), total);
  }
  for (int64_t first = 0; first < d; first += CHUNKS_AT_ONCE * LANES) {
    const int chunks = static_cast<int>(std::min<int64_t>(CHUNKS_AT_ONCE, (d - first) / LANES));
    v16f acc[SHARED_QUERIES][CHUNKS_AT_ONCE];
    for (int g = 0; g < count; ++g)
      for (int c = 0; c < chunks; ++c) acc[g][c] = v16f{};
    for (int64_t t = 0; t < shared; ++t) {  // shared values: loaded once
      const float* value = values + position(queries[0], t) * d + first;
      v16f v[CHUNKS_AT_ONCE];
      for (int c = 0; c < chunks; ++c) v[c] = vload(value + c * LANES);
      for (int g = 0; g < count; ++g) {
        const v16f w = vset(scores[g][t]);
        for (int c = 0; c < chunks; ++c) acc[g][c] = vfma(w, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < count; ++g) {
      const AttentionQuery& query = queries[g];
      for (int64_t t = shared; t < past + query.seen_count; ++t) {
        const float* value = values + position(query, t) * d + first;
        const v16f w = vset(scores[g][t]);
        for (int c = 0; c < chunks; ++c) acc[g][c] = vfma(w, vload(value + c * LANES), acc[g][c]);
      }
      for (int c = 0; c < chunks; ++c) vstore(query.out + first + c * LANES, acc[g][c] * inverse[g]);
    }
  }
}
#endif

class Model {
 public:
  Model(Config config, std::vector<Layer> layers, Weight embed, torch::Tensor final_norm, Weight lm_head,
        torch::Tensor cos, torch::Tensor sin)
      : cfg(config), layers(std::move(layers)), embed(std::move(embed)), final_norm(final_norm.contiguous()),
        lm_head(std::move(lm_head)), cos(cos.contiguous()), sin(sin.contiguous()) {
    TORCH_CHECK(cfg.head_dim % LANES == 0 && cfg.head_dim <= 512, "head_dim must be a multiple of 16, <= 512");
    TORCH_CHECK(cfg.hidden % LANES == 0 && cfg.intermediate % LANES == 0, "widths must be multiples of 16");
  }

  // hidden [n, H] (after the final norm) of ids [n] at positions [n], on top of `past` cached rows
  // of keys/values [layers, 1, kv_heads, capacity, d] (fp32), which receive the new rows at
  // past..past+n-1. tree_mask: bool [n, n] (row i true on what token i sees) or empty (causal).
  // tapped [T, n, H] fp32 receives the residual stream entering layer taps[t] (a drafter's
  // features; empty: none).
  torch::Tensor forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor keys, torch::Tensor values,
                        int64_t past, torch::Tensor tree_mask, std::vector<int64_t> taps, torch::Tensor tapped) const {
    const int64_t n = ids.size(0), h = cfg.hidden, d = cfg.head_dim;
    TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && keys.is_contiguous() && values.is_contiguous(),
                "the cache must be contiguous fp32");
    TORCH_CHECK(keys.size(0) == static_cast<int64_t>(layers.size()) && keys.size(3) >= past + n, "cache too small");
    auto ids_c = ids.to(torch::kLong).contiguous();
    auto pos_c = positions.to(torch::kLong).contiguous();
    const int64_t* id = ids_c.data_ptr<int64_t>();
    const int64_t* pos = pos_c.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < embed.out, "token id out of range");
      TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "position out of range");
    }
    const std::vector<std::vector<int64_t>> seen = visible_rows(n, tree_mask);
    auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor x = torch::empty({n, h}, opts), normed = torch::empty({n, h}, opts);
    torch::Tensor qkv = torch::empty({n, layers[0].qkv.out}, opts);
    torch::Tensor attended = torch::empty({n, cfg.heads * d}, opts), delta = torch::empty({n, h}, opts);
    torch::Tensor gate_up = torch::empty({n, 2 * cfg.intermediate}, opts);
    torch::Tensor act = torch::empty({n, cfg.intermediate}, opts);
    float* xp = x.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) embed.row_into(id[i], xp + i * h);
    const int64_t capacity = keys.size(3), layer_stride = keys.stride(0);
    TORCH_CHECK(taps.empty() || (tapped.scalar_type() == torch::kFloat32 && tapped.is_contiguous() &&
                                 tapped.size(0) == static_cast<int64_t>(taps.size()) && tapped.size(1) == n &&
                                 tapped.size(2) == h), "tapped must be contiguous fp32 [taps, n, H]");
    for (size_t l = 0; l < layers.size(); ++l) {
      for (size_t t = 0; t < taps.size(); ++t) {
        if (taps[t] == static_cast<int64_t>(l)) std::copy(xp, xp + n * h, tapped.data_ptr<float>() + t * n * h);
      }
      const Layer& layer = layers[l];
      float* layer_keys = keys.data_ptr<float>() + l * layer_stride;
      float* layer_values = values.data_ptr<float>() + l * layer_stride;
      rms_norm(xp, layer.attn_norm.data_ptr<float>(), normed.data_ptr<float>(), n, h, cfg.eps);
      matmul_into(normed.data_ptr<float>(), n, layer.qkv, qkv.data_ptr<float>());
      store_rotated(qkv.data_ptr<float>(), pos, n, past, layer_keys, layer_values, capacity);
      attention(qkv.data_ptr<float>(), seen, past, layer_keys, layer_values, capacity, attended.data_ptr<float>());
      matmul_into(attended.data_ptr<float>(), n, layer.out, delta.data_ptr<float>());
      add_into(xp, delta.data_ptr<float>(), n * h);
      rms_norm(xp, layer.mlp_norm.data_ptr<float>(), normed.data_ptr<float>(), n, h, cfg.eps);
      matmul_into(normed.data_ptr<float>(), n, layer.gate_up, gate_up.data_ptr<float>());
      silu_mul(gate_up.data_ptr<float>(), act.data_ptr<float>(), n);
      matmul_into(act.data_ptr<float>(), n, layer.down, delta.data_ptr<float>());
      add_into(xp, delta.data_ptr<float>(), n * h);
    }
    torch::Tensor result = torch::empty({n, h}, opts);
    rms_norm(xp, final_norm.data_ptr<float>(), result.data_ptr<float>(), n, h, cfg.eps);
    return result;
  }

  // logits [n, V] of hidden [n, H] through the output projection (the same product kernel)
  torch::Tensor project(torch::Tensor hidden) const {
    auto x = hidden.to(torch::kFloat32).contiguous();
    const int64_t n = x.numel() / cfg.hidden;
    torch::Tensor out = torch::empty({n, lm_head.out}, torch::TensorOptions().dtype(torch::kFloat32));
    if (n > 0) matmul_into(x.data_ptr<float>(), n, lm_head, out.data_ptr<float>());
    return out;
  }

  // x [n, w.in] @ w.T through the row-invariant product (tests compare it with torch)
  static torch::Tensor matmul(torch::Tensor x, const Weight& w) {
    auto xc = x.to(torch::kFloat32).contiguous();
    TORCH_CHECK(xc.size(-1) == w.in, "input width");
    const int64_t n = xc.numel() / w.in;
    torch::Tensor out = torch::empty({n, w.out}, torch::TensorOptions().dtype(torch::kFloat32));
    if (n > 0) matmul_into(xc.data_ptr<float>(), n, w, out.data_ptr<float>());
    return out;
  }

  static torch::Tensor dequantize(const Weight& w) {
    torch::Tensor out = torch::empty({w.out, w.in}, torch::TensorOptions().dtype(torch::kFloat32));
    for (int64_t r = 0; r < w.out; ++r) w.row_into(r, out.data_ptr<float>() + r * w.in);
    return out;
  }

 private:
  Config cfg;
  std::vector<Layer> layers;
  Weight embed;
  torch::Tensor final_norm;
  Weight lm_head;
  torch::Tensor cos, sin;  // [positions, d] fp32

  static std::vector<std::vector<int64_t>> visible_rows(int64_t n, const torch::Tensor& tree_mask) {
    std::vector<std::vector<int64_t>> seen(n);
    if (!tree_mask.defined() || tree_mask.numel() == 0) {
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) seen[i].push_back(j);
      return seen;
    }
    TORCH_CHECK(tree_mask.size(0) == n && tree_mask.size(1) == n, "tree mask must be [n, n]");
    auto mask = tree_mask.to(torch::kBool).contiguous();
    const bool* m = mask.data_ptr<bool>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        if (m[i * n + j]) seen[i].push_back(j);
    return seen;
  }

  void store_rotated(float* qkv, const int64_t* pos, int64_t n, int64_t past, float* keys, float* values,
                     int64_t capacity) const {
    const int64_t d = cfg.head_dim, width = (cfg.heads + 2 * cfg.kv_heads) * d;
    for_rows(n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* row = qkv + i * width;
        const float* c = cos.data_ptr<float>() + pos[i] * d;
        const float* s = sin.data_ptr<float>() + pos[i] * d;
        for (int64_t head = 0; head < cfg.heads + cfg.kv_heads; ++head) rotate(row + head * d, c, s, d);
        for (int64_t kv = 0; kv < cfg.kv_heads; ++kv) {
          const int64_t at = (kv * capacity + past + i) * d;
          std::memcpy(keys + at, row + (cfg.heads + kv) * d, d * 4);
          std::memcpy(values + at, row + (cfg.heads + cfg.kv_heads + kv) * d, d * 4);
        }
      }
    });
  }

  void attention(const float* qkv, const std::vector<std::vector<int64_t>>& seen, int64_t past, const float* keys,
                 const float* values, int64_t capacity, float* out) const {
#if !defined(HALF_LANES)
    if (cfg.heads / cfg.kv_heads <= SHARED_QUERIES)
      return attention_shared(qkv, seen, past, keys, values, capacity, out);
#endif
    const int64_t n = static_cast<int64_t>(seen.size()), d = cfg.head_dim;
    const int64_t width = (cfg.heads + 2 * cfg.kv_heads) * d, group = cfg.heads / cfg.kv_heads;
    auto attend = [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / cfg.heads, head = task % cfg.heads, kv = head / group;
        attend_one(qkv + i * width + head * d, keys + kv * capacity * d, values + kv * capacity * d, past,
                   seen[i].data(), static_cast<int64_t>(seen[i].size()), d, cfg.scale,
                   out + i * cfg.heads * d + head * d, scores);
      }
    };
    // a few short rows are cheaper on the calling thread than split (each task's arithmetic is its own)
    if (n * cfg.heads * (past + n) < PARALLEL_KEYS) attend(0, n * cfg.heads);
    else at::parallel_for(0, n * cfg.heads, 1, attend);
  }

#if !defined(HALF_LANES)
  // Tasks of one KV group's heads for a block of rows (as many as SHARED_QUERIES queries allow), each
  // reading the keys and values its rows share once (attend_shared). Blocks are dealt from both ends
  // (first, last, second, ...) so the threads' contiguous shares cost alike in a causal prefill.
  void attention_shared(const float* qkv, const std::vector<std::vector<int64_t>>& seen, int64_t past,
                        const float* keys, const float* values, int64_t capacity, float* out) const {
    const int64_t n = static_cast<int64_t>(seen.size()), d = cfg.head_dim;
    const int64_t width = (cfg.heads + 2 * cfg.kv_heads) * d, group = cfg.heads / cfg.kv_heads;
    const int64_t rows_per_block = std::max<int64_t>(1, SHARED_QUERIES / group);
    const int64_t blocks = (n + rows_per_block - 1) / rows_per_block;
    auto attend = [&](int64_t begin, int64_t end) {
      std::vector<float> scores[SHARED_QUERIES];
      AttentionQuery queries[SHARED_QUERIES];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kv = task % cfg.kv_heads, order = task / cfg.kv_heads;
        const int64_t block = order % 2 == 0 ? order / 2 : blocks - 1 - order / 2;
        const int64_t first = block * rows_per_block, last = std::min(n, first + rows_per_block);
        int count = 0;
        int64_t common = static_cast<int64_t>(seen[first].size());
        for (int64_t i = first; i < last; ++i) {
          int64_t same = 0;  // the new rows every row of the block sees first, in the same order
          while (same < common && same < static_cast<int64_t>(seen[i].size()) && seen[i][same] == seen[first][same])
            ++same;
          common = same;
          for (int64_t head = kv * group; head < (kv + 1) * group; ++head)
            queries[count++] = {qkv + i * width + head * d, seen[i].data(), static_cast<int64_t>(seen[i].size()),
                                out + i * cfg.heads * d + head * d};
        }
        attend_shared(queries, count, keys + kv * capacity * d, values + kv * capacity * d, past, common, d,
                      cfg.scale, scores);
      }
    };
    const int64_t tasks = blocks * cfg.kv_heads;
    if (n * cfg.heads * (past + n) < PARALLEL_KEYS) attend(0, tasks);
    else at::parallel_for(0, tasks, 1, attend);
  }
#endif

  void silu_mul(const float* gate_up, float* out, int64_t n) const {
    const int64_t width = cfg.intermediate;
    for_rows(n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* gate = gate_up + r * 2 * width;
        const float* up = gate + width;
        for (int64_t i = 0; i < width; i += LANES) {
          const v16f g = vload(gate + i);
          vstore(out + r * width + i, g / (vexp(-g) + 1.0f) * vload(up + i));
        }
      }
    });
  }

  static void add_into(float* x, const float* delta, int64_t count) {
    for (int64_t i = 0; i < count; ++i) x[i] += delta[i];
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ISA") = ISA;
  m.attr("TILE_ROWS") = TILE_ROWS;
  m.def("int8_paths", [] {
    std::vector<std::string> names;
    for (int path : {INT8_SCALAR, INT8_AVX2, INT8_VNNI})
      if (int8_path_available(path)) names.emplace_back(INT8_PATH_NAMES[path]);
    return names;
  }, "the 8-bit product's implementations this CPU runs (every one gives the same bits)");
  m.def("int8_path", [] { return std::string(g_int8_auto ? "auto: " : "") + INT8_PATH_NAMES[g_int8_path]; },
        "the 8-bit product's implementation in use");
  m.def("set_int8_path", [](const std::string& name) {
    for (int path : {INT8_SCALAR, INT8_AVX2, INT8_VNNI})
      if (name == INT8_PATH_NAMES[path]) {
        TORCH_CHECK(int8_path_available(path), "this CPU cannot run the 8-bit path ", name);
        g_int8_path = path;
        g_int8_auto = false;
        return;
      }
    TORCH_CHECK(name == "auto", "unknown 8-bit path ", name);
    g_int8_path = best_int8_path();
    g_int8_auto = true;
  }, "use one 8-bit implementation ('auto': the fastest this CPU has)");
  py::class_<Weight>(m, "Weight")
      .def(py::init<int, torch::Tensor, int64_t, int64_t, c10::optional<torch::Tensor>, bool>(), py::arg("format"),
           py::arg("data"), py::arg("out"), py::arg("in"), py::arg("bias") = py::none(),
           py::arg("int8_activations") = false)
      .def_readonly("format", &Weight::format)
      .def_readonly("int8_activations", &Weight::int8)
      .def_readonly("out", &Weight::out)
      .def_readonly("in_features", &Weight::in);
  py::class_<Config>(m, "Config")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, float, float>(), py::arg("hidden"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
           py::arg("scale"));
  py::class_<Layer>(m, "Layer")
      .def(py::init<torch::Tensor, torch::Tensor, Weight, Weight, Weight, Weight>(), py::arg("attn_norm"),
           py::arg("mlp_norm"), py::arg("qkv"), py::arg("out"), py::arg("gate_up"), py::arg("down"));
  py::class_<Model>(m, "Model")
      .def(py::init<Config, std::vector<Layer>, Weight, torch::Tensor, Weight, torch::Tensor, torch::Tensor>(),
           py::arg("config"), py::arg("layers"), py::arg("embed"), py::arg("final_norm"), py::arg("lm_head"),
           py::arg("cos"), py::arg("sin"))
      .def("forward", &Model::forward, py::call_guard<py::gil_scoped_release>())
      .def("project", &Model::project, py::call_guard<py::gil_scoped_release>());
  m.def("matmul", &Model::matmul, "x @ w.T by the row-invariant product", py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &Model::dequantize, "a weight's rows as fp32 [out, in]");
}
