// The cpu backend's weight ops on weights stored narrower than float32 (loaded by kernels.py with
// fused_ops.cpp into one library): bf16 / f16 matrices and backends/quant.py's formats, FP8 e4m3
// with block scales and FP4 e2m1 (two a byte, element 2i in the low nibble) with per-32 scales.
//
// Decode is memory-bound: reading 2, 1 or half a byte per weight instead of 4 is the speed-up, as
// llama.cpp does with its block formats. So nothing is widened in memory: each kernel streams the
// weight's bytes and decodes 8 values at a time in registers (AVX2 + F16C; a scalar path
// elsewhere), activations stay float32, and every product accumulates in float32:
//   y[t, n] = sum_kb scale[n / b0, kb] * sum_{k in block kb} x[t, k] * value[n, k]
// (plain bf16 / f16: one block, no scale). The decode is exact, so a result differs from
// float32 math on the dequantized weight only by rounding order (tests/unit/test_quant_kernels.py).
//
// A row's result depends only on its own x and the weight, never on how many tokens share the call
// (every path below sums in the same order), so the ops are batch-invariant. Rows are split over
// threads in groups of 4; with several tokens a group is decoded once into a small buffer and
// multiplied by every token while it is hot in cache, so a weight is read from memory, and
// decoded, once per call.

#include "kernel_util.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#endif

namespace deepinfer_cpu {
namespace {

// Storage formats, as kernels.py numbers them.
enum Format : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2, kFP8 = 3, kFP4 = 4 };

constexpr bool scaled(int64_t f) { return f == kFP8 || f == kFP4; }

// The decoders return value / kFold exactly (FP8: the bits as an IEEE half, 2^-8 of the e4m3 value;
// FP4: twice the e2m1 value as an integer); kFold is multiplied into each block's scale.
constexpr float fold(int64_t f) { return f == kFP8 ? 256.0f : f == kFP4 ? 0.5f : 1.0f; }

inline float e8m0(uint8_t e) {
  if (e == 0) return std::ldexp(1.0f, -127);  // the one subnormal exponent
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(static_cast<float>(man), -24);
  if (exp == 31) return man ? std::numeric_limits<float>::quiet_NaN() : (sign ? -1.0f : 1.0f) * INFINITY;
  const uint32_t bits = sign | ((exp + 112) << 23) | (man << 13);
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Twice the e2m1 value of each 4-bit code (bit 3: the sign).
constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <int64_t F>
inline float decode1(const uint8_t* row, int64_t k) {
  if constexpr (F == kF32) {
    float v;
    std::memcpy(&v, row + 4 * k, 4);
    return v;
  } else if constexpr (F == kBF16 || F == kF16) {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    if constexpr (F == kF16) return half_to_float(h);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  } else if constexpr (F == kFP8) {
    const uint8_t b = row[k];
    return half_to_float(static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7)));
  } else {
    const uint8_t b = row[k >> 1];
    return static_cast<float>(kE2M1x2[(k & 1) ? (b >> 4) : (b & 0xF)]);
  }
}

#if defined(DEEPINFER_AVX2)
using V8 = __m256;
inline V8 v_zero() { return _mm256_setzero_ps(); }
inline V8 v_load(const float* p) { return _mm256_loadu_ps(p); }
inline V8 v_fma(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }
inline V8 v_set1(float s) { return _mm256_set1_ps(s); }
// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): fixed
inline float v_sum(V8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// values k..k+7 of a row (k a multiple of 8), / kFold
template <int64_t F>
inline V8 decode8(const uint8_t* row, int64_t k) {
  if constexpr (F == kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  } else if constexpr (F == kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (F == kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
  } else if constexpr (F == kFP8) {
    // e4m3 (s eeee mmm) -> half (s 0eeee mmm0000000): the same number times 2^-8, subnormals included.
    // b << 7 puts the sign at bit 14; adding that bit to itself carries it into bit 15.
    const __m128i b = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))), 7);
    return _mm256_cvtph_ps(_mm_add_epi16(b, _mm_and_si128(b, _mm_set1_epi16(0x4000))));
  } else {
    int32_t four;
    std::memcpy(&four, row + (k >> 1), 4);
    const __m128i b = _mm_cvtsi32_si128(four);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    const __m128i codes = _mm_unpacklo_epi8(lo, hi);  // element 2i from the low nibble of byte i
    const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1x2));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(lut, codes)));
  }
}

// values k..k+8W-1 (k a multiple of 8W) as W vectors of 8: FP8 16 and FP4 32 at a time, sharing the
// loads and integer work of a whole 128-bit load of bytes between the vectors
template <int64_t F>
constexpr int kWide = F == kFP4 ? 4 : F == kFP8 ? 2 : 1;

