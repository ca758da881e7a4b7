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

typedef int32_t v8i __attribute__((vector_size(32)));

// x in every lane of a V (a broadcast)
template <typename V>
inline V splat(float x) {
  V v;
  for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) v[i] = x;
  return v;
}
template <typename V>
inline V vmax(V a, V b) { return a > b ? a : b; }

// e^x per lane (Cephes' expf: range reduction by ln 2, degree-5 polynomial, 2^n by exponent bits);
// lane-independent, so an element's value never depends on where it sits in a vector, or on the vector's
// width (V, I: 16 or 8 lanes of float and int32; AVX2 runs the 8-lane one, which GCC keeps in registers)
template <typename V, typename I>
inline V vexp_lanes(V x) {
  x = vmax(x, splat<V>(-87.0f));
  x = x < splat<V>(88.0f) ? x : splat<V>(88.0f);
  V fx = x * 1.44269504088896341f + 0.5f;
  I truncated = __builtin_convertvector(fx, I);
  V floored = __builtin_convertvector(truncated, V);
  floored = floored - __builtin_convertvector((floored > fx) & 1, V);  // floor
  x = x - floored * 0.693359375f;
  x = x - floored * -2.12194440e-4f;
  V z = x * x;
  V y = splat<V>(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  I bits = (__builtin_convertvector(floored, I) + 127) << 23;
  return y * (V)bits;
}
inline v16f vexp(v16f x) { return vexp_lanes<v16f, v16i>(x); }
inline v8f vexp8(v8f x) { return vexp_lanes<v8f, v8i>(x); }

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
constexpr int64_t INT8_GROUP = 16;  // output columns of the 8-bit products' vector lanes

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
  // 8-bit activations (mode gguf-q8): the blocks also packed for the lane-per-column products
  // (pack_columns): groups of 16 output columns (zero columns past `out`), per group and block the
  // quants as the lanes read them (unsigned: Q4_1's nibbles, Q8_0's bytes + 128) and the fp16 scales d
  // (and Q4_1's m)
  bool int8 = false;
  int64_t groups = 0;
  torch::Tensor packed, packed_d, packed_m;
  const uint8_t* pq = nullptr;  // the tensors' data, read in the hot loops without a call
  const uint16_t *pd = nullptr, *pm = nullptr;

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
    if (int8) pack_columns();
  }

  // Q4_1, per group and block, 256 bytes: 4 rows of 64 (16 columns x 4 bytes), row t's byte holding
  // element 8t + i in its low nibble and 8t + 4 + i in its high one (i = 0..3). Q8_0: 512 bytes, 8 rows
  // of 64, row s holding elements 4s..4s+3 of each column, each + 128 (vpdpbusd's unsigned operand).
  void pack_columns() {
    TORCH_CHECK(format == Q8_0 || format == Q4_1, "8-bit activations need Q8_0 or Q4_1 blocks");
    const int64_t blocks = in / QBLOCK, block_bytes = stride / blocks, packed_bytes = format == Q4_1 ? 256 : 512;
    groups = (out + INT8_GROUP - 1) / INT8_GROUP;
    const int64_t slots = groups * blocks * INT8_GROUP;
    packed = torch::zeros({groups * blocks * packed_bytes}, torch::kUInt8);
    packed_d = torch::zeros({slots}, torch::kInt16);
    packed_m = torch::zeros({format == Q4_1 ? slots : 0}, torch::kInt16);
    uint8_t* q = packed.data_ptr<uint8_t>();
    int16_t* d = packed_d.data_ptr<int16_t>();
    int16_t* m = packed_m.data_ptr<int16_t>();
    for (int64_t c = 0; c < out; ++c)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = bytes + c * stride + b * block_bytes;
        const int64_t at = (c / INT8_GROUP) * blocks + b, lane = c % INT8_GROUP;
        std::memcpy(d + at * INT8_GROUP + lane, block, 2);
        if (format == Q4_1) {
          std::memcpy(m + at * INT8_GROUP + lane, block + 2, 2);
          auto nibble = [&](int j) { return j < 16 ? block[4 + j] & 0x0f : block[4 + j - 16] >> 4; };
          for (int t = 0; t < 4; ++t)
            for (int i = 0; i < 4; ++i)
              q[at * 256 + 64 * t + 4 * lane + i] = static_cast<uint8_t>(nibble(8 * t + i) | nibble(8 * t + 4 + i) << 4);
        } else {
          for (int s = 0; s < 8; ++s)
            for (int i = 0; i < 4; ++i) q[at * 512 + 64 * s + 4 * lane + i] = block[2 + 4 * s + i] ^ 0x80;
        }
      }
    pq = q;
    pd = reinterpret_cast<const uint16_t*>(d);
    pm = format == Q4_1 ? reinterpret_cast<const uint16_t*>(m) : nullptr;
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


// ---- 8-bit activations (mode gguf-q8): one arithmetic, row-invariant ---------------------------
// Each input row is cut into blocks of 32 and rounded to 8 bits per block, on its own (d = amax / 127,
// q = round(x / d), s = d * sum(q)): a row's integers never depend on the other rows. Per output element
// (row r, column c), over the blocks b in order, from acc = 0:
//   acc = fma(float(isum_b), dw_b * dx_b, acc)    isum_b = the block's integer dot product (exact)
//   Q4_1 then: acc = fma(mw_b, s_b, acc)           its minimum times the inputs' block sum
// (one chain of fused multiply-adds per output, bias added after): the same sequence for every row,
// whatever the row count, the tile or the implementation.
// Three implementations, chosen at run time (CPUID through __builtin_cpu_supports, never by the build's
// flags, so one build serves every x86 CPU and a test can force each in turn; `int8_paths()` lists this
// CPU's, `set_int8_path` picks one):
//   - scalar: plain C++ over the GGUF's blocks as they are, every CPU;
//   - avx2 and avx512-vnni: a vector lane is an output column (8 / 16 a register) running down K four
//     bytes at a time (maddubs + madd / vpdpbusd against the row's 4 bytes in every lane), so a block's
//     sums come out whole, one per lane, and its float work is three instructions per 16 outputs (four
//     for Q4_1) for 32 products each. The weights are packed once at load (Weight::pack_columns) into
//     groups of 16 columns, each block's quants in the order the lanes read them.
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
bool g_int8_auto = true;             // auto: the fastest path this CPU has, for every row count

struct ActivationBlocks {
  int64_t n, blocks;
  std::vector<int8_t> q;  // [n, blocks * 32], in element order
  std::vector<float> d;   // [n, blocks]: each block's scale
  std::vector<float> s;   // [n, blocks]: d * sum(q)
  std::vector<int32_t> sum;  // [n, blocks]: sum(q)
};

// one block of 32 inputs to 8 bits: its scale d = amax / 127, q = x / d rounded to nearest (ties to
// even: the CPU's rounding, the same in both versions)
#if X86_INT8
AVX2_TARGET inline void quantize_block_avx2(const float* v, int8_t* q, float& d, int32_t& sum) {
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
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
}
#endif

inline void quantize_block_scalar(const float* v, int8_t* q, float& d, int32_t& sum) {
  float amax = 0.0f;
  for (int i = 0; i < QBLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
  d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  sum = 0;
  for (int i = 0; i < QBLOCK; ++i) {
    const int32_t value = static_cast<int32_t>(std::nearbyint(v[i] * inverse));
    q[i] = static_cast<int8_t>(value);
    sum += value;
  }
}

// rows to 8-bit blocks, each row on its own; in parallel from QUANTIZE_PARALLEL_ROWS rows (a row's
// numbers never depend on which thread rounds it; below, a parallel region costs more than it saves:
// 2-core Zen 5, a 4-row forward 4.97 -> 7.25 ms with every product's rounding split)
constexpr int64_t QUANTIZE_PARALLEL_ROWS = 16;

ActivationBlocks quantize_rows(const float* x, int64_t n, int64_t k, int path) {
  const int64_t blocks = k / QBLOCK;
  ActivationBlocks a{n, blocks, std::vector<int8_t>(n * k), std::vector<float>(n * blocks),
                     std::vector<float>(n * blocks), std::vector<int32_t>(n * blocks)};
  auto round_rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = r * blocks + b;
#if X86_INT8
        if (path != INT8_SCALAR) quantize_block_avx2(x + at * QBLOCK, a.q.data() + at * QBLOCK, a.d[at], a.sum[at]);
        else quantize_block_scalar(x + at * QBLOCK, a.q.data() + at * QBLOCK, a.d[at], a.sum[at]);
#else
        quantize_block_scalar(x + at * QBLOCK, a.q.data() + at * QBLOCK, a.d[at], a.sum[at]);
#endif
        a.s[at] = a.d[at] * static_cast<float>(a.sum[at]);
      }
  };
  if (n < QUANTIZE_PARALLEL_ROWS) round_rows(0, n);
  else at::parallel_for(0, n, 1, round_rows);
  return a;
}