template <int64_t F>
inline void decode_wide(const uint8_t* row, int64_t k, V8* out) {
  if constexpr (F == kFP8) {
    const __m256i b = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))), 7);
    const __m256i h = _mm256_add_epi16(b, _mm256_and_si256(b, _mm256_set1_epi16(0x4000)));  // as decode8
    out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  } else if constexpr (F == kFP4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (k >> 1)));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1x2));
    const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));  // elements 0..15 (2i: low nibble)
    const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));  // elements 16..31
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
  } else {
    out[0] = decode8<F>(row, k);
  }
}
#else
struct V8 {
  float v[8];
};
inline V8 v_zero() { return V8{}; }
inline V8 v_load(const float* p) {
  V8 o;
  for (int l = 0; l < 8; ++l) o.v[l] = p[l];
  return o;
}
inline V8 v_fma(V8 a, V8 b, V8 c) {
  for (int l = 0; l < 8; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return c;
}
inline V8 v_set1(float s) {
  V8 o;
  for (int l = 0; l < 8; ++l) o.v[l] = s;
  return o;
}
inline float v_sum(V8 v) { return ((v.v[0] + v.v[4]) + (v.v[2] + v.v[6])) + ((v.v[1] + v.v[5]) + (v.v[3] + v.v[7])); }
template <int64_t F>
inline V8 decode8(const uint8_t* row, int64_t k) {
  V8 o;
  for (int l = 0; l < 8; ++l) o.v[l] = decode1<F>(row, k + l);
  return o;
}
template <int64_t F>
constexpr int kWide = 1;
template <int64_t F>
inline void decode_wide(const uint8_t* row, int64_t k, V8* out) {
  out[0] = decode8<F>(row, k);
}
#endif

// One [N, K] matrix as stored: rows of bytes, scales per b0 x b1 tile (float32 or ue8m0 bytes).
struct Matrix {
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0, N = 0, K = 0;
  const float* scale_f32 = nullptr;
  const uint8_t* scale_e8m0 = nullptr;
  int64_t b0 = 1, b1 = 1, scale_cols = 0;

  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
  // the scale of row r's block kb, times the format's fold
  float scale(int64_t r, int64_t kb, float f) const {
    const int64_t i = (r / b0) * scale_cols + kb;
    return (scale_e8m0 != nullptr ? e8m0(scale_e8m0[i]) : scale_f32[i]) * f;
  }
};

// The values of a row, as dot_tile reads them: decoded from the stored bytes in registers
// (Packed), or loaded from a buffer a row group was decoded into once for all tokens (Decoded).
// Both give the same raw values (value / kFold, exact), so both paths compute bit-identical sums.
template <int64_t F>
struct Packed {
  static constexpr int kW = kWide<F>;
  const uint8_t* row;
  void load_wide(int64_t k, V8* out) const { decode_wide<F>(row, k, out); }
  V8 load8(int64_t k) const { return decode8<F>(row, k); }
  float load1(int64_t k) const { return decode1<F>(row, k); }
};
struct Decoded {
  static constexpr int kW = 1;
  const float* row;
  void load_wide(int64_t k, V8* out) const { out[0] = v_load(row + k); }
  V8 load8(int64_t k) const { return v_load(row + k); }
  float load1(int64_t k) const { return row[k]; }
};

// part[t][r] += x_t[k..kv) * row r's values, 8 at a time in k order (the order every source keeps),
// W vectors decoded per step where the source decodes several at once; each decoded vector feeds
// all TT tokens.
template <int R, int TT, class Rows>
inline void fma_tile(const float* const* xs, const Rows* rows, int64_t k, int64_t kv, V8 (*part)[R]) {
  constexpr int W = Rows::kW;
  for (; k + 8 * W <= kv; k += 8 * W)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {  // row by row: W decoded vectors live at a time, not R x W
      V8 vals[W];
      rows[r].load_wide(k, vals);
      #pragma GCC unroll 16
      for (int j = 0; j < W; ++j)
        #pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) part[t][r] = v_fma(v_load(xs[t] + k + 8 * j), vals[j], part[t][r]);
    }
  for (; k < kv; k += 8) {
    V8 xv[TT];
    #pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) xv[t] = v_load(xs[t] + k);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V8 wv = rows[r].load8(k);
      #pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) part[t][r] = v_fma(xv[t], wv, part[t][r]);
    }
  }
}

// outs[t][r] = x_t . row r0 + r of `w` for TT tokens and R rows (the module formula), the rows' values
// from `rows`, the blocks' scales (times the format's fold) from sc[r * blocks + kb]. Each (t, r)
// dot runs the same sequence of multiply-adds whatever TT and R (a tile only shares the loads: a
// row vector feeds TT tokens, a token's vector R rows), so a token's bits do not depend on how many
// tokens share the call. TT x R vector accumulators (and as many block partials) stay in registers
// up to TT * R = 12 with AVX-512's 32.
template <int64_t F, int R, int TT, class Rows>
inline void dot_tile(const float* const* xs, const Matrix& w, const Rows* rows, const float* sc,
                     float* const* outs) {
  const int64_t K = w.K;
  V8 acc[TT][R];
  #pragma GCC unroll 16
  for (int t = 0; t < TT; ++t)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[t][r] = v_zero();
  if constexpr (!scaled(F)) {
    const int64_t body = K & ~int64_t{7};
    fma_tile<R, TT>(xs, rows, 0, body, acc);
    #pragma GCC unroll 16
    for (int t = 0; t < TT; ++t)
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        // std::fma, not `s += a * b`: left to itself the compiler may contract the tails of some tile
        // widths and not of others (GCC -march=native on an AMD EPYC with AVX-512 did: two tokens
        // per call got other bits than one), and a token's bits then depend on its call's size
        float s = v_sum(acc[t][r]);
        for (int64_t k = body; k < K; ++k) s = std::fma(xs[t][k], rows[r].load1(k), s);
        outs[t][r] = s;
      }
  } else {
    float tail[TT][R] = {};
    const int64_t b1 = w.b1, blocks = w.scale_cols;
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += b1, ++kb) {
      const int64_t k1 = std::min(K, k0 + b1), kv = k0 + ((k1 - k0) & ~int64_t{7});
      V8 part[TT][R];
      #pragma GCC unroll 16
      for (int t = 0; t < TT; ++t)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) part[t][r] = v_zero();
      fma_tile<R, TT>(xs, rows, k0, kv, part);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const V8 sv = v_set1(sc[r * blocks + kb]);
        #pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) acc[t][r] = v_fma(part[t][r], sv, acc[t][r]);
      }
      if (kv < k1)  // a block not a multiple of 8 wide: its last values one by one
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < TT; ++t) {
            float p = 0.0f;
            for (int64_t k = kv; k < k1; ++k) p = std::fma(xs[t][k], rows[r].load1(k), p);
            tail[t][r] = std::fma(p, sc[r * blocks + kb], tail[t][r]);
          }
    }
    #pragma GCC unroll 16
    for (int t = 0; t < TT; ++t)
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) outs[t][r] = v_sum(acc[t][r]) + tail[t][r];
  }
}

// Raw values (value / kFold) of row r of w into buf[0..K)
template <int64_t F>
inline void decode_row(const Matrix& w, int64_t r, float* __restrict buf) {
  const uint8_t* row = w.row(r);
  const int64_t K = w.K, body = K & ~int64_t{7};
  constexpr int W = kWide<F>;
  int64_t k = 0;
  for (; k + 8 * W <= body; k += 8 * W) {
    V8 vals[W];
    decode_wide<F>(row, k, vals);
    for (int j = 0; j < W; ++j) std::memcpy(buf + k + 8 * j, &vals[j], sizeof(V8));
  }
  for (; k < body; k += 8) {
    const V8 v = decode8<F>(row, k);
    std::memcpy(buf + k, &v, sizeof(V8));
  }
  for (; k < K; ++k) buf[k] = decode1<F>(row, k);
}

// A group of rows is decoded once into a buffer when this many tokens share the call (the decode
// of FP8 / FP4 costs more than the multiply-adds); a single token decodes in registers.
constexpr int64_t kDecodeOnceTokens = 2;
// Tokens per tile (dot_tile): 3 x 4 rows of accumulators and block partials fill the registers.
constexpr int kTileTokens = 3;

// The scales of rows [r, r + R) times the format's fold, sc[i * scale_cols + kb] (once per row
// group, not once per token and block).
template <int64_t F, int R>
inline void row_scales(const Matrix& w, int64_t r, float* sc) {
  if constexpr (scaled(F))
    for (int i = 0; i < R; ++i)
      for (int64_t kb = 0; kb < w.scale_cols; ++kb) sc[i * w.scale_cols + kb] = w.scale(r + i, kb, fold(F));
}

// Every token of the call against R rows from `rows`: tiles of kTileTokens tokens, the rest (1 or 2) as one.
template <int64_t F, int R, class Rows, class XOf, class OutOf>
inline void tokens_by_tiles(XOf x_of, OutOf out_of, int64_t T, const Matrix& w, int64_t r, const Rows* rows,
                            const float* sc) {
  int64_t t = 0;
  for (; t + kTileTokens <= T; t += kTileTokens) {
    const float* xs[kTileTokens];
    float* outs[kTileTokens];
    for (int i = 0; i < kTileTokens; ++i) {
      xs[i] = x_of(t + i);
      outs[i] = out_of(t + i) + r;
    }
    dot_tile<F, R, kTileTokens>(xs, w, rows, sc, outs);
  }
  if (T - t == 2) {
    const float* xs[2] = {x_of(t), x_of(t + 1)};
    float* outs[2] = {out_of(t) + r, out_of(t + 1) + r};
    dot_tile<F, R, 2>(xs, w, rows, sc, outs);
  } else if (T - t == 1) {
    const float* xs[1] = {x_of(t)};
    float* outs[1] = {out_of(t) + r};
    dot_tile<F, R, 1>(xs, w, rows, sc, outs);
  }
}

// out_of(t)[r] for rows [r_begin, r_end) of w and T inputs x_of(t): rows in groups of 4, each group
// for every token while its bytes are in cache.
template <int64_t F, class XOf, class OutOf>
void gemm_rows_typed(XOf x_of, OutOf out_of, int64_t T, const Matrix& w, int64_t r_begin, int64_t r_end) {
  const int64_t K = w.K;
  const bool decode_once = T >= kDecodeOnceTokens && F != kF32;
  Scratch<float, 4096> buf(decode_once ? 4 * K : 0);
  Scratch<float, 256> sc(scaled(F) ? 4 * w.scale_cols : 0);
  int64_t r = r_begin;
  for (; r + 4 <= r_end; r += 4) {
    row_scales<F, 4>(w, r, sc.data());
    if (decode_once) {
      Decoded rows[4];
      for (int i = 0; i < 4; ++i) {
        decode_row<F>(w, r + i, buf.data() + i * K);
        rows[i].row = buf.data() + i * K;
      }
      tokens_by_tiles<F, 4>(x_of, out_of, T, w, r, rows, sc.data());
    } else {
      Packed<F> rows[4];
      for (int i = 0; i < 4; ++i) rows[i].row = w.row(r + i);
      tokens_by_tiles<F, 4>(x_of, out_of, T, w, r, rows, sc.data());
    }
  }
  for (; r < r_end; ++r) {
    row_scales<F, 1>(w, r, sc.data());
    Packed<F> rows[1] = {{w.row(r)}};
    tokens_by_tiles<F, 1>(x_of, out_of, T, w, r, rows, sc.data());
  }
}

template <class XOf, class OutOf>
void gemm_rows_any(int64_t fmt, XOf x_of, OutOf out_of, int64_t T, const Matrix& w, int64_t r_begin, int64_t r_end) {
  switch (fmt) {
    case kF32: return gemm_rows_typed<kF32>(x_of, out_of, T, w, r_begin, r_end);
    case kBF16: return gemm_rows_typed<kBF16>(x_of, out_of, T, w, r_begin, r_end);
    case kF16: return gemm_rows_typed<kF16>(x_of, out_of, T, w, r_begin, r_end);
    case kFP8: return gemm_rows_typed<kFP8>(x_of, out_of, T, w, r_begin, r_end);
    default: return gemm_rows_typed<kFP4>(x_of, out_of, T, w, r_begin, r_end);
  }
}