// ---- scalar: the arithmetic as written, from the GGUF's blocks ----
// Not auto-vectorised: GCC 12.2 at -O3 with AVX512-VNNI turns the signed-byte dot product below into
// vpdpbusd, which reads one operand as unsigned (wrong sums: a 32-byte Q8_0 block gave -6000 for -15984)
template <int FMT>
__attribute__((optimize("no-tree-vectorize"))) float int8_dot_scalar(const ActivationBlocks& a, int64_t r, const Weight& w, int64_t c) {
  const int8_t* x = a.q.data() + r * a.blocks * QBLOCK;
  const uint8_t* row = w.bytes + c * w.stride;
  float acc = 0.0f;
  for (int64_t b = 0; b < a.blocks; ++b, x += QBLOCK) {
    int32_t isum = 0;
    uint16_t dh, mh = 0;
    if constexpr (FMT == Q4_1) {  // element j: the low nibble of byte j, element j + 16 its high nibble
      const uint8_t* block = row + b * 20;
      std::memcpy(&dh, block, 2);
      std::memcpy(&mh, block + 2, 2);
      for (int j = 0; j < 16; ++j) isum += (block[4 + j] & 0x0f) * x[j] + (block[4 + j] >> 4) * x[j + 16];
    } else {
      const uint8_t* block = row + b * 34;
      std::memcpy(&dh, block, 2);
      for (int j = 0; j < QBLOCK; ++j) isum += static_cast<int8_t>(block[2 + j]) * x[j];
    }
    const int64_t at = r * a.blocks + b;
    acc = std::fma(static_cast<float>(isum), half_to_float(dh) * a.d[at], acc);
    if constexpr (FMT == Q4_1) acc = std::fma(half_to_float(mh), a.s[at], acc);
  }
  return acc;
}

template <int FMT>
void int8_groups_scalar(const ActivationBlocks& a, const Weight& w, int64_t g_begin, int64_t g_end, float* out) {
  const int64_t last = std::min(g_end * INT8_GROUP, w.out);
  for (int64_t r = 0; r < a.n; ++r)
    for (int64_t c = g_begin * INT8_GROUP; c < last; ++c) out[r * w.out + c] = int8_dot_scalar<FMT>(a, r, w, c);
}

#if X86_INT8
// ---- avx2: 8 columns a register, a 16-column group as two halves ----
AVX2_TARGET inline __m256i every_lane4(const int8_t* p) {  // 4 bytes in each 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// R rows x the 16 columns of group g
template <int FMT, int R>
AVX2_TARGET void avx2_group(const ActivationBlocks& a, int64_t row, const Weight& w, int64_t g, float* out) {
  const int64_t blocks = a.blocks;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0f);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = g * blocks + b;
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.q.data() + ((row + r) * blocks + b) * QBLOCK;
    __m256i isum[R][2];
    if constexpr (FMT == Q4_1) {
      // nibble x byte pairs are at most 2 * 15 * 127: a whole block's 16 of them per lane fit 16 bits
      __m256i pairs16[R][2];
      for (int r = 0; r < R; ++r) pairs16[r][0] = pairs16[r][1] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t)
        for (int h = 0; h < 2; ++h) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.pq + at * 256 + 64 * t + 32 * h));
          const __m256i low = _mm256_and_si256(packed, nibble);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
          for (int r = 0; r < R; ++r)
            pairs16[r][h] = _mm256_add_epi16(pairs16[r][h],
                                             _mm256_add_epi16(_mm256_maddubs_epi16(low, every_lane4(x[r] + 8 * t)),
                                                              _mm256_maddubs_epi16(high, every_lane4(x[r] + 8 * t + 4))));
        }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) isum[r][h] = _mm256_madd_epi16(pairs16[r][h], ones);
    } else {  // maddubs multiplies unsigned by signed bytes: Q8_0's sign moves onto the input
      const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s)
        for (int h = 0; h < 2; ++h) {
          const __m256i weights = _mm256_xor_si256(  // the signed weights again
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.pq + at * 512 + 64 * s + 32 * h)), offset);
          const __m256i magnitude = _mm256_sign_epi8(weights, weights);
          for (int r = 0; r < R; ++r) {
            const __m256i products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(every_lane4(x[r] + 4 * s), weights));
            isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(products, ones));
          }
        }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.pd + at * INT8_GROUP + 8 * h)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (FMT == Q4_1)
        mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.pm + at * INT8_GROUP + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (row + r) * blocks + b;
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[xb]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), scale, acc[r][h]);
        if constexpr (FMT == Q4_1) acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[xb]), acc[r][h]);
      }
    }
  }
  const int64_t first = g * INT8_GROUP, cols = std::min<int64_t>(INT8_GROUP, w.out - first);
  for (int r = 0; r < R; ++r) {
    alignas(32) float values[INT8_GROUP];
    _mm256_store_ps(values, acc[r][0]);
    _mm256_store_ps(values + 8, acc[r][1]);
    std::memcpy(out + (row + r) * w.out + first, values, cols * sizeof(float));
  }
}

template <int FMT>
AVX2_TARGET void int8_groups_avx2(const ActivationBlocks& a, const Weight& w, int64_t g_begin, int64_t g_end,
                                  float* out) {
  for (int64_t g = g_begin; g < g_end; ++g) {
    int64_t r = 0;
    for (; r + 2 <= a.n; r += 2) avx2_group<FMT, 2>(a, r, w, g, out);
    if (r < a.n) avx2_group<FMT, 1>(a, r, w, g, out);
  }
}

// ---- avx512-vnni: 16 columns a register ----
VNNI_TARGET inline __m512i every_lane4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Tiles of several rows spend longer on each block than the hardware prefetcher looks ahead: asking
// for each group's block PREFETCH_BLOCKS ahead cut 2 / 4 / 8-row products of the shipped model's layers
// by 5 / 10 / 7 % on a 2-core Zen 5 (one row: no gain). A prefetch never faults, past the end included.
constexpr int64_t PREFETCH_BLOCKS = 2;

template <int FMT, int C>
VNNI_TARGET inline void prefetch_blocks(const Weight& w, int64_t blocks, int64_t g0, int64_t b) {
  constexpr int LINES = FMT == Q4_1 ? 4 : 8;  // a packed block of 16 columns: 256 / 512 bytes
  for (int c = 0; c < C; ++c) {
    const char* ahead = reinterpret_cast<const char*>(w.pq) + ((g0 + c) * blocks + b) * LINES * 64;
    for (int line = 0; line < LINES; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
  }
}

// R rows x C groups from group g0 (R x C accumulators, their block sums and C groups' weights in 32 zmm)
template <int FMT, int R, int C>
VNNI_TARGET void vnni_tile(const ActivationBlocks& a, int64_t row, const Weight& w, int64_t g0, float* out) {
  const int64_t blocks = a.blocks;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.q.data() + ((row + r) * blocks + b) * QBLOCK;
    if constexpr (R >= 2) prefetch_blocks<FMT, C>(w, blocks, g0, b + PREFETCH_BLOCKS);
    __m512i isum[R][C];
    if constexpr (FMT == Q4_1) {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {  // elements 8t..8t+3 in the low nibbles, 8t+4..8t+7 in the high
        __m512i low[C], high[C];
        for (int c = 0; c < C; ++c) {
          const __m512i packed = _mm512_loadu_si512(w.pq + ((g0 + c) * blocks + b) * 256 + 64 * t);
          low[c] = _mm512_and_si512(packed, nibble);
          high[c] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x_low = every_lane4_512(x[r] + 8 * t), x_high = every_lane4_512(x[r] + 8 * t + 4);
          for (int c = 0; c < C; ++c)
            isum[r][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][c], low[c], x_low), high[c], x_high);
        }
      }
    } else {  // the weights + 128: each lane starts at -128 x the inputs' block sum
      for (int r = 0; r < R; ++r) {
        const __m512i start = _mm512_set1_epi32(-128 * a.sum[(row + r) * blocks + b]);
        for (int c = 0; c < C; ++c) isum[r][c] = start;
      }
      for (int s = 0; s < 8; ++s) {
        __m512i weights[C];
        for (int c = 0; c < C; ++c) weights[c] = _mm512_loadu_si512(w.pq + ((g0 + c) * blocks + b) * 512 + 64 * s);
        for (int r = 0; r < R; ++r) {
          const __m512i inputs = every_lane4_512(x[r] + 4 * s);
          for (int c = 0; c < C; ++c) isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], weights[c], inputs);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const int64_t at = (g0 + c) * blocks + b;
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.pd + at * INT8_GROUP)));
      __m512 mw = _mm512_setzero_ps();
      if constexpr (FMT == Q4_1)
        mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.pm + at * INT8_GROUP)));
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (row + r) * blocks + b;
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[xb]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), scale, acc[r][c]);
        if constexpr (FMT == Q4_1) acc[r][c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[xb]), acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t first = (g0 + c) * INT8_GROUP, cols = std::min<int64_t>(INT8_GROUP, w.out - first);
    const __mmask16 mask = cols >= INT8_GROUP ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (row + r) * w.out + first, mask, acc[r][c]);
  }
}

// rows [row, row + count) of C groups from g0, count <= R: the tile of exactly that many rows
template <int FMT, int C, int R>
VNNI_TARGET void vnni_tile_of(const ActivationBlocks& a, int64_t row, int64_t count, const Weight& w, int64_t g0,
                              float* out) {
  if constexpr (R > 1)
    if (count < R) return vnni_tile_of<FMT, C, R - 1>(a, row, count, w, g0, out);
  vnni_tile<FMT, R, C>(a, row, w, g0, out);
}

// every row for C groups from g0, R rows a tile: each group's weights read from cache by every row
// tile after the first
template <int FMT, int C, int R>
VNNI_TARGET void vnni_rows(const ActivationBlocks& a, const Weight& w, int64_t g0, float* out) {
  for (int64_t r = 0; r < a.n; r += R) vnni_tile_of<FMT, C, R>(a, r, std::min<int64_t>(a.n - r, R), w, g0, out);
}

template <int FMT>
VNNI_TARGET void int8_groups_vnni(const ActivationBlocks& a, const Weight& w, int64_t g_begin, int64_t g_end,
                                  float* out) {
  int64_t g = g_begin;
  // one row: 4 groups a tile, more weight streams in flight (two rows run as three do: 4-row tiles of 2
  // groups measured 12 % faster for a 2-row forward than 2-row tiles of 4 groups, on a 2-core Zen 5)
  if (a.n == 1)
    for (; g + 4 <= g_end; g += 4) vnni_rows<FMT, 4, 2>(a, w, g, out);
  if (a.n >= 8 && a.n < 16) {  // 8 rows a tile, each group's unpacked weights shared by more rows
    for (; g < g_end; ++g) vnni_rows<FMT, 1, 8>(a, w, g, out);
    return;
  }
  for (; g + 2 <= g_end; g += 2) vnni_rows<FMT, 2, 4>(a, w, g, out);
  for (; g < g_end; ++g) vnni_rows<FMT, 1, 4>(a, w, g, out);
}
#endif