// A weight op's weight argument: (data, scale or None, [format, b0, b1]), a matrix or a stack.
struct Weight {
  at::Tensor data, scale;  // kept alive for the call
  int64_t fmt = kF32;
  std::vector<int64_t> lead;  // stack dims ([E] for experts)
  int64_t N = 0, K = 0;
  Matrix m;  // the first matrix; at(e) for the others

  Matrix at(int64_t e) const {
    Matrix out = m;
    out.data += e * N * m.row_bytes;
    const int64_t scale_rows = (N + m.b0 - 1) / m.b0;
    if (out.scale_f32 != nullptr) out.scale_f32 += e * scale_rows * m.scale_cols;
    if (out.scale_e8m0 != nullptr) out.scale_e8m0 += e * scale_rows * m.scale_cols;
    return out;
  }
};

Weight weight_of(const at::Tensor& data_in, const c10::optional<at::Tensor>& scale_in, at::IntArrayRef spec,
                 const char* name, int64_t dims) {
  TORCH_CHECK(spec.size() == 3, name, ": spec must be [format, b0, b1]");
  Weight w;
  w.fmt = spec[0];
  TORCH_CHECK(w.fmt >= kF32 && w.fmt <= kFP4, name, ": unknown format ", w.fmt);
  TORCH_CHECK(data_in.dim() == dims && data_in.device().is_cpu(), name, " must be a ", dims, "-d cpu tensor");
  static const at::ScalarType kDtype[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, at::kByte};
  TORCH_CHECK(data_in.scalar_type() == kDtype[w.fmt], name, ": format ", w.fmt, " needs ", kDtype[w.fmt],
              " data, got ", data_in.scalar_type());
  w.data = data_in.contiguous();
  for (int64_t d = 0; d < dims - 2; ++d) w.lead.push_back(w.data.size(d));
  w.N = w.data.size(-2);
  w.K = w.fmt == kFP4 ? 2 * w.data.size(-1) : w.data.size(-1);
  w.m.data = reinterpret_cast<const uint8_t*>(w.data.data_ptr());
  w.m.row_bytes = w.data.size(-1) * w.data.element_size();
  w.m.N = w.N;
  w.m.K = w.K;
  if (scaled(w.fmt)) {
    TORCH_CHECK(scale_in.has_value(), name, ": a quantized weight needs its scales");
    w.scale = scale_in->contiguous();
    w.m.b0 = spec[1];
    w.m.b1 = spec[2];
    TORCH_CHECK(w.m.b0 >= 1 && w.m.b1 >= 1, name, ": block must be positive");
    w.m.scale_cols = (w.K + w.m.b1 - 1) / w.m.b1;
    std::vector<int64_t> grid(w.lead);
    grid.push_back((w.N + w.m.b0 - 1) / w.m.b0);
    grid.push_back(w.m.scale_cols);
    TORCH_CHECK(w.scale.sizes() == at::IntArrayRef(grid), name, ": scale shape ", w.scale.sizes(),
                " does not match the weight's block grid ", at::IntArrayRef(grid));
    if (w.scale.scalar_type() == at::kByte) {
      w.m.scale_e8m0 = w.scale.data_ptr<uint8_t>();
    } else {
      TORCH_CHECK(w.scale.scalar_type() == at::kFloat, name, ": scales must be float32 or ue8m0 bytes (uint8)");
      w.m.scale_f32 = w.scale.data_ptr<float>();
    }
  }
  return w;
}

at::Tensor float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name, " must be a float32 cpu tensor");
  return x.contiguous();
}

// Rows per parallel task: enough bytes that a task outweighs its scheduling (~64 KB of weight).
int64_t row_grain(const Weight& w) { return std::max<int64_t>(4, (64 << 10) / std::max<int64_t>(w.m.row_bytes, 1)); }

// ---------------------------------------------------------------- the ops (backends/base.py semantics)
at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                   at::IntArrayRef spec) {
  const at::Tensor x = float_rows(x_in, "x");
  const Weight w = weight_of(data, scale, spec, "weight", 2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [T, ", w.K, "]");
  const int64_t T = x.size(0), K = w.K, N = w.N;
  at::Tensor out = at::empty({T, N}, x.options());
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, N, row_grain(w), [&](int64_t begin, int64_t end) {
    gemm_rows_any(w.fmt, [&](int64_t t) { return X + t * K; }, [&](int64_t t) { return O + t * N; }, T, w.m, begin, end);
  });
  return out;
}

// x [T, G, K], weight [G*N, K] -> [T, G, N]: group g uses rows g*N..g*N+N-1
at::Tensor qgrouped_linear(const at::Tensor& x_in, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                           at::IntArrayRef spec) {
  const at::Tensor x = float_rows(x_in, "x");
  const Weight w = weight_of(data, scale, spec, "weight", 2);
  TORCH_CHECK(x.dim() == 3 && x.size(2) == w.K && w.N % x.size(1) == 0, "x must be [T, G, K] with G dividing N");
  const int64_t T = x.size(0), G = x.size(1), K = w.K, N = w.N / G;
  at::Tensor out = at::empty({T, G, N}, x.options());
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  // rows of all groups as one range: row r belongs to group r / N
  at::parallel_for(0, w.N, row_grain(w), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end;) {
      const int64_t g = r / N, stop = std::min(end, (g + 1) * N);
      gemm_rows_any(w.fmt, [&](int64_t t) { return X + (t * G + g) * K; },
                    [&](int64_t t) { return O + (t * G + g) * N - g * N; }, T, w.m, r, stop);
      r = stop;
    }
  });
  return out;
}

// hidden[t] = silu(min(g, limit)) * clamp(u, -limit, limit) over gu [T, 2I] (gate | up)
void swiglu_hidden(const float* gu, float* hidden, int64_t T, int64_t I, float lim) {
  for (int64_t t = 0; t < T; ++t) {
    const float* __restrict g_row = gu + t * 2 * I;
    float* __restrict h = hidden + t * I;
#pragma omp simd
    for (int64_t j = 0; j < I; ++j) {
      const float g = min_of(g_row[j], lim);
      const float u = min_of(max_of(g_row[I + j], -lim), lim);
      h[j] = g / (1.0f + fast_exp(-g)) * u;
    }
  }
}