inline void add_bias(const Weight& w, int64_t n, int64_t first, int64_t cols, float* out) {
  if (!w.bias.defined()) return;
  const float* b = w.bias.data_ptr<float>() + first;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < cols; ++c) out[i * w.out + first + c] += b[c];
}

template <int FMT>
inline void int8_groups(const ActivationBlocks& a, const Weight& w, int64_t g_begin, int64_t g_end, float* out,
                        int path) {
#if X86_INT8
  if (path == INT8_VNNI) return int8_groups_vnni<FMT>(a, w, g_begin, g_end, out);
  if (path == INT8_AVX2) return int8_groups_avx2<FMT>(a, w, g_begin, g_end, out);
#endif
  int8_groups_scalar<FMT>(a, w, g_begin, g_end, out);
}

// out [n, w.out] = x [n, w.in] @ w.T (+ bias), the activations rounded to 8-bit blocks per row;
// threads split the column groups, never K
void int8_matmul_into(const float* x, int64_t n, const Weight& w, float* out) {
  const int path = g_int8_path;
  const ActivationBlocks a = quantize_rows(x, n, w.in, path);
  at::parallel_for(0, w.groups, 1, [&](int64_t begin, int64_t end) {
    if (w.format == Q4_1) int8_groups<Q4_1>(a, w, begin, end, out, path);
    else int8_groups<Q8_0>(a, w, begin, end, out, path);
    const int64_t first = begin * INT8_GROUP;
    add_bias(w, n, first, std::min(end * INT8_GROUP, w.out) - first, out);
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

// The cache's keys and values: fp32 (the fp32 and bf16 modes) or fp16 bits (`half_t`: the gguf modes, as
// llama.cpp's default cache; half the bytes a long context reads). Every path stores and loads them
// through these (fp32 -> fp16 rounds to nearest even, fp16 -> fp32 is exact), so a tree row reads the
// very numbers the plain step reads.
typedef uint16_t half_t;

inline uint16_t float_to_half(float x) {
#if defined(__F16C__)
  return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const _Float16 h = static_cast<_Float16>(x);  // round to nearest even, as the instruction does
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
#endif
}

inline void kv_store(float* to, const float* from, int64_t d) { std::memcpy(to, from, d * sizeof(float)); }
inline void kv_store(half_t* to, const float* from, int64_t d) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= d; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < d; ++i) to[i] = float_to_half(from[i]);
}

#if defined(HALF_LANES)
inline v8f kv_load8(const float* p) { return vload8(p); }
#endif
inline v8f kv_load8(const half_t* p) {
#if defined(__F16C__)
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}
inline v16f kv_load16(const float* p) { return vload(p); }
inline v16f kv_load16(const half_t* p) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  union { v8f half[2]; v16f whole; } v{{kv_load8(p), kv_load8(p + 8)}};
  return v.whole;
#endif
}

// Attention's two sums, each lane's fused multiply-adds in the order of a plain 16-lane loop, but
// several keys (scores) or value chunks (outputs) in flight at once, in registers: independent
// chains the CPU overlaps, where one chain at a time waited on each FMA's latency.
constexpr int KEYS_AT_ONCE = 4, CHUNKS_AT_ONCE = 4;

// scores[j] = dot(q, key[j]) * scale over d: lane l sums i = l, l + 16, ... then the fixed tree
template <int J, typename KV>
inline void key_dots(const float* q, const KV* const* key, int64_t d, float scale, float* scores) {
#if defined(HALF_LANES)
  v8f low[J], high[J];
  for (int j = 0; j < J; ++j) low[j] = high[j] = v8f{};
  for (int64_t i = 0; i < d; i += LANES) {
    const v8f q_low = vload8(q + i), q_high = vload8(q + i + 8);
    for (int j = 0; j < J; ++j) {
      low[j] = vfma8(q_low, kv_load8(key[j] + i), low[j]);
      high[j] = vfma8(q_high, kv_load8(key[j] + i + 8), high[j]);
    }
  }
  for (int j = 0; j < J; ++j) scores[j] = hsum_halves(low[j], high[j]) * scale;
#else
  v16f acc[J];
  for (int j = 0; j < J; ++j) acc[j] = v16f{};
  for (int64_t i = 0; i < d; i += LANES) {
    const v16f qv = vload(q + i);
    for (int j = 0; j < J; ++j) acc[j] = vfma(qv, kv_load16(key[j] + i), acc[j]);
  }
  for (int j = 0; j < J; ++j) scores[j] = hsum(acc[j]) * scale;
#endif
}

#if defined(__AVX512F__)
// The horizontal sums of 16 registers at once: lane j of the result is register TRANSPOSED[j]'s 16 lanes
// summed by hsum's own tree (lane l + lane l+8, then + l+4, + l+2, + l+1: the same additions, so each sum
// is bitwise hsum's), in four levels of shuffles and adds for all 16 instead of a tree each.
constexpr int TRANSPOSED[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};  // its own inverse

inline __m512 hsum16(const v16f* v) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int k = 0; k < 8; ++k) {  // [A 0-7 + A 8-15 | B 0-7 + B 8-15]
    const __m512 a = (__m512)v[2 * k], b = (__m512)v[2 * k + 1];
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int k = 0; k < 4; ++k)  // each 128-bit quarter one register's 4 sums (l + l+4)
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)  // (l + l+2)
    pairs[k] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),  // (0 + 1)
                       _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// key_dots for 16 keys: each key's lanes and fused multiply-adds as key_dots<1>'s, the 16 sums by hsum16