// ---------------------------------------------------------------- DeepSeek-V4.1's activation rounding
// (round_bf16: kernel_util.h)
inline void round_bf16_rows(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = round_bf16(v[i]);
}

inline float from_bits(uint32_t b) {
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}

// v (|v| <= 448) rounded to float8_e4m3fn's grid (3 mantissa bits, exponents >= -6 with subnormals
// below), to nearest, ties to even, the sign kept (-0 included): a power-of-two scaling to the
// integer grid, nearbyint (the default rounding mode: ties to even) and back, all exact.
inline float round_e4m3(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const int32_t e = std::max<int32_t>(static_cast<int32_t>((bits >> 23) & 0xFF) - 127, -6);
  const float a = std::fabs(v);
  const float r = std::nearbyint(a * from_bits(static_cast<uint32_t>(127 + 3 - e) << 23)) *
                  from_bits(static_cast<uint32_t>(127 + e - 3) << 23);
  return std::copysign(r, v);
}

// One group of `block` values: DeepSeek-V4.1's FP8 quantize-dequantize (backends/base.py fp8_qdq):
// [bf16 rounding,] amax floored at 1e-4, s = 2^ceil(log2(amax * fp32(1/448))) from the product's
// bits, q = e4m3(clamp(x / s, +-448)), out = q * s. Bit-exact to the reference. `in` may be `out`.
inline void fp8_qdq_group(const float* in, float* out, int64_t block, bool bf16_first) {
  float amax = 0.0f;
  for (int64_t i = 0; i < block; ++i) {
    const float v = bf16_first ? round_bf16(in[i]) : in[i];
    out[i] = v;
    amax = max_of(amax, std::fabs(v));
  }
  amax = max_of(amax, 1e-4f);
  uint32_t pb;
  const float prod = amax * static_cast<float>(1.0 / 448.0);
  std::memcpy(&pb, &prod, 4);
  const uint32_t exponent = ((pb >> 23) & 0xFF) + ((pb & 0x7FFFFF) != 0 ? 1 : 0);
  const float s = from_bits(exponent << 23);
  for (int64_t i = 0; i < block; ++i) out[i] = round_e4m3(min_of(max_of(out[i] / s, -448.0f), 448.0f)) * s;
}

// Rows of n values through the GEMM-input rounding of a bf16-activation model: FP8 per act_block
// (act_block > 0, n a multiple of it) or bf16.
inline void act_round(float* v, int64_t n, int64_t act_block) {
  if (act_block > 0) {
    for (int64_t g = 0; g < n; g += act_block) fp8_qdq_group(v + g, v + g, act_block, true);
  } else {
    round_bf16_rows(v, n);
  }
}

// x.to(bfloat16).to(float32) in one pass with torch's rounding (nearest, ties to even), for the step
// replay's fusion of that pair of calls (replay.py, fuse_calls: DeepSeek-V4.1 rounds its activations
// to bf16 ~300 times a decode step). What the pass does not take, the pair itself computes: inputs
// other than contiguous float32, and any tensor holding a NaN (torch's conversion picks the NaN).
at::Tensor bf16_round(const at::Tensor& x) {
  if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || !x.is_contiguous())
    return x.to(at::kBFloat16).to(at::kFloat);
  at::Tensor out = at::empty_like(x);
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  bool nan = false;
  for (int64_t i = 0, n = x.numel(); i < n; ++i) {
    nan |= X[i] != X[i];
    O[i] = round_bf16(X[i]);
  }
  return nan ? x.to(at::kBFloat16).to(at::kFloat) : out;
}

// x [..., K] float32 -> fp8_qdq per `block` of the last dim (backends/base.py); round_bf16 False
// skips the bf16 rounding of the input (quant.act_quant's pow2 form: the same quantizer on any float32).
at::Tensor fp8_qdq(const at::Tensor& x_in, int64_t block, bool round_bf16_first) {
  const at::Tensor x = float_rows(x_in, "x");
  TORCH_CHECK(block >= 1 && x.dim() >= 1 && x.size(-1) % block == 0, "fp8_qdq: the last dim ", x.size(-1),
              " is not a multiple of the quantization group ", block);
  at::Tensor out = at::empty_like(x);
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t groups = x.numel() / block;
  at::parallel_for(0, groups, std::max<int64_t>(1, 8192 / block), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) fp8_qdq_group(X + g * block, O + g * block, block, round_bf16_first);
  });
  return out;
}

// The shared expert: down @ swiglu(gate_up @ x). Each projection split over threads by rows.
at::Tensor qswiglu_mlp(const at::Tensor& x_in, const at::Tensor& gu_data, const c10::optional<at::Tensor>& gu_scale,
                       at::IntArrayRef gu_spec, const at::Tensor& dn_data, const c10::optional<at::Tensor>& dn_scale,
                       at::IntArrayRef dn_spec, double limit) {
  const at::Tensor x = float_rows(x_in, "x");
  const Weight gu = weight_of(gu_data, gu_scale, gu_spec, "gate_up", 2);
  const Weight dn = weight_of(dn_data, dn_scale, dn_spec, "down", 2);
  const int64_t T = x.size(0), D = x.size(1), I = gu.N / 2;
  TORCH_CHECK(x.dim() == 2 && gu.K == D && gu.N == 2 * I && dn.N == D && dn.K == I,
              "gate_up must be [2I, D] and down [D, I] for x [T, D]");
  at::Tensor hidden = at::empty({T, 2 * I}, x.options()), out = at::empty({T, D}, x.options());
  const float* X = x.data_ptr<float>();
  float *GU = hidden.data_ptr<float>(), *O = out.data_ptr<float>();
  at::parallel_for(0, 2 * I, row_grain(gu), [&](int64_t begin, int64_t end) {
    gemm_rows_any(gu.fmt, [&](int64_t t) { return X + t * D; }, [&](int64_t t) { return GU + t * 2 * I; }, T, gu.m,
                  begin, end);
  });
  std::vector<float> h(T * I);
  swiglu_hidden(GU, h.data(), T, I, static_cast<float>(limit));
  at::parallel_for(0, D, row_grain(dn), [&](int64_t begin, int64_t end) {
    gemm_rows_any(dn.fmt, [&](int64_t t) { return h.data() + t * I; }, [&](int64_t t) { return O + t * D; }, T, dn.m,
                  begin, end);
  });
  return out;
}