template <typename KV>
inline void key_dots16(const float* q, const KV* const* key, int64_t d, float scale, float* scores) {
  v16f acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = v16f{};
  for (int64_t i = 0; i < d; i += LANES) {
    const v16f qv = vload(q + i);
    for (int j = 0; j < 16; ++j) acc[j] = vfma(qv, kv_load16(key[TRANSPOSED[j]] + i), acc[j]);
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
}
#else
// without AVX512: KEYS_AT_ONCE keys at a time (the same sums: a key's lanes never depend on the others)
template <typename KV>
inline void key_dots16(const float* q, const KV* const* key, int64_t d, float scale, float* scores) {
  for (int j = 0; j < 16; j += KEYS_AT_ONCE) key_dots<KEYS_AT_ONCE>(q, key + j, d, scale, scores + j);
}
#endif

// out[first, first + 16C) = sum over t of weight[t] * value(t)[...] (t ascending), times inverse
template <int C, typename ValueAt>
inline void weighted_values(const float* weight, int64_t total, const ValueAt& value_at, int64_t first, float inverse,
                            float* out) {
#if defined(HALF_LANES)
  v8f acc[2 * C];
  for (int c = 0; c < 2 * C; ++c) acc[c] = v8f{};
  for (int64_t t = 0; t < total; ++t) {
    const auto* value = value_at(t) + first;
    const v8f w = (v8f)_mm256_set1_ps(weight[t]);  // a broadcast (0 + x would turn -0 into +0)
    for (int c = 0; c < 2 * C; ++c) acc[c] = vfma8(w, kv_load8(value + 8 * c), acc[c]);
  }
  for (int c = 0; c < 2 * C; ++c) {
    const v8f scaled = acc[c] * inverse;
    std::memcpy(out + first + 8 * c, &scaled, sizeof scaled);
  }
#else
  v16f acc[C];
  for (int c = 0; c < C; ++c) acc[c] = v16f{};
  for (int64_t t = 0; t < total; ++t) {
    const auto* value = value_at(t) + first;
    const v16f w = vset(weight[t]);
    for (int c = 0; c < C; ++c) acc[c] = vfma(w, kv_load16(value + c * LANES), acc[c]);
  }
  for (int c = 0; c < C; ++c) vstore(out + first + c * LANES, acc[c] * inverse);
#endif
}

// scores[0, total) -> e^(score - max) in place (padding to whole vectors: 0); returns 1 / their sum.
// Each in one fixed order: the max, then the exponentials and their 16-lane sum in key order.
inline float softmax_weights(float* scores, int64_t total) {
  const int64_t padded = (total + LANES - 1) / LANES * LANES;
  for (int64_t t = total; t < padded; ++t) scores[t] = -INFINITY;
#if defined(HALF_LANES)
  // the same lanes on 8-lane halves (GCC spills 16-lane vectors here on AVX2): lanes 0-7 of each 16,
  // then 8-15; the max over the same 16 lane maxima, the sum by hsum's tree
  v8f top[2] = {splat<v8f>(-INFINITY), splat<v8f>(-INFINITY)};
  for (int64_t t = 0; t < padded; t += LANES)
    for (int h = 0; h < 2; ++h) top[h] = vmax(top[h], vload8(&scores[t + 8 * h]));
  v16f lanes;
  std::memcpy(&lanes, top, sizeof lanes);
  const v8f peak = splat<v8f>(hmax(lanes));
  v8f sum[2] = {v8f{}, v8f{}};
  for (int64_t t = 0; t < padded; t += LANES)
    for (int h = 0; h < 2; ++h) {
      v8f p = vexp8(vload8(&scores[t + 8 * h]) - peak);
      if (t + 8 * h + 8 > total)  // padding lanes weigh nothing
        for (int64_t l = std::max<int64_t>(0, total - t - 8 * h); l < 8; ++l) p[l] = 0.0f;
      std::memcpy(&scores[t + 8 * h], &p, sizeof p);
      sum[h] = sum[h] + p;
    }
  return 1.0f / hsum_halves(sum[0], sum[1]);
#else
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
#endif
}

// one query row and head over the keys it sees: rows [0, past) of the cache, then the new rows
// `seen` (position order). scores -> max -> exp -> sum -> weighted values, each in one fixed order.
template <typename KV>
void attend_one(const float* q, const KV* keys, const KV* values, int64_t past, const int64_t* seen,
                int64_t seen_count, int64_t d, float scale, float* out, std::vector<float>& scores) {
  const int64_t total = past + seen_count, padded = (total + LANES - 1) / LANES * LANES;
  scores.resize(padded);
  auto key_at = [&](int64_t t) { return keys + (t < past ? t : past + seen[t - past]) * d; };
  int64_t t = 0;
#if defined(__AVX512F__)
  for (; t + 16 <= total; t += 16) {
    const KV* block[16];
    for (int j = 0; j < 16; ++j) block[j] = key_at(t + j);
    key_dots16(q, block, d, scale, &scores[t]);
  }
#endif
  for (; t + KEYS_AT_ONCE <= total; t += KEYS_AT_ONCE) {
    const KV* some[KEYS_AT_ONCE];
    for (int j = 0; j < KEYS_AT_ONCE; ++j) some[j] = key_at(t + j);
    key_dots<KEYS_AT_ONCE>(q, some, d, scale, &scores[t]);
  }
  for (; t < total; ++t) {
    const KV* one[1] = {key_at(t)};
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

// Several queries of one KV group (its heads, one or more rows) that see the same first `shared` keys
// (the cache, then the new rows their `seen` lists have in common): each shared key and value is loaded
// once for all of them, and each query's arithmetic is attend_one's, term for term (a key's score is
// the same dot product; the softmax is softmax_weights; each output lane sums its keys in order).
// AVX512: 6 queries x 4 value chunks of accumulators and a value's 4 registers within 32 zmm; AVX2: 6
// queries x one chunk (two 8-lane halves each) and a value's two halves within 16 ymm.
constexpr int SHARED_QUERIES = 6;
constexpr int64_t SHARED_ATTENTION_ROWS = 32;  // AVX2: rows from which attention runs by KV group

struct AttentionQuery {
  const float* q;
  const int64_t* seen;  // the new rows it sees, in position order
  int64_t seen_count;
  float* out;
};

inline int64_t key_position(const AttentionQuery& query, int64_t past, int64_t t) {
  return t < past ? t : past + query.seen[t - past];
}

// Scores of the first `shared` keys, each loaded once for all `count` queries: 16 at a time, then one at
// a time; each score key_dots' own.
template <typename KV>
void shared_scores(const AttentionQuery* queries, int count, const KV* keys, int64_t past, int64_t shared,
                   int64_t d, float scale, std::vector<float>* scores) {
  int64_t t = 0;
  for (; t + 16 <= shared; t += 16) {  // read from cache by every query after the first
    const KV* block[16];
    for (int j = 0; j < 16; ++j) block[j] = keys + key_position(queries[0], past, t + j) * d;
    for (int g = 0; g < count; ++g) key_dots16(queries[g].q, block, d, scale, &scores[g][t]);
  }
  for (; t < shared; ++t) {
    const KV* key[1] = {keys + key_position(queries[0], past, t) * d};
    for (int g = 0; g < count; ++g) key_dots<1>(queries[g].q, key, d, scale, &scores[g][t]);
  }
}

// Each query's own keys (the new rows it sees beyond the shared ones)
template <typename KV>
void own_scores(const AttentionQuery* queries, int count, const KV* keys, int64_t past, int64_t shared, int64_t d,
                float scale, std::vector<float>* scores) {
  for (int g = 0; g < count; ++g)
    for (int64_t t = shared; t < past + queries[g].seen_count; ++t) {
      const KV* one[1] = {keys + key_position(queries[g], past, t) * d};
      key_dots<1>(queries[g].q, one, d, scale, &scores[g][t]);
    }
}

// The weighted values, lane for lane attend_one's weighted_values: every shared key's value loaded once
// for all queries, then each query's own keys; each output lane sums weight x value over its keys in
// position order, then times the query's inverse.
template <typename KV>
void shared_values(const AttentionQuery* queries, int count, const KV* values, int64_t past, int64_t shared,
                   int64_t d, const std::vector<float>* scores, const float* inverse) {
#if defined(HALF_LANES)
  for (int64_t first = 0; first < d; first += LANES) {  // one chunk as two 8-lane halves
    v8f acc[SHARED_QUERIES][2];
    for (int g = 0; g < count; ++g) acc[g][0] = acc[g][1] = v8f{};
    for (int64_t t = 0; t < shared; ++t) {
      const KV* value = values + key_position(queries[0], past, t) * d + first;
      const v8f low = kv_load8(value), high = kv_load8(value + 8);
      for (int g = 0; g < count; ++g) {
        const v8f w = (v8f)_mm256_set1_ps(scores[g][t]);
        acc[g][0] = vfma8(w, low, acc[g][0]);
        acc[g][1] = vfma8(w, high, acc[g][1]);
      }
    }
    for (int g = 0; g < count; ++g) {
      const AttentionQuery& query = queries[g];
      for (int64_t t = shared; t < past + query.seen_count; ++t) {
        const KV* value = values + key_position(query, past, t) * d + first;
        const v8f w = (v8f)_mm256_set1_ps(scores[g][t]);
        acc[g][0] = vfma8(w, kv_load8(value), acc[g][0]);
        acc[g][1] = vfma8(w, kv_load8(value + 8), acc[g][1]);
      }
      const v8f low = acc[g][0] * inverse[g], high = acc[g][1] * inverse[g];
      std::memcpy(query.out + first, &low, sizeof low);
      std::memcpy(query.out + first + 8, &high, sizeof high);
    }
  }
#else
  for (int64_t first = 0; first < d; first += CHUNKS_AT_ONCE * LANES) {
    const int chunks = static_cast<int>(std::min<int64_t>(CHUNKS_AT_ONCE, (d - first) / LANES));
    v16f acc[SHARED_QUERIES][CHUNKS_AT_ONCE];
    for (int g = 0; g < count; ++g)
      for (int c = 0; c < chunks; ++c) acc[g][c] = v16f{};
    for (int64_t t = 0; t < shared; ++t) {
      const KV* value = values + key_position(queries[0], past, t) * d + first;
      v16f v[CHUNKS_AT_ONCE];
      for (int c = 0; c < chunks; ++c) v[c] = kv_load16(value + c * LANES);
      for (int g = 0; g < count; ++g) {
        const v16f w = vset(scores[g][t]);
        for (int c = 0; c < chunks; ++c) acc[g][c] = vfma(w, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < count; ++g) {
      const AttentionQuery& query = queries[g];
      for (int64_t t = shared; t < past + query.seen_count; ++t) {
        const KV* value = values + key_position(query, past, t) * d + first;
        const v16f w = vset(scores[g][t]);
        for (int c = 0; c < chunks; ++c) acc[g][c] = vfma(w, kv_load16(value + c * LANES), acc[g][c]);
      }
      for (int c = 0; c < chunks; ++c) vstore(query.out + first + c * LANES, acc[g][c] * inverse[g]);
    }
  }
#endif
}

template <typename KV>
void attend_shared(const AttentionQuery* queries, int count, const KV* keys, const KV* values, int64_t past,
                   int64_t shared_new, int64_t d, float scale, std::vector<float>* scores) {
  const int64_t shared = past + shared_new;
  for (int g = 0; g < count; ++g) scores[g].resize((past + queries[g].seen_count + LANES - 1) / LANES * LANES);
  shared_scores(queries, count, keys, past, shared, d, scale, scores);
  own_scores(queries, count, keys, past, shared, d, scale, scores);
  float inverse[SHARED_QUERIES];
  for (int g = 0; g < count; ++g) inverse[g] = softmax_weights(scores[g].data(), past + queries[g].seen_count);
  shared_values(queries, count, values, past, shared, d, scores, inverse);
}

// -- drafting ---------------------------------------------------------------------------------------
// A draft only proposes (the verify decides every token), so none of this needs row invariance; it
// runs one depth of a drafter in one call because a handful of torch operators on a few rows cost
// more than their arithmetic.

// The `width` largest of v[0, n), best first (ties: the lower index first) -> (values, indices).
void top_of(const float* v, int64_t n, int64_t width, float* top_values, int64_t* top_indices) {
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (kept == width && !(v[i] > top_values[kept - 1])) continue;
    int64_t at = kept < width ? kept++ : width - 1;  // the slot it enters from: the end
    while (at > 0 && v[i] > top_values[at - 1]) {
      top_values[at] = top_values[at - 1];
      top_indices[at] = top_indices[at - 1];
      --at;
    }
    top_values[at] = v[i];
    top_indices[at] = i;
  }
}

// softmax(logits[0, n)) at the `width` largest logits, best first: probabilities and indices
void softmax_top(const float* logits, int64_t n, int64_t width, float* probs, int64_t* indices) {
  top_of(logits, n, width, probs, indices);
  const float peak = probs[0];
  v16f sum{};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) sum = sum + vexp(vload(logits + i) - peak);
  float total = hsum(sum);
  for (; i < n; ++i) total += std::exp(logits[i] - peak);
  for (int64_t j = 0; j < width; ++j) probs[j] = std::exp(probs[j] - peak) / total;
}

void add_into_rows(float* x, const float* delta, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += delta[i];
}

// x += silu(t) over n numbers (n a multiple of 16)
void add_silu(float* x, const float* t, int64_t n) {
  for (int64_t i = 0; i < n; i += LANES) {
    const v16f g = vload(t + i);
    vstore(x + i, vload(x + i) + g / (vexp(-g) + 1.0f));
  }
}

// x [rows, H] += silu(block(x)) for each block in turn (bias included): residual blocks
void add_blocks(float* x, int64_t rows, const std::vector<Weight*>& blocks, int64_t size) {
  std::vector<float> t(rows * size);
  for (const Weight* block : blocks) {
    TORCH_CHECK(block->in == size && block->out == size, "block shape");
    matmul_into(x, rows, *block, t.data());
    add_silu(x, t.data(), rows * size);
  }
}

// The projection of states [rows, in] and each row's `width` most probable of its first `ranked[r]`
// projection rows (empty `ranked`: all of them) by softmax over those -> (probabilities [rows, width],
// projection rows [rows, width] int64); `width` no more than the fewest rows ranked
std::vector<torch::Tensor> top_guesses(const float* states, int64_t rows, const Weight& projection,
                                       std::vector<int64_t> ranked, int64_t width) {
  const int64_t vocab = projection.out;
  if (ranked.empty()) ranked.assign(rows, vocab);
  for (int64_t r : ranked) TORCH_CHECK(r > 0 && r <= vocab, "rows ranked ", r);
  width = std::min(width, *std::min_element(ranked.begin(), ranked.end()));
  torch::Tensor logits = torch::empty({rows, vocab}, torch::TensorOptions().dtype(torch::kFloat32));
  matmul_into(states, rows, projection, logits.data_ptr<float>());
  torch::Tensor probs = torch::empty({rows, width}, torch::TensorOptions().dtype(torch::kFloat32));
  torch::Tensor indices = torch::empty({rows, width}, torch::TensorOptions().dtype(torch::kInt64));
  for (int64_t r = 0; r < rows; ++r)
    softmax_top(logits.data_ptr<float>() + r * vocab, ranked[r], width, probs.data_ptr<float>() + r * width,
                indices.data_ptr<int64_t>() + r * width);
  return {probs, indices};
}

// One depth of a residual draft head on B rows (Hydra's head k: `extra` holds the path's k token
// embeddings; a head without a mix passes an empty `extra`):
//   x = hidden + mix([hidden; extra_r])       (mix's bias included)
//   x = x + silu(block(x))                    for each block
//   the `width` most probable projection rows of softmax(projection(x)), best first
// hidden [H], extra [B, E] fp32 -> (probabilities [B, width] fp32, projection rows [B, width] int64)
std::vector<torch::Tensor> draft_head(torch::Tensor hidden, torch::Tensor extra, const Weight* mix,
                                      const std::vector<Weight*>& blocks, const Weight& projection, int64_t width) {
  auto h = hidden.to(torch::kFloat32).contiguous();
  auto e = extra.to(torch::kFloat32).contiguous();
  const int64_t size = h.numel(), rows = e.size(0), wide = e.size(1);
  TORCH_CHECK(size % LANES == 0 && projection.in == size, "hidden width ", size);
  TORCH_CHECK(mix == nullptr || (mix->in == size + wide && mix->out == size), "mix shape");
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor x = h.expand({rows, size}).clone(at::MemoryFormat::Contiguous);  // [B, H], never the caller's hidden
  float* xs = x.data_ptr<float>();
  torch::Tensor t = torch::empty({rows, size}, opts);
  if (mix != nullptr) {
    torch::Tensor input = torch::cat({x, e}, 1);  // [B, H + E]
    matmul_into(input.data_ptr<float>(), rows, *mix, t.data_ptr<float>());
    add_into_rows(xs, t.data_ptr<float>(), rows * size);
  }
  add_blocks(xs, rows, blocks, size);
  return top_guesses(xs, rows, projection, {}, width);
}

// Medusa's heads at one hidden state [H], fp32: head d's state is hidden + silu(first_d(hidden)) (every
// head's first ResBlock stacked in `first`: [D*H, H]), then + silu(block(state)) for each of its later
// blocks (`later`: D lists); one projection of all D states over its rows, and head d's `width` most
// probable of its first rows[d] rows of softmax -> (probabilities [D, width], projection rows [D, width])
std::vector<torch::Tensor> medusa_heads(torch::Tensor hidden, const Weight& first,
                                        const std::vector<std::vector<Weight*>>& later, const Weight& projection,
                                        const std::vector<int64_t>& rows, int64_t width) {
  auto h = hidden.to(torch::kFloat32).contiguous();
  const int64_t size = h.numel(), depth = static_cast<int64_t>(rows.size());
  TORCH_CHECK(size % LANES == 0 && first.in == size && first.out == depth * size && projection.in == size &&
              static_cast<int64_t>(later.size()) == depth, "Medusa heads' shapes");
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor states = h.expand({depth, size}).clone(at::MemoryFormat::Contiguous);  // [D, H], a copy
  torch::Tensor t = torch::empty({depth, size}, opts);
  float* xs = states.data_ptr<float>();
  matmul_into(h.data_ptr<float>(), 1, first, t.data_ptr<float>());  // [1, D*H]: every head's first block
  add_silu(xs, t.data_ptr<float>(), depth * size);
  for (int64_t d = 0; d < depth; ++d) add_blocks(xs + d * size, 1, later[d], size);
  return top_guesses(xs, depth, projection, rows, width);
}

// One query q [d] over `total` keys and values (key_at(t), value_at(t): rows of d numbers), the softmax in
// key order (scores: room for `total`) -> out [d]
template <typename KeyAt, typename ValueAt>
void attend_query(const float* q, int64_t total, int64_t d, float scale, const KeyAt& key_at, const ValueAt& value_at,
                  float* scores, float* out) {
  float peak = -INFINITY;
  for (int64_t t = 0; t < total; ++t) {
    v16f acc{};
    for (int64_t i = 0; i < d; i += LANES) acc = vfma(vload(q + i), vload(key_at(t) + i), acc);
    scores[t] = hsum(acc) * scale;
    peak = std::max(peak, scores[t]);
  }
  float sum = 0.0f;
  for (int64_t t = 0; t < total; ++t) sum += scores[t] = std::exp(scores[t] - peak);
  for (int64_t i = 0; i < d; i += LANES) {
    v16f acc{};
    for (int64_t t = 0; t < total; ++t) acc = vfma(vset(scores[t]), vload(value_at(t) + i), acc);
    vstore(out + i, acc * (1.0f / sum));
  }
}

// A decoder layer's end on `rows` rows y [rows, H] (the residual so far): y += o(attended), then
// y += down(silu(gate) * up), gate | up = gate_up(norm(y) * mlp_norm)
void finish_layer(float* y, const float* attended, int64_t rows, const Weight& o, const float* mlp_norm,
                  const Weight& gate_up, const Weight& down, float eps) {
  const int64_t size = down.out, inner = down.in;
  std::vector<float> delta(rows * size), normed(rows * size), mlp(rows * gate_up.out), act(rows * inner);
  matmul_into(attended, rows, o, delta.data());
  add_into_rows(y, delta.data(), rows * size);
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(y + r * size, mlp_norm, normed.data() + r * size, size, eps);
  matmul_into(normed.data(), rows, gate_up, mlp.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < inner; ++i) {
      const float gate = mlp[r * 2 * inner + i];
      act[r * inner + i] = gate / (1.0f + std::exp(-gate)) * mlp[r * 2 * inner + inner + i];
    }
  matmul_into(act.data(), rows, down, delta.data());
  add_into_rows(y, delta.data(), rows * size);
}

// rms_norm_row over each of n rows
void norm_rows(const float* x, const float* weight, float* y, int64_t n, int64_t h, float eps) {
  for (int64_t r = 0; r < n; ++r) rms_norm_row(x + r * h, weight + 0, y + r * h, h, eps);
}

// top_guesses of the rows x [rows, size] after rms_norm_row with `norm` (a draft layer's output norm)
std::vector<torch::Tensor> normed_top_guesses(const float* x, int64_t rows, int64_t size, const float* norm,
                                              const Weight& projection, int64_t width, float eps) {
  std::vector<float> normed(rows * size);
  norm_rows(x, norm, normed.data(), rows, size, eps);
  return top_guesses(normed.data(), rows, projection, {}, width);
}

// x [d] rotated as the two-halves convention does it: x * cos + [-x2, x1] * sin (cos, sin [d])
void rotate_halves(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float first = x[i], second = x[i + half];
    x[i] = first * cos[i] + (-second) * sin[i];
    x[i + half] = second * cos[i + half] + first * sin[i + half];
  }
}

// EAGLE's layer input [rows, 2H]: [norm(e) * embed_norm; norm(x) * attn_norm] of each row's token
// embedding e and state x ([rows, H] each)
torch::Tensor eagle_inputs(const float* e, const float* x, int64_t rows, int64_t size, const float* embed_norm,
                           const float* attn_norm, float eps) {
  torch::Tensor input = torch::empty({rows, 2 * size}, torch::TensorOptions().dtype(torch::kFloat32));
  float* in = input.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    rms_norm_row(e + r * size, embed_norm, in + r * 2 * size, size, eps);
    rms_norm_row(x + r * size, attn_norm, in + r * 2 * size + size, size, eps);
  }
  return input;
}

// One row's keys and values out of its kv projection [2 * kv_heads * d] (keys rotated by cos, sin [d]):
// key head g to keys + g * head_stride, value head g to values + g * head_stride
void put_rotated_kv(const float* kv, int64_t kv_heads, int64_t d, const float* cos, const float* sin, float* keys,
                    float* values, int64_t head_stride) {
  for (int64_t g = 0; g < kv_heads; ++g) {
    std::memcpy(keys + g * head_stride, kv + g * d, d * 4);
    rotate_halves(keys + g * head_stride, cos, sin, d);
    std::memcpy(values + g * head_stride, kv + (kv_heads + g) * d, d * 4);
  }
}

// One depth of EAGLE's draft layer (core/drafters/eagle.py, EagleLayer.draft, then the projection of its
// normed output and each row's top guesses), fp32. B rows: parent states x [B, H] and their tokens'
// embeddings e [B, H], all at one position (cos, sin [d]); each row's query heads attend the cache
// (keys, values [kv_heads, L, d], any strides with contiguous rows), the draft keys and values [kv_heads, M, d] that
// `ancestors` [B, M] marks, and the row's own key. Returns (states [B, H], keys, values [kv_heads, B, d],
// probabilities [B, width], projection rows [B, width]).
std::vector<torch::Tensor> eagle_depth(torch::Tensor parents, torch::Tensor embeds, torch::Tensor cos,
                                       torch::Tensor sin, torch::Tensor cache_keys, torch::Tensor cache_values,
                                       torch::Tensor draft_keys, torch::Tensor draft_values, torch::Tensor ancestors,
                                       const std::vector<torch::Tensor>& norms, const std::vector<Weight*>& weights,
                                       const Weight& projection, int64_t heads, int64_t width, double eps) {
  auto x = parents.to(torch::kFloat32).contiguous();
  auto e = embeds.to(torch::kFloat32).contiguous();
  auto c = cos.to(torch::kFloat32).contiguous(), sn = sin.to(torch::kFloat32).contiguous();
  auto dk = draft_keys.to(torch::kFloat32).contiguous(), dv = draft_values.to(torch::kFloat32).contiguous();
  auto seen = ancestors.to(torch::kBool).contiguous();
  TORCH_CHECK(norms.size() == 4 && weights.size() == 5, "norms: embed, attn, mlp, out; weights: q, kv, o, gate_up, down");
  const Weight &wq = *weights[0], &wkv = *weights[1], &wo = *weights[2], &wgu = *weights[3], &wdown = *weights[4];
  const int64_t rows = x.size(0), size = x.size(1), kv_heads = cache_keys.size(0), length = cache_keys.size(1);
  const int64_t d = cache_keys.size(2), drafted = dk.numel() ? dk.size(1) : 0, group = heads / kv_heads;
  TORCH_CHECK(cache_keys.scalar_type() == torch::kFloat32 && cache_values.scalar_type() == torch::kFloat32 &&
              cache_keys.stride(2) == 1 && cache_values.stride(2) == 1, "the cache: fp32, each row contiguous");
  TORCH_CHECK(wq.in == 2 * size && wq.out == heads * d && wkv.out == 2 * kv_heads * d && wo.in == heads * d &&
              wdown.out == size && d % LANES == 0 && size % LANES == 0 && seen.size(1) == drafted, "EAGLE shapes");
  const float ep = static_cast<float>(eps);
  std::vector<torch::Tensor> nw;
  for (const auto& n : norms) nw.push_back(n.to(torch::kFloat32).contiguous());
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor q = torch::empty({rows, heads * d}, opts), kv = torch::empty({rows, 2 * kv_heads * d}, opts);
  torch::Tensor input = eagle_inputs(e.data_ptr<float>(), x.data_ptr<float>(), rows, size, nw[0].data_ptr<float>(),
                                     nw[1].data_ptr<float>(), ep);
  matmul_into(input.data_ptr<float>(), rows, wq, q.data_ptr<float>());
  matmul_into(input.data_ptr<float>(), rows, wkv, kv.data_ptr<float>());
  torch::Tensor keys = torch::empty({kv_heads, rows, d}, opts), values = torch::empty({kv_heads, rows, d}, opts);
  for (int64_t r = 0; r < rows; ++r) {
    float* qr = q.data_ptr<float>() + r * heads * d;
    for (int64_t h = 0; h < heads; ++h) rotate_halves(qr + h * d, c.data_ptr<float>(), sn.data_ptr<float>(), d);
    put_rotated_kv(kv.data_ptr<float>() + r * 2 * kv_heads * d, kv_heads, d, c.data_ptr<float>(), sn.data_ptr<float>(),
                   keys.data_ptr<float>() + r * d, values.data_ptr<float>() + r * d, rows * d);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  torch::Tensor attended = torch::empty({rows, heads * d}, opts);
  std::vector<float> scores(length + drafted + 1);
  std::vector<const float*> key_at(length + drafted + 1), value_at(length + drafted + 1);
  const bool* marks = seen.data_ptr<bool>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < kv_heads; ++g) {
      int64_t total = 0;  // the keys row r sees: the cache, its marked ancestors, itself
      for (int64_t t = 0; t < length; ++t, ++total) {
        key_at[total] = cache_keys.data_ptr<float>() + g * cache_keys.stride(0) + t * cache_keys.stride(1);
        value_at[total] = cache_values.data_ptr<float>() + g * cache_values.stride(0) + t * cache_values.stride(1);
      }
      for (int64_t m = 0; m < drafted; ++m)
        if (marks[r * drafted + m]) {
          key_at[total] = dk.data_ptr<float>() + (g * drafted + m) * d;
          value_at[total++] = dv.data_ptr<float>() + (g * drafted + m) * d;
        }
      key_at[total] = keys.data_ptr<float>() + (g * rows + r) * d;
      value_at[total++] = values.data_ptr<float>() + (g * rows + r) * d;
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        attend_query(q.data_ptr<float>() + (r * heads + h) * d, total, d, scale,
                     [&](int64_t t) { return key_at[t]; }, [&](int64_t t) { return value_at[t]; }, scores.data(),
                     attended.data_ptr<float>() + (r * heads + h) * d);
    }
  torch::Tensor states = x.clone();  // [B, H]
  float* st = states.data_ptr<float>();
  finish_layer(st, attended.data_ptr<float>(), rows, wo, nw[2].data_ptr<float>(), wgu, wdown, ep);
  std::vector<torch::Tensor> guesses = normed_top_guesses(st, rows, size, nw[3].data_ptr<float>(), projection, width, ep);
  return {states, keys, values, guesses[0], guesses[1]};
}

// Each state's top guesses after a norm: states [B, H] -> rms_norm(state) * norm, projected, the `width`
// most probable projection rows by softmax (EAGLE's root level: the layer's output at the last accepted
// position) -> (probabilities [B, width], projection rows [B, width])
std::vector<torch::Tensor> normed_guesses(torch::Tensor states, torch::Tensor norm, const Weight& projection,
                                          int64_t width, double eps) {
  auto x = states.to(torch::kFloat32).contiguous();
  auto w = norm.to(torch::kFloat32).contiguous();
  const int64_t rows = x.size(0), size = x.size(1);
  TORCH_CHECK(w.numel() == size && projection.in == size, "a norm and a projection of the states' width");
  return normed_top_guesses(x.data_ptr<float>(), rows, size, w.data_ptr<float>(), projection, width,
                            static_cast<float>(eps));
}

// EAGLE's draft layer over n accepted positions (EagleLayer.extend with last_only): features [n, 3H]
// fused to x, the embeddings e [n, H] of the tokens after them, positions' cos, sin [n, d]; every row's
// rotated key and its value enter the cache (keys, values [kv_heads, capacity, d] contiguous, rows
// [0, past) filled; the caller makes room), and the last row's output state comes back [H].
torch::Tensor eagle_extend(torch::Tensor features, torch::Tensor embeds, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor keys, torch::Tensor values, int64_t past,
                           const std::vector<torch::Tensor>& norms, const std::vector<Weight*>& weights,
                           int64_t heads, double eps) {
  auto f = features.to(torch::kFloat32).contiguous();
  auto e = embeds.to(torch::kFloat32).contiguous();
  auto c = cos.to(torch::kFloat32).contiguous(), sn = sin.to(torch::kFloat32).contiguous();
  TORCH_CHECK(norms.size() == 3 && weights.size() == 6, "norms: embed, attn, mlp; weights: fuse, q, kv, o, gate_up, down");
  const Weight &wf = *weights[0], &wq = *weights[1], &wkv = *weights[2], &wo = *weights[3], &wgu = *weights[4],
               &wdown = *weights[5];
  const int64_t n = f.size(0), size = wf.out, kv_heads = keys.size(0), capacity = keys.size(1), d = keys.size(2);
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && keys.is_contiguous() && values.is_contiguous() &&
              values.sizes() == keys.sizes() && past + n <= capacity && n > 0, "the cache: contiguous fp32 with room");
  TORCH_CHECK(wf.in == f.size(1) && wq.in == 2 * size && wq.out == heads * d && wkv.out == 2 * kv_heads * d &&
              c.size(0) == n && c.size(1) == d && d % LANES == 0 && size % LANES == 0, "EAGLE shapes");
  const float ep = static_cast<float>(eps);
  std::vector<torch::Tensor> nw;
  for (const auto& w : norms) nw.push_back(w.to(torch::kFloat32).contiguous());
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor x = torch::empty({n, size}, opts);
  torch::Tensor kv = torch::empty({n, 2 * kv_heads * d}, opts), q = torch::empty({1, heads * d}, opts);
  matmul_into(f.data_ptr<float>(), n, wf, x.data_ptr<float>());
  torch::Tensor input = eagle_inputs(e.data_ptr<float>(), x.data_ptr<float>(), n, size, nw[0].data_ptr<float>(),
                                     nw[1].data_ptr<float>(), ep);
  const float* in = input.data_ptr<float>();
  matmul_into(in, n, wkv, kv.data_ptr<float>());
  matmul_into(in + (n - 1) * 2 * size, 1, wq, q.data_ptr<float>());  // the last row's queries only
  float* key_data = keys.data_ptr<float>();
  float* value_data = values.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    put_rotated_kv(kv.data_ptr<float>() + r * 2 * kv_heads * d, kv_heads, d, c.data_ptr<float>() + r * d,
                   sn.data_ptr<float>() + r * d, key_data + (past + r) * d, value_data + (past + r) * d, capacity * d);
  float* qs = q.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h) rotate_halves(qs + h * d, c.data_ptr<float>() + (n - 1) * d,
                                                    sn.data_ptr<float>() + (n - 1) * d, d);
  const int64_t total = past + n, group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> attended(heads * d), scores(total);
  for (int64_t h = 0; h < heads; ++h) {
    const float* hk = key_data + h / group * capacity * d;
    const float* hv = value_data + h / group * capacity * d;
    attend_query(qs + h * d, total, d, scale, [&](int64_t t) { return hk + t * d; },
                 [&](int64_t t) { return hv + t * d; }, scores.data(), attended.data() + h * d);
  }
  torch::Tensor y = x[n - 1].clone();  // [H]
  finish_layer(y.data_ptr<float>(), attended.data(), 1, wo, nw[2].data_ptr<float>(), wgu, wdown, ep);
  return y;
}