// float32 rows [start, stop) of a weight (the large-batch path: widened in chunks for an MKL GEMM).
// value = raw * (scale * fold): one rounding, the reference's dequantized value bit for bit.
template <int64_t F>
void widen_typed(const Matrix& w, int64_t begin, int64_t end, int64_t start, float* O) {
  const int64_t K = w.K;
  for (int64_t r = begin; r < end; ++r) {
    float* __restrict o = O + (r - start) * K;
    decode_row<F>(w, r, o);
    if constexpr (scaled(F)) {
      for (int64_t k0 = 0, kb = 0; k0 < K; k0 += w.b1, ++kb) {
        const float s = w.scale(r, kb, fold(F));
        const int64_t k1 = std::min(K, k0 + w.b1);
#pragma omp simd
        for (int64_t k = k0; k < k1; ++k) o[k] *= s;
      }
    }
  }
}

void widen_any(int64_t fmt, const Matrix& w, int64_t begin, int64_t end, int64_t start, float* O) {
  switch (fmt) {
    case kF32: return widen_typed<kF32>(w, begin, end, start, O);
    case kBF16: return widen_typed<kBF16>(w, begin, end, start, O);
    case kF16: return widen_typed<kF16>(w, begin, end, start, O);
    case kFP8: return widen_typed<kFP8>(w, begin, end, start, O);
    default: return widen_typed<kFP4>(w, begin, end, start, O);
  }
}

// Rows of a widened tile: tile_bytes of float32, a multiple of 8 rows (at least 8, at most N).
int64_t tile_rows(int64_t N, int64_t K, int64_t tile_bytes) {
  return std::min(N, std::max<int64_t>(8, (tile_bytes / (4 * std::max<int64_t>(K, 1))) & ~int64_t{7}));
}

// out[:, r0:r1) = x @ rows [r0, r1) of w.T for the tiles [tile_begin, tile_end) of buf's size: each tile
// widened into buf (float32, one rounding per value: the dequantized weight bit for bit) and multiplied
// by MKL's GEMM (at::mm, one thread inside a parallel task) while it is in cache, straight into its
// columns of the output. The float32 copy of the weight is never written to memory whole.
void widened_gemm(int64_t fmt, const Matrix& w, const at::Tensor& x, at::Tensor& out, at::Tensor& buf,
                  int64_t tile_begin, int64_t tile_end) {
  const int64_t tile = buf.size(0);
  for (int64_t i = tile_begin; i < tile_end; ++i) {
    const int64_t r0 = i * tile, r1 = std::min(w.N, r0 + tile);
    widen_any(fmt, w, r0, r1, r0, buf.data_ptr<float>());
    at::Tensor o = out.narrow(1, r0, r1 - r0);
    at::mm_out(o, x, buf.narrow(0, 0, r1 - r0).t());
  }
}