// One step of a causal decoder layer without positions over a drafter's own cache (Hydra++'s prefix
// layer): n new rows hidden [n, H] enter the cache (keys, values [heads, capacity, d] fp32, rows
// [0, past) filled; the caller makes room), and the last row's output comes back [H]:
//   a = norm(x) * attn_norm;  q, k, v = a @ qkv  (k, v of every new row written at past..past+n-1)
//   y = x_last + out(attention of the last row's q over all past + n rows)
//   y = y + down(silu(gate) * up),  gate | up = gate_up(norm(y) * mlp_norm)
torch::Tensor prefix_step(torch::Tensor hidden, torch::Tensor keys, torch::Tensor values, int64_t past,
                          torch::Tensor attn_norm, const Weight& qkv, const Weight& out, torch::Tensor mlp_norm,
                          const Weight& gate_up, const Weight& down, double eps) {
  auto x = hidden.to(torch::kFloat32).contiguous();
  const int64_t n = x.size(0), size = x.size(1), heads = keys.size(0), capacity = keys.size(1), d = keys.size(2);
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && keys.is_contiguous() && values.is_contiguous() &&
              values.sizes() == keys.sizes(), "the cache must be contiguous fp32 [heads, capacity, d]");
  TORCH_CHECK(heads * d == size && d % LANES == 0 && past + n <= capacity && n > 0, "prefix cache shape");
  TORCH_CHECK(qkv.in == size && qkv.out == 3 * size && out.in == size && gate_up.in == size &&
              down.out == size && down.in * 2 == gate_up.out, "prefix layer shapes");
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  const float e = static_cast<float>(eps);
  auto an = attn_norm.to(torch::kFloat32).contiguous(), mn = mlp_norm.to(torch::kFloat32).contiguous();
  torch::Tensor normed = torch::empty({n, size}, opts), projected = torch::empty({n, 3 * size}, opts);
  for (int64_t r = 0; r < n; ++r)
    rms_norm_row(x.data_ptr<float>() + r * size, an.data_ptr<float>(), normed.data_ptr<float>() + r * size, size, e);
  matmul_into(normed.data_ptr<float>(), n, qkv, projected.data_ptr<float>());
  const float* p = projected.data_ptr<float>();
  float* key_data = keys.data_ptr<float>();
  float* value_data = values.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t head = 0; head < heads; ++head) {
      std::memcpy(key_data + (head * capacity + past + r) * d, p + r * 3 * size + size + head * d, d * 4);
      std::memcpy(value_data + (head * capacity + past + r) * d, p + r * 3 * size + 2 * size + head * d, d * 4);
    }
  const int64_t total = past + n;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> attended(size), scores(total);
  const float* q = p + (n - 1) * 3 * size;  // the last row's queries
  for (int64_t head = 0; head < heads; ++head) {
    const float* hk = key_data + head * capacity * d;
    const float* hv = value_data + head * capacity * d;
    attend_query(q + head * d, total, d, scale, [&](int64_t t) { return hk + t * d; },
                 [&](int64_t t) { return hv + t * d; }, scores.data(), attended.data() + head * d);
  }
  torch::Tensor y = x[n - 1].clone();  // [H]
  finish_layer(y.data_ptr<float>(), attended.data(), 1, out, mn.data_ptr<float>(), gate_up, down, e);
  return y;
}

class Model {
 public:
  Model(Config config, std::vector<Layer> layers, Weight embed, torch::Tensor final_norm, Weight lm_head,
        torch::Tensor cos, torch::Tensor sin)
      : cfg(config), layers(std::move(layers)), embed(std::move(embed)), final_norm(final_norm.contiguous()),
        lm_head(std::move(lm_head)), cos(cos.contiguous()), sin(sin.contiguous()) {
    TORCH_CHECK(cfg.head_dim % LANES == 0 && cfg.head_dim <= 512, "head_dim must be a multiple of 16, <= 512");
    TORCH_CHECK(cfg.hidden % LANES == 0 && cfg.intermediate % LANES == 0, "widths must be multiples of 16");
  }

  // `work(key_data, value_data)` on the cache's numbers as stored: fp16 bits (`half_t*`) or fp32
  template <typename Work>
  static torch::Tensor on_cache(torch::Tensor& keys, torch::Tensor& values, const Work& work) {
    if (keys.scalar_type() == torch::kHalf)
      return work(reinterpret_cast<half_t*>(keys.data_ptr<at::Half>()),
                  reinterpret_cast<half_t*>(values.data_ptr<at::Half>()));
    return work(keys.data_ptr<float>(), values.data_ptr<float>());
  }

  static bool cache_type_ok(const torch::Tensor& keys, const torch::Tensor& values) {
    const auto type = keys.scalar_type();
    return (type == torch::kFloat32 || type == torch::kHalf) && values.scalar_type() == type && keys.is_contiguous() &&
           values.is_contiguous();
  }