// Routed experts (backends/base.py moe_experts) on [E, 2I, D] / [E, D, I] stacks: the (token, slot)
// rows grouped by expert, each expert's matrices read once for all its rows, experts over threads;
// a token's sum over its experts in slot order. bf16_acts: moe_experts_bf16's numerics instead (each
// GEMM input through act_round, each GEMM output rounded to bf16, the routing weight scaling the
// intermediate before its rounding, the slots' outputs summed unweighted). Shapes are all the call
// fixes: no host reads, so a recorded step replays it as one call. An expert with more than
// `gemm_from_rows` rows (>= 0; prefill) multiplies them by its matrices widened tile by tile and MKL's
// GEMM (widened_gemm), as qlinear_widened: bound by arithmetic there, where the GEMV tiles are not
// (bf16_acts' rounding points stay where they are). That changes those rows' rounding with the
// batch, so batch-invariant mode passes -1 (never).
at::Tensor qmoe_experts(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& ids_in,
                        const at::Tensor& gu_data, const c10::optional<at::Tensor>& gu_scale, at::IntArrayRef gu_spec,
                        const at::Tensor& dn_data, const c10::optional<at::Tensor>& dn_scale, at::IntArrayRef dn_spec,
                        double limit, bool bf16_acts, int64_t act_block, int64_t gemm_from_rows,
                        int64_t tile_bytes) {
  const at::Tensor x = float_rows(x_in, "x");
  const at::Tensor weights = weights_in.contiguous().to(at::kFloat), ids = ids_in.contiguous();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2, "ids must be int64 [T, k]");
  const Weight gu = weight_of(gu_data, gu_scale, gu_spec, "gate_up", 3);
  const Weight dn = weight_of(dn_data, dn_scale, dn_spec, "down", 3);
  const int64_t T = x.size(0), D = x.size(1), k = ids.size(1), E = gu.lead[0], I = gu.N / 2;
  TORCH_CHECK(gu.K == D && gu.N == 2 * I && dn.lead[0] == E && dn.N == D && dn.K == I,
              "expert weight shapes do not match x");
  TORCH_CHECK(act_block >= 0 && (act_block == 0 || (D % act_block == 0 && I % act_block == 0)),
              "act_block ", act_block, " must divide the hidden size ", D, " and the intermediate size ", I);
  at::Tensor out = at::empty({T, D}, x.options());
  const float* X = x.data_ptr<float>();
  const float* Wt = weights.data_ptr<float>();
  const int64_t* ID = ids.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float lim = static_cast<float>(limit);
  const int64_t R = T * k;
  std::vector<float> x_rounded;
  if (bf16_acts) {  // each token's GEMM input once, as the reference rounds x before grouping
    x_rounded.assign(X, X + T * D);
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) act_round(x_rounded.data() + t * D, D, act_block);
    });
    X = x_rounded.data();
  }
  const RowsByExpert grouped(ID, R, E);
  const std::vector<int64_t>&first = grouped.first, &by_expert = grouped.by_expert;
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; ++e)
    if (first[e + 1] > first[e]) hit.push_back(e);
  std::vector<float> expert_rows(R * D);  // expert_{ids[t, j]}(x[t]) at row t * k + j
  float* ER = expert_rows.data();
  at::parallel_for(0, static_cast<int64_t>(hit.size()), 1, [&](int64_t h_begin, int64_t h_end) {
    std::vector<float> gu_rows, hidden;
    for (int64_t h = h_begin; h < h_end; ++h) {
      const int64_t e = hit[h], n = first[e + 1] - first[e];
      const int64_t* rows = by_expert.data() + first[e];
      gu_rows.resize(n * 2 * I);
      hidden.resize(n * I);
      const Matrix gm = gu.at(e), dm = dn.at(e);
      // an expert's GEMM: its rows through the GEMV tiles, or gathered for its matrix widened tile by
      // tile and MKL's GEMM (many rows), the results scattered back
      const bool gemm = gemm_from_rows >= 0 && n > gemm_from_rows;
      auto project = [&](const Weight& w, const Matrix& m, auto in_of, auto out_of, int64_t N, int64_t K) {
        if (!gemm) return gemm_rows_any(w.fmt, in_of, out_of, n, m, 0, N);
        c10::InferenceMode inference;  // thread-local: the worker threads' at:: ops need it too
        const at::TensorOptions f32 = x.options();
        at::Tensor in = at::empty({n, K}, f32), res = at::empty({n, N}, f32);
        at::Tensor buf = at::empty({tile_rows(N, K, tile_bytes), K}, f32);
        for (int64_t j = 0; j < n; ++j) std::memcpy(in.data_ptr<float>() + j * K, in_of(j), K * sizeof(float));
        widened_gemm(w.fmt, m, in, res, buf, 0, (N + buf.size(0) - 1) / buf.size(0));
        for (int64_t j = 0; j < n; ++j) std::memcpy(out_of(j), res.data_ptr<float>() + j * N, N * sizeof(float));
      };
      project(gu, gm, [&](int64_t j) { return X + (rows[j] / k) * D; },
              [&](int64_t j) { return gu_rows.data() + j * 2 * I; }, 2 * I, D);
      if (bf16_acts) round_bf16_rows(gu_rows.data(), n * 2 * I);
      swiglu_hidden(gu_rows.data(), hidden.data(), n, I, lim);
      if (bf16_acts) {
        for (int64_t j = 0; j < n; ++j) {
          float* hj = hidden.data() + j * I;
          const float p = Wt[rows[j]];
          for (int64_t i = 0; i < I; ++i) hj[i] *= p;
          act_round(hj, I, act_block);
        }
      }
      project(dn, dm, [&](int64_t j) { return hidden.data() + j * I; }, [&](int64_t j) { return ER + rows[j] * D; },
              D, I);
      if (bf16_acts)
        for (int64_t j = 0; j < n; ++j) round_bf16_rows(ER + rows[j] * D, D);
    }
  });
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = O + t * D;
      if (bf16_acts) {  // y_0 + y_1 + ... in slot order, as the reference adds them
        std::copy(ER + t * k * D, ER + (t * k + 1) * D, o);
        for (int64_t j = 1; j < k; ++j) {
          const float* row = ER + (t * k + j) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += row[d];
        }
        continue;
      }
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < k; ++j) {  // slot order
        const float p = Wt[t * k + j];
        const float* row = ER + (t * k + j) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * row[d];
      }
    }
  });
  return out;
}

// z [T, E] = x @ gate.T (the routers' raw scores)
at::Tensor router_logits(const at::Tensor& x, const Weight& gate) {
  const int64_t T = x.size(0), D = x.size(1), E = gate.N;
  TORCH_CHECK(x.dim() == 2 && gate.K == D, "gate must be [E, D] for x [T, D]");
  at::Tensor z = at::empty({T, E}, x.options());
  const float* X = x.data_ptr<float>();
  float* Z = z.data_ptr<float>();
  at::parallel_for(0, E, row_grain(gate), [&](int64_t begin, int64_t end) {
    gemm_rows_any(gate.fmt, [&](int64_t t) { return X + t * D; }, [&](int64_t t) { return Z + t * E; }, T, gate.m,
                  begin, end);
  });
  return z;
}

std::tuple<at::Tensor, at::Tensor> qroute_topk(const at::Tensor& x_in, const at::Tensor& data,
                                               const c10::optional<at::Tensor>& scale, at::IntArrayRef spec,
                                               const at::Tensor& bias_in, int64_t top_k, double scaling) {
  const at::Tensor x = float_rows(x_in, "x");
  const Weight gate = weight_of(data, scale, spec, "gate", 2);
  const at::Tensor bias = bias_in.contiguous().to(at::kFloat);
  const int64_t T = x.size(0), E = gate.N;
  TORCH_CHECK(bias.numel() == E && top_k <= E, "bias must be [E] and top_k <= E");
  at::Tensor z = router_logits(x, gate);
  at::Tensor weights = at::empty({T, top_k}, x.options()), ids = at::empty({T, top_k}, x.options().dtype(at::kLong));
  float *Z = z.data_ptr<float>(), *Wo = weights.data_ptr<float>();
  int64_t* Io = ids.data_ptr<int64_t>();
  std::vector<float> biased(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t)
    pick_route(Z + t * E, biased.data(), order.data(), bias.data_ptr<float>(), E, top_k, static_cast<float>(scaling),
               Io + t * top_k, Wo + t * top_k);
  return {weights, ids};
}

at::Tensor qroute_hash(const at::Tensor& x_in, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                       at::IntArrayRef spec, const at::Tensor& ids_in, double scaling) {
  const at::Tensor x = float_rows(x_in, "x");
  const Weight gate = weight_of(data, scale, spec, "gate", 2);
  TORCH_CHECK(ids_in.scalar_type() == at::kLong, "ids must be int64");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), E = gate.N, k = ids.size(1);
  at::Tensor weights = at::empty({T, k}, x.options());
  const float* X = x.data_ptr<float>();
  const int64_t* I = ids.data_ptr<int64_t>();
  float* Wo = weights.data_ptr<float>();
  std::vector<float> z(E);  // the scores of the experts asked for, at their rows
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = I[t * k + j];
      TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of range for ", E, " experts");
      gemm_rows_any(gate.fmt, [&](int64_t) { return X + t * D; }, [&](int64_t) { return z.data(); }, 1, gate.m, e,
                    e + 1);
      Wo[t * k + j] = router_score(z[e]);
    }
    normalize_route(Wo + t * k, k, static_cast<float>(scaling));
  }
  return weights;
}

at::Tensor widen_rows(const at::Tensor& data, const c10::optional<at::Tensor>& scale, at::IntArrayRef spec,
                      int64_t start, int64_t stop) {
  const Weight w = weight_of(data, scale, spec, "weight", 2);
  TORCH_CHECK(0 <= start && start <= stop && stop <= w.N, "rows [", start, ", ", stop, ") out of range");
  at::Tensor out = at::empty({stop - start, w.K}, data.options().dtype(at::kFloat));
  float* O = out.data_ptr<float>();
  at::parallel_for(start, stop, row_grain(w), [&](int64_t begin, int64_t end) {
    widen_any(w.fmt, w.m, begin, end, start, O);
  });
  return out;
}

// x [T, K] @ weight.T for calls past the GEMV kernels' crossover: the weight widened one tile of rows at
// a time into a per-thread buffer that stays in cache (tile_bytes of float32), each tile multiplied by
// MKL's GEMM (at::mm, one thread inside a task) straight into its columns of the output. The float32
// copy of the weight is never written to memory whole, where widening it in large chunks wrote and
// read 4 bytes per weight per call.
at::Tensor qlinear_widened(const at::Tensor& x_in, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                           at::IntArrayRef spec, int64_t tile_bytes) {
  const at::Tensor x = float_rows(x_in, "x");
  const Weight w = weight_of(data, scale, spec, "weight", 2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [T, ", w.K, "]");
  const int64_t T = x.size(0), K = w.K, N = w.N;
  at::Tensor out = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return out;
  const int64_t tile = tile_rows(N, K, tile_bytes), tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // the caller's inference mode is thread-local: a worker thread writing the output (an inference
    // tensor under the engine) through at::mm_out needs it too
    c10::InferenceMode inference;
    at::Tensor buf = at::empty({tile, K}, x.options());
    widened_gemm(w.fmt, w.m, x, out, buf, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace deepinfer_cpu

using namespace deepinfer_cpu;

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("qlinear(Tensor x, Tensor data, Tensor? scale, int[] spec) -> Tensor");
  m.def("qgrouped_linear(Tensor x, Tensor data, Tensor? scale, int[] spec) -> Tensor");
  m.def("qswiglu_mlp(Tensor x, Tensor gu, Tensor? gu_scale, int[] gu_spec, Tensor dn, Tensor? dn_scale, "
        "int[] dn_spec, float limit) -> Tensor");
  m.def("qmoe_experts(Tensor x, Tensor weights, Tensor ids, Tensor gu, Tensor? gu_scale, int[] gu_spec, Tensor dn, "
        "Tensor? dn_scale, int[] dn_spec, float limit, bool bf16_acts=False, int act_block=0, "
        "int gemm_from_rows=-1, int tile_bytes=524288) -> Tensor");
  m.def("fp8_qdq(Tensor x, int block, bool round_bf16=True) -> Tensor");
  m.def("bf16_round(Tensor x) -> Tensor");
  m.def("qroute_topk(Tensor x, Tensor data, Tensor? scale, int[] spec, Tensor bias, int top_k, float scaling) "
        "-> (Tensor, Tensor)");
  m.def("qroute_hash(Tensor x, Tensor data, Tensor? scale, int[] spec, Tensor ids, float scaling) -> Tensor");
  m.def("widen_rows(Tensor data, Tensor? scale, int[] spec, int start, int stop) -> Tensor");
  m.def("qlinear_widened(Tensor x, Tensor data, Tensor? scale, int[] spec, int tile_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("qgrouped_linear", &qgrouped_linear);
  m.impl("qswiglu_mlp", &qswiglu_mlp);
  m.impl("qmoe_experts", &qmoe_experts);
  m.impl("fp8_qdq", &fp8_qdq);
  m.impl("bf16_round", &bf16_round);
  m.impl("qroute_topk", &qroute_topk);
  m.impl("qroute_hash", &qroute_hash);
  m.impl("widen_rows", &widen_rows);
  m.impl("qlinear_widened", &qlinear_widened);
}