  // hidden [n, H] (after the final norm) of ids [n] at positions [n], on top of `past` cached rows
  // of keys/values [layers, 1, kv_heads, capacity, d] (fp32 or fp16), which receive the new rows at
  // past..past+n-1. tree_mask: bool [n, n] (row i true on what token i sees) or empty (causal).
  // tapped [T, n, H] fp32 receives the residual stream entering layer taps[t] (a drafter's
  // features; empty: none).
  torch::Tensor forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor keys, torch::Tensor values,
                        int64_t past, torch::Tensor tree_mask, std::vector<int64_t> taps, torch::Tensor tapped) const {
    const int64_t n = ids.size(0);
    TORCH_CHECK(cache_type_ok(keys, values), "the cache must be contiguous keys and values, both fp32 or both fp16");
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
    const int64_t capacity = keys.size(3), layer_stride = keys.stride(0);
    return on_cache(keys, values, [&](auto* key_data, auto* value_data) {
      return run_layers(id, n, taps, tapped,
          [&](size_t l, float* qkv) {
            store_rotated(qkv, pos, n, past, key_data + l * layer_stride, value_data + l * layer_stride, capacity);
          },
          [&](size_t l, const float* qkv, float* attended) {
            attention(qkv, seen, past, key_data + l * layer_stride, value_data + l * layer_stride, capacity, attended);
          });
    });
  }

  // Batched generation: hidden [B, H] (after the final norm) of one new token a slot, ids[b] at position
  // lengths[b] of slot b, whose own cache keys/values [B, layers, 1, kv_heads, capacity, d] (fp32 or fp16)
  // receives it there. Row b attends its slot's rows [0, lengths[b]] alone, through the same products,
  // rotation and attend_one as the one-sequence forward's plain step at that position: bit for bit
  // that step. tapped [T, B, H] as in forward.
  torch::Tensor forward_slots(torch::Tensor ids, torch::Tensor keys, torch::Tensor values, torch::Tensor lengths,
                              std::vector<int64_t> taps, torch::Tensor tapped) const {
    const int64_t n = ids.size(0);
    TORCH_CHECK(cache_type_ok(keys, values) && values.sizes() == keys.sizes(),
                "the slots' cache must be contiguous keys and values, both fp32 or both fp16");
    TORCH_CHECK(keys.dim() == 6 && keys.size(0) == n && keys.size(1) == static_cast<int64_t>(layers.size()) &&
                keys.size(2) == 1 && keys.size(3) == cfg.kv_heads && keys.size(5) == cfg.head_dim,
                "the slots' cache must be [slots, layers, 1, kv_heads, capacity, head_dim]");
    auto ids_c = ids.to(torch::kLong).contiguous();
    auto len_c = lengths.to(torch::kLong).contiguous();
    TORCH_CHECK(len_c.numel() == n, "one length a slot");
    const int64_t* id = ids_c.data_ptr<int64_t>();
    const int64_t* len = len_c.data_ptr<int64_t>();
    const int64_t capacity = keys.size(4), slot_stride = keys.stride(0), layer_stride = keys.stride(1);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < embed.out, "token id out of range");
      TORCH_CHECK(len[i] >= 0 && len[i] < capacity && len[i] < cos.size(0), "a slot is full");
    }
    const int64_t width = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim;
    return on_cache(keys, values, [&](auto* key_data, auto* value_data) {
      return run_layers(id, n, taps, tapped,
          [&](size_t l, float* qkv) {
            for (int64_t i = 0; i < n; ++i)  // each row as a one-row forward of its own slot
              store_rotated(qkv + i * width, len + i, 1, len[i], key_data + i * slot_stride + l * layer_stride,
                            value_data + i * slot_stride + l * layer_stride, capacity);
          },
          [&](size_t l, const float* qkv, float* attended) {
            attention_slots(qkv, len, n, key_data + l * layer_stride, value_data + l * layer_stride, slot_stride,
                            capacity, attended);
          });
    });
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

  // Embed ids [n], run every layer (`store(l, qkv)` writes layer l's new keys and values, `attend(l, qkv,
  // attended)` attends them) and the final norm: hidden [n, H]. tapped [T, n, H] receives the residual
  // stream entering each layer of `taps`.
  template <class Store, class Attend>
  torch::Tensor run_layers(const int64_t* id, int64_t n, const std::vector<int64_t>& taps, torch::Tensor& tapped,
                           const Store& store, const Attend& attend) const {
    const int64_t h = cfg.hidden, d = cfg.head_dim;
    auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor x = torch::empty({n, h}, opts), normed = torch::empty({n, h}, opts);
    torch::Tensor qkv = torch::empty({n, layers[0].qkv.out}, opts);
    torch::Tensor attended = torch::empty({n, cfg.heads * d}, opts), delta = torch::empty({n, h}, opts);
    torch::Tensor gate_up = torch::empty({n, 2 * cfg.intermediate}, opts);
    torch::Tensor act = torch::empty({n, cfg.intermediate}, opts);
    float* xp = x.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) embed.row_into(id[i], xp + i * h);
    TORCH_CHECK(taps.empty() || (tapped.scalar_type() == torch::kFloat32 && tapped.is_contiguous() &&
                                 tapped.size(0) == static_cast<int64_t>(taps.size()) && tapped.size(1) == n &&
                                 tapped.size(2) == h), "tapped must be contiguous fp32 [taps, n, H]");
    for (size_t l = 0; l < layers.size(); ++l) {
      for (size_t t = 0; t < taps.size(); ++t) {
        if (taps[t] == static_cast<int64_t>(l)) std::copy(xp, xp + n * h, tapped.data_ptr<float>() + t * n * h);
      }
      const Layer& layer = layers[l];
      rms_norm(xp, layer.attn_norm.data_ptr<float>(), normed.data_ptr<float>(), n, h, cfg.eps);
      matmul_into(normed.data_ptr<float>(), n, layer.qkv, qkv.data_ptr<float>());
      store(l, qkv.data_ptr<float>());
      attend(l, qkv.data_ptr<float>(), attended.data_ptr<float>());
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

  // each slot's row over its own cache: rows [0, len[i]) then itself (stored at len[i]), by attend_one
  template <typename KV>
  void attention_slots(const float* qkv, const int64_t* len, int64_t n, const KV* keys, const KV* values,
                       int64_t slot_stride, int64_t capacity, float* out) const {
    const int64_t d = cfg.head_dim, width = (cfg.heads + 2 * cfg.kv_heads) * d, group = cfg.heads / cfg.kv_heads;
    const int64_t itself = 0;
    auto attend = [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / cfg.heads, head = task % cfg.heads, kv = head / group;
        const int64_t at = i * slot_stride + kv * capacity * d;
        attend_one(qkv + i * width + head * d, keys + at, values + at, len[i], &itself, 1, d, cfg.scale,
                   out + i * cfg.heads * d + head * d, scores);
      }
    };
    int64_t keys_read = 0;
    for (int64_t i = 0; i < n; ++i) keys_read += cfg.heads * (len[i] + 1);
    if (keys_read < PARALLEL_KEYS) attend(0, n * cfg.heads);
    else at::parallel_for(0, n * cfg.heads, 1, attend);
  }

  template <typename KV>
  void store_rotated(float* qkv, const int64_t* pos, int64_t n, int64_t past, KV* keys, KV* values,
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
          kv_store(keys + at, row + (cfg.heads + kv) * d, d);
          kv_store(values + at, row + (cfg.heads + cfg.kv_heads + kv) * d, d);
        }
      }
    });
  }

  // Whether n rows' attention runs by KV group (attention_shared) rather than by head (attend_one): always
  // with AVX512; with AVX2 from SHARED_ATTENTION_ROWS rows (a prefill). On a 2-core Zen 3, interleaved
  // runs, gguf-q8, by group against by head: a 1,400-token prefill 3.2 against 4.5 s; trees of 1-16 rows
  // over 150 or 1,400 cached tokens within -7 % to +4 % (3 rows: a group's task per KV head, 3 tasks on 2
  // threads, where by head 9 tasks share out evenly)
  bool shared_attention_pays(int64_t n) const {
    if (cfg.heads / cfg.kv_heads > SHARED_QUERIES) return false;
#if defined(HALF_LANES)
    return n >= SHARED_ATTENTION_ROWS;
#else
    (void)n;
    return true;
#endif
  }

  template <typename KV>
  void attention(const float* qkv, const std::vector<std::vector<int64_t>>& seen, int64_t past, const KV* keys,
                 const KV* values, int64_t capacity, float* out) const {
    if (shared_attention_pays(static_cast<int64_t>(seen.size())))
      return attention_shared(qkv, seen, past, keys, values, capacity, out);
    const int64_t n = static_cast<int64_t>(seen.size()), d = cfg.head_dim;
    const int64_t width = (cfg.heads + 2 * cfg.kv_heads) * d, group = cfg.heads / cfg.kv_heads;
    // tasks head-major (a head's rows in a row), so a thread's queries of one KV group follow each
    // other and read its keys and values from the cache after the first one's read from memory
    auto attend = [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t head = task / n, i = task % n, kv = head / group;
        attend_one(qkv + i * width + head * d, keys + kv * capacity * d, values + kv * capacity * d, past,
                   seen[i].data(), static_cast<int64_t>(seen[i].size()), d, cfg.scale,
                   out + i * cfg.heads * d + head * d, scores);
      }
    };
    // a few short rows are cheaper on the calling thread than split (each task's arithmetic is its own)
    if (n * cfg.heads * (past + n) < PARALLEL_KEYS) attend(0, n * cfg.heads);
    else at::parallel_for(0, n * cfg.heads, 1, attend);
  }

  // Tasks of one KV group's heads for a block of rows (as many as SHARED_QUERIES queries allow), each
  // reading the keys and values its rows share once (attend_shared). Blocks are dealt from both ends
  // (first, last, second, ...) so the threads' contiguous shares cost alike in a causal prefill.
  template <typename KV>
  void attention_shared(const float* qkv, const std::vector<std::vector<int64_t>>& seen, int64_t past,
                        const KV* keys, const KV* values, int64_t capacity, float* out) const {
    const int64_t n = static_cast<int64_t>(seen.size()), d = cfg.head_dim;
    const int64_t width = (cfg.heads + 2 * cfg.kv_heads) * d, group = cfg.heads / cfg.kv_heads;
    const int64_t rows_per_block = std::max<int64_t>(1, SHARED_QUERIES / group);
    const int64_t blocks = (n + rows_per_block - 1) / rows_per_block, tasks = blocks * cfg.kv_heads;
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
    if (n * cfg.heads * (past + n) < PARALLEL_KEYS) attend(0, tasks);
    else at::parallel_for(0, tasks, 1, attend);
  }

  void silu_mul(const float* gate_up, float* out, int64_t n) const {
    const int64_t width = cfg.intermediate;
    for_rows(n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* gate = gate_up + r * 2 * width;
        const float* up = gate + width;
#if defined(HALF_LANES)
        for (int64_t i = 0; i < width; i += 8) {  // the same per lane, in registers GCC keeps
          const v8f g = vload8(gate + i), value = g / (vexp8(-g) + 1.0f) * vload8(up + i);
          std::memcpy(out + r * width + i, &value, sizeof value);
        }
#else
        for (int64_t i = 0; i < width; i += LANES) {
          const v16f g = vload(gate + i);
          vstore(out + r * width + i, g / (vexp(-g) + 1.0f) * vload(up + i));
        }
#endif
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
      .def("forward_slots", &Model::forward_slots, py::call_guard<py::gil_scoped_release>())
      .def("project", &Model::project, py::call_guard<py::gil_scoped_release>());
  m.def("matmul", &Model::matmul, "x @ w.T by the row-invariant product", py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &Model::dequantize, "a weight's rows as fp32 [out, in]");
  m.def("prefix_step", &prefix_step, "a drafter's causal layer without positions: new rows into its cache, the last one's output",
        py::arg("hidden"), py::arg("keys"), py::arg("values"), py::arg("past"), py::arg("attn_norm"), py::arg("qkv"),
        py::arg("out"), py::arg("mlp_norm"), py::arg("gate_up"), py::arg("down"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("medusa_heads", &medusa_heads, "Medusa's heads at one hidden state: (probabilities, projection rows) of each head's top guesses",
        py::arg("hidden"), py::arg("first"), py::arg("later"), py::arg("projection"), py::arg("rows"), py::arg("width"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eagle_extend", &eagle_extend, "EAGLE's draft layer over accepted positions: their keys and values into the cache, the last one's state",
        py::arg("features"), py::arg("embeds"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"),
        py::arg("past"), py::arg("norms"), py::arg("weights"), py::arg("heads"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eagle_depth", &eagle_depth, "one depth of EAGLE's draft layer: states, keys, values, and each row's top guesses",
        py::arg("parents"), py::arg("embeds"), py::arg("cos"), py::arg("sin"), py::arg("cache_keys"),
        py::arg("cache_values"), py::arg("draft_keys"), py::arg("draft_values"), py::arg("ancestors"), py::arg("norms"),
        py::arg("weights"), py::arg("projection"), py::arg("heads"), py::arg("width"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("normed_guesses", &normed_guesses, "each state's top guesses after a norm: (probabilities, projection rows)",
        py::arg("states"), py::arg("norm"), py::arg("projection"), py::arg("width"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("draft_head", &draft_head, "one depth of a residual draft head: (probabilities, projection rows) of its top guesses",
        py::arg("hidden"), py::arg("extra"), py::arg("mix"), py::arg("blocks"), py::arg("projection"), py::arg("width"),
        py::call_guard<py::gil_scoped_release>());
}
