// Fused CPU kernels for the cpu backend's hot path (loaded by kernels.py beside it, compiled on first use).
//
// A decode step of a small model is bound by per-op overhead, not arithmetic: the mHC mix alone
// (RMSNorm, a [T, n*D] x [n*D, (2+n)*n] product, sigmoids, a softmax and 20 Sinkhorn iterations)
// is ~80 torch ops per call, 8 calls per 4-layer step. Each kernel here does one op of
// backends/base.py in one pass, with the same semantics as the reference in
// backends/reference.py (tests/unit/test_cpu_kernels.py bounds the difference).
//
// Every kernel works token by token with a fixed summation order inside a token, so a token's
// result never depends on which other tokens share the batch (batch-invariant by construction).

#include "fused_ops.h"
#include "kernel_util.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace deepinfer_cpu {

// Every dot product here sums in one fixed order that depends only on its length n: kLanes
// lane-wise partial sums over the full chunks of kLanes, the fixed tree of sum_lanes over the lanes,
// then the tail elements in order. dot_rows computes R such dots that share x in one pass: R
// independent accumulator chains (a single dot is bound by the FMA latency, ~4 cycles per chunk)
// and, for R = 8, one reduction of the 8 rows together instead of a horizontal reduction per dot.
// Every multiply-add is one fused multiply-add (madd) where the CPU has FMA, spelled out rather
// than left to GCC's contraction (its znver tuning splits FMA chains in some loops and not others),
// so the bits are the same in every block and in gemm_rows' register tiles: a dot's result depends
// only on its two vectors, never on the block, the tile, the batch or the thread count.
constexpr int kLanes = 8;

// acc + x * w with one rounding where the CPU fuses it (every CPU the register tiles below run on)
inline float madd(float x, float w, float acc) {
#if defined(__FMA__)
  return std::fma(x, w, acc);
#else
  return x * w + acc;
#endif
}

// ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
inline float sum_lanes(const float* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// out[r] = sum_lanes(acc[r]) for 8 rows. With AVX: the same tree in 9 instructions, hadd adding
// neighbouring lanes of two rows at a time (GCC's own vectorisation of the loop below needs ~30
// permutes and adds, about half the time of a 64-long dot).
inline void sum_lanes_8_rows(const float (*acc)[kLanes], float* out) {
#if defined(__AVX__)
  static_assert(kLanes == 8, "one __m256 per row");
  const __m256 r01 = _mm256_hadd_ps(_mm256_loadu_ps(acc[0]), _mm256_loadu_ps(acc[1]));
  const __m256 r23 = _mm256_hadd_ps(_mm256_loadu_ps(acc[2]), _mm256_loadu_ps(acc[3]));
  const __m256 r45 = _mm256_hadd_ps(_mm256_loadu_ps(acc[4]), _mm256_loadu_ps(acc[5]));
  const __m256 r67 = _mm256_hadd_ps(_mm256_loadu_ps(acc[6]), _mm256_loadu_ps(acc[7]));
  // lanes 0-3: (a0 + a1) + (a2 + a3) of rows 0-3 (r0_3) or 4-7 (r4_7); lanes 4-7: (a4 + a5) + (a6 + a7)
  const __m256 r0_3 = _mm256_hadd_ps(r01, r23), r4_7 = _mm256_hadd_ps(r45, r67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(r0_3, r4_7, 0x20),
                                      _mm256_permute2f128_ps(r0_3, r4_7, 0x31)));
#else
  for (int r = 0; r < 8; ++r) out[r] = sum_lanes(acc[r]);
#endif
}

template <int R, class RowOf>
inline void dot_rows(const float* __restrict x, RowOf row_of, int64_t n, float* __restrict out) {
  float acc[R][kLanes] = {};
  const int64_t body = n - n % kLanes;
  for (int64_t k = 0; k < body; k += kLanes)
    for (int r = 0; r < R; ++r) {
      const float* __restrict w = row_of(r);
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[r][l] = madd(x[k + l], w[k + l], acc[r][l]);
    }
  if constexpr (R == 8) {
    sum_lanes_8_rows(acc, out);
  } else {
    for (int r = 0; r < R; ++r) out[r] = sum_lanes(acc[r]);
  }
  if (body < n)
    for (int r = 0; r < R; ++r) {
      const float* __restrict w = row_of(r);
      float s = out[r];
      for (int64_t k = body; k < n; ++k) s = madd(x[k], w[k], s);
      out[r] = s;
    }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float out;
  dot_rows<1>(a, [b](int) { return b; }, n, &out);
  return out;
}

// 1 / rms(x) with eps inside the root: the RMSNorm scale (and mHC's input normalisation)
inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
}

// RoPE on R interleaved pairs: (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), s negated for the inverse.
// `out` may be `in`.
inline void rotate_pairs(const float* in, float* out, const float* c, const float* s, int64_t R, float sign) {
  for (int64_t k = 0; k < R; ++k) {
    const float x0 = in[2 * k], x1 = in[2 * k + 1], sk = sign * s[k];
    out[2 * k] = x0 * c[k] - x1 * sk;
    out[2 * k + 1] = x1 * c[k] + x0 * sk;
  }
}

// x[0] + ... + x[n-1] in the order of a dot product (lane partials, the same tree, the tail)
inline float sum_of(const float* __restrict x, int64_t n) {
  float acc[kLanes] = {};
  const int64_t body = n - n % kLanes;
  for (int64_t k = 0; k < body; k += kLanes)
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) acc[l] += x[k + l];
  float s = sum_lanes(acc);
  for (int64_t k = body; k < n; ++k) s += x[k];
  return s;
}

// out[r] = dot(x, row_of(r), n) for r < rows: blocks of 8 rows, then 4, then single rows.
template <class RowOf>
inline void dot_many(const float* x, RowOf row_of, int64_t n, int64_t rows, float* out) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) dot_rows<8>(x, [&](int i) { return row_of(r + i); }, n, out + r);
  for (; r + 4 <= rows; r += 4) dot_rows<4>(x, [&](int i) { return row_of(r + i); }, n, out + r);
  for (; r < rows; ++r) dot_rows<1>(x, [&](int) { return row_of(r); }, n, out + r);
}

// out[r] = dot(x, w + r * ldw, n) for r < rows (a GEMV against a row-major matrix)
inline void gemv(const float* x, const float* w, int64_t ldw, int64_t n, int64_t rows, float* out) {
  dot_many(x, [w, ldw](int64_t r) { return w + r * ldw; }, n, rows, out);
}

// The tails (n % kLanes) of the tiles' dots, as dot_rows ends a dot: madd in k order onto the
// tile's sum. outs[t][i] holds the body of token t0 + t's dot with row i of w.
template <int RR, class XOf>
inline void add_tails(XOf x_of, int64_t t0, int64_t G, float* const* outs, const float* w, int64_t ldw,
                      int64_t body, int64_t n) {
  for (int64_t t = 0; t < G; ++t) {
    const float* x = x_of(t0 + t);
    for (int i = 0; i < RR; ++i) {
      const float* wr = w + i * ldw;
      float s = outs[t][i];
      for (int64_t k = body; k < n; ++k) s = madd(x[k], wr[k], s);
      outs[t][i] = s;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define DEEPINFER_DOT_TILES 1
// Register tiles for gemm_rows: the dots of several tokens with several weight rows at once, so
// each weight chunk loaded feeds several FMAs (a GEMV feeds one: it is bound by loads, ~half a
// core's FMA rate). A 512-bit register holds the kLanes partial sums of two dots, one token in
// each half: the tokens' chunks are packed in pairs, x[2p] and x[2p + 1] side by side, and a
// weight chunk is broadcast to both halves. Every lane still does dot_rows' arithmetic, a chain
// of madd over the chunks in k order from 0, and the reduction is sum_lanes' tree, so each dot
// has dot_rows' bits (tests/unit/test_cpu_kernels.py compares them for T = 1..40).
constexpr int kTilePairs = 4, kTileRows = 6;  // 24 accumulators + 4 token pairs + a weight chunk: 29 of 32 registers

// per 128-bit lane: (a0 + a1, a2 + a3, b0 + b1, b2 + b3), vhaddps's step on 512 bits
inline __m512 hadd_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// sum_lanes of the 8 dots in 4 accumulators of two dots each: (a, b, c, d of the low-half token |
// the same of the high-half token). Two hadd steps give ((l0 + l1) + (l2 + l3)) of each dot in
// 128-bit lanes 0 and 2 and ((l4 + l5) + (l6 + l7)) in lanes 1 and 3; the last add joins them.
inline __m256 sum_lanes_4x2(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 s = hadd_lanes(hadd_lanes(a, b), hadd_lanes(c, d));
  return _mm256_add_ps(_mm512_castps512_ps256(_mm512_shuffle_f32x4(s, s, 0x08)),
                       _mm512_castps512_ps256(_mm512_shuffle_f32x4(s, s, 0x0D)));
}

// outs[2p + h][r] = sum_lanes of the body (chunks x kLanes) of the dot of token pair p, half h,
// with row r of w, for p < NP, r < RR. xp: NP packed pairs, `pair_stride` floats apart;
// outs[2p + 1] may be null (an odd last token: that half is zeros and is not stored). `prefetch`
// (or null): the rows a later tile needs, fetched into cache during this one (the weight is
// streamed from memory once; the hardware prefetcher alone left the LM head at ~1/2 the bandwidth).
template <int NP, int RR>
inline void dot_tile(const float* __restrict xp, int64_t pair_stride, const float* __restrict w, int64_t ldw,
                     int64_t chunks, float* const* outs, const float* prefetch) {
  __m512 acc[NP][RR];
#pragma GCC unroll 32
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 32
    for (int r = 0; r < RR; ++r) acc[p][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 xv[NP];
#pragma GCC unroll 32
    for (int p = 0; p < NP; ++p) xv[p] = _mm512_loadu_ps(xp + p * pair_stride + c * 2 * kLanes);
    if (prefetch != nullptr && c % 2 == 0)  // a 64-byte line holds two chunks
#pragma GCC unroll 32
      for (int r = 0; r < RR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + r * ldw + c * kLanes), _MM_HINT_T0);
#pragma GCC unroll 32
    for (int r = 0; r < RR; ++r) {
      const __m512 wv = _mm512_broadcast_f32x8(_mm256_loadu_ps(w + r * ldw + c * kLanes));
#pragma GCC unroll 32
      for (int p = 0; p < NP; ++p) acc[p][r] = _mm512_fmadd_ps(xv[p], wv, acc[p][r]);  // x * w + acc, one rounding
    }
  }
#pragma GCC unroll 32
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 32
    for (int g = 0; g < RR; g += 4) {  // 4 rows at a time; a short group repeats its last row (not stored)
      const int cnt = std::min(4, RR - g);
      const __m256 s = sum_lanes_4x2(acc[p][g], acc[p][g + std::min(1, cnt - 1)], acc[p][g + std::min(2, cnt - 1)],
                                     acc[p][g + std::min(3, cnt - 1)]);
      const __mmask8 m = static_cast<__mmask8>((1 << cnt) - 1);
      _mm_mask_storeu_ps(outs[2 * p] + g, m, _mm256_castps256_ps128(s));
      if (outs[2 * p + 1] != nullptr) _mm_mask_storeu_ps(outs[2 * p + 1] + g, m, _mm256_extractf128_ps(s, 1));
    }
}

// dot_tile over `pairs` token pairs (1..kTilePairs) and RR rows
template <int RR>
inline void dot_tile_any(int64_t pairs, const float* xp, int64_t pair_stride, const float* w, int64_t ldw,
                         int64_t chunks, float* const* outs, const float* prefetch) {
  static_assert(kTilePairs == 4, "one case per tile height");
  switch (pairs) {
    case 1: return dot_tile<1, RR>(xp, pair_stride, w, ldw, chunks, outs, prefetch);
    case 2: return dot_tile<2, RR>(xp, pair_stride, w, ldw, chunks, outs, prefetch);
    case 3: return dot_tile<3, RR>(xp, pair_stride, w, ldw, chunks, outs, prefetch);
    default: return dot_tile<4, RR>(xp, pair_stride, w, ldw, chunks, outs, prefetch);
  }
}

// gemm_rows on the tiles, T >= 2 tokens: tokens in groups of up to kRowGroup, each group packed in
// pairs; for each block of kTileRows weight rows (read from memory once per group), the group's
// pairs in tiles of <= kTilePairs (balanced: 8 pairs are 4 + 4, 5 are 3 + 2); the first tile of a
// block prefetches the block after next. Then the tail (n % kLanes) of every dot, as dot_rows: madd
// in k order onto the tile's sum.
template <class XOf, class OutOf>
void gemm_rows_tiled(XOf x_of, OutOf out_of, int64_t T, const float* w, int64_t ldw, int64_t n, int64_t rows) {
  constexpr int64_t kPrefetchBlocks = 2;
  const int64_t chunks = n / kLanes, body = chunks * kLanes, pair_stride = chunks * 2 * kLanes;
  const int64_t group_max = std::min(T, kRowGroup), pairs_max = (group_max + 1) / 2;
  Scratch<float, 8192> packed_buf(pairs_max * pair_stride);
  Scratch<float*, kRowGroup> base_buf(2 * pairs_max), outs_buf(2 * pairs_max);
  float *packed = packed_buf.data(), **base = base_buf.data(), **outs = outs_buf.data();
  for (int64_t t0 = 0; t0 < T; t0 += kRowGroup) {
    const int64_t G = std::min(kRowGroup, T - t0), P = (G + 1) / 2;
    for (int64_t t = 0; t < G; ++t) {
      const float* x = x_of(t0 + t);
      float* dst = packed + (t / 2) * pair_stride + (t % 2) * kLanes;
      for (int64_t c = 0; c < chunks; ++c) std::memcpy(dst + c * 2 * kLanes, x + c * kLanes, kLanes * sizeof(float));
      base[t] = out_of(t0 + t);
    }
    if (G % 2) {  // the odd last token's partner: zeros, never stored
      float* dst = packed + (P - 1) * pair_stride + kLanes;
      for (int64_t c = 0; c < chunks; ++c) std::fill(dst + c * 2 * kLanes, dst + c * 2 * kLanes + kLanes, 0.0f);
    }
    const int64_t tiles = (P + kTilePairs - 1) / kTilePairs;
    auto block = [&](auto rows_tag, int64_t r) {
      constexpr int RR = decltype(rows_tag)::value;
      for (int64_t t = 0; t < 2 * P; ++t) outs[t] = t < G ? base[t] + r : nullptr;
      const int64_t ahead = r + kPrefetchBlocks * RR;
      const float* prefetch = ahead + RR <= rows ? w + ahead * ldw : nullptr;
      for (int64_t i = 0, p = 0; i < tiles; ++i) {
        const int64_t np = P / tiles + (i < P % tiles);
        dot_tile_any<RR>(np, packed + p * pair_stride, pair_stride, w + r * ldw, ldw, chunks, outs + 2 * p,
                         i == 0 ? prefetch : nullptr);
        p += np;
      }
      if (body < n) add_tails<RR>(x_of, t0, G, outs, w + r * ldw, ldw, body, n);
    };
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) block(std::integral_constant<int, kTileRows>{}, r);
    for (; r < rows; ++r) block(std::integral_constant<int, 1>{}, r);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define DEEPINFER_DOT_TILES 2
// Register tiles for CPUs with AVX2 and FMA but not AVX-512 (most laptops): a 256-bit register
// holds the kLanes partial sums of one dot, so a tile is kTileTokens tokens x kTileRows weight rows
// of accumulators; each weight chunk loaded feeds kTileTokens FMAs and each token chunk kTileRows.
// The tokens are read in place (no packing: one token per register). Every lane does dot_rows'
// chain of madd in k order and the reduction is sum_lanes' tree, so each dot has dot_rows' bits,
// as with the AVX-512 tiles.
constexpr int kTileTokens = 3, kTileRows = 4;  // 12 accumulators + 3 token chunks + a weight chunk: 16 of 16

// sum_lanes of 4 dots: two hadd steps give ((l0 + l1) + (l2 + l3)) of dot i in lane i and
// ((l4 + l5) + (l6 + l7)) in lane 4 + i; the last add joins them.
inline __m128 sum_lanes_4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// outs[t][r] = sum_lanes of the body (chunks x kLanes) of the dot of xs[t] with row r of w, for
// t < NT, r < RR; `prefetch` (or null): rows a later tile needs, fetched during this one.
template <int NT, int RR>
inline void dot_tile(const float* const* xs, const float* __restrict w, int64_t ldw, int64_t chunks,
                     float* const* outs, const float* prefetch) {
  __m256 acc[NT][RR];
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) acc[t][r] = _mm256_setzero_ps();
  const float* x[NT];
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t) x[t] = xs[t];
  for (int64_t c = 0; c < chunks; ++c) {
    __m256 xv[NT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) xv[t] = _mm256_loadu_ps(x[t] + c * kLanes);
    if (prefetch != nullptr && c % 2 == 0)  // a 64-byte line holds two chunks
#pragma GCC unroll 16
      for (int r = 0; r < RR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + r * ldw + c * kLanes), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * ldw + c * kLanes);
#pragma GCC unroll 16
      for (int t = 0; t < NT; ++t) acc[t][r] = _mm256_fmadd_ps(xv[t], wv, acc[t][r]);  // x * w + acc, one rounding
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 16
    for (int g = 0; g < RR; g += 4) {  // 4 rows at a time; a short group repeats its last row (not stored)
      const int cnt = std::min(4, RR - g);
      const __m128 s = sum_lanes_4(acc[t][g], acc[t][g + std::min(1, cnt - 1)], acc[t][g + std::min(2, cnt - 1)],
                                   acc[t][g + std::min(3, cnt - 1)]);
      if (cnt == 4) {
        _mm_storeu_ps(outs[t] + g, s);
      } else {
        alignas(16) float part[4];
        _mm_store_ps(part, s);
        std::copy(part, part + cnt, outs[t] + g);
      }
    }
}

// dot_tile over `tokens` tokens (1..kTileTokens) and RR rows
template <int RR>
inline void dot_tile_any(int64_t tokens, const float* const* xs, const float* w, int64_t ldw, int64_t chunks,
                         float* const* outs, const float* prefetch) {
  static_assert(kTileTokens == 3, "one case per tile height");
  switch (tokens) {
    case 1: return dot_tile<1, RR>(xs, w, ldw, chunks, outs, prefetch);
    case 2: return dot_tile<2, RR>(xs, w, ldw, chunks, outs, prefetch);
    default: return dot_tile<3, RR>(xs, w, ldw, chunks, outs, prefetch);
  }
}

// gemm_rows on the tiles, T >= 2 tokens: tokens in groups of up to kRowGroup; for each block of
// kTileRows weight rows (read from memory once per group), the group's tokens in tiles of
// <= kTileTokens (balanced: 4 tokens are 2 + 2, 5 are 3 + 2); the first tile of a block prefetches
// the block after next. Then the tails, as dot_rows.
template <class XOf, class OutOf>
void gemm_rows_tiled(XOf x_of, OutOf out_of, int64_t T, const float* w, int64_t ldw, int64_t n, int64_t rows) {
  constexpr int64_t kPrefetchBlocks = 2;
  const int64_t chunks = n / kLanes, body = chunks * kLanes, group_max = std::min(T, kRowGroup);
  Scratch<const float*, kRowGroup> xs_buf(group_max);
  Scratch<float*, kRowGroup> base_buf(group_max), outs_buf(group_max);
  const float** xs = xs_buf.data();
  float **base = base_buf.data(), **outs = outs_buf.data();
  for (int64_t t0 = 0; t0 < T; t0 += kRowGroup) {
    const int64_t G = std::min(kRowGroup, T - t0), tiles = (G + kTileTokens - 1) / kTileTokens;
    for (int64_t t = 0; t < G; ++t) {
      xs[t] = x_of(t0 + t);
      base[t] = out_of(t0 + t);
    }
    auto block = [&](auto rows_tag, int64_t r) {
      constexpr int RR = decltype(rows_tag)::value;
      for (int64_t t = 0; t < G; ++t) outs[t] = base[t] + r;
      const int64_t ahead = r + kPrefetchBlocks * RR;
      const float* prefetch = ahead + RR <= rows ? w + ahead * ldw : nullptr;
      for (int64_t i = 0, t = 0; i < tiles; ++i) {
        const int64_t nt = G / tiles + (i < G % tiles);
        dot_tile_any<RR>(nt, xs + t, w + r * ldw, ldw, chunks, outs + t, i == 0 ? prefetch : nullptr);
        t += nt;
      }
      if (body < n) add_tails<RR>(x_of, t0, G, outs, w + r * ldw, ldw, body, n);
    };
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) block(std::integral_constant<int, kTileRows>{}, r);
    for (; r < rows; ++r) block(std::integral_constant<int, 1>{}, r);
  }
}
#endif

// out_of(t)[r] = dot(x_of(t), w + r * ldw, n) for t < T, r < rows: gemv for T inputs, weight-stationary.
// Each block of weight rows is loaded once for all T inputs, so a matrix that does not fit in cache
// (a 768 KB expert of the shipped model) is read from memory once per call, not once per token.
// With AVX-512 or AVX2 + FMA, two tokens or more go through gemm_rows_tiled; otherwise the blocks (8, then 4,
// then single rows) and every dot are gemv's. Either way a token's result does not depend on T or
// on the other inputs.
// A matrix up to this size stays in cache across tokens: then token by token is faster (x stays hot).
constexpr int64_t kCachedWeightBytes = 256 * 1024;

template <class XOf, class OutOf>
inline void gemm_rows(XOf x_of, OutOf out_of, int64_t T, const float* w, int64_t ldw, int64_t n, int64_t rows) {
#if defined(DEEPINFER_DOT_TILES)
  if (T >= 2) return gemm_rows_tiled(x_of, out_of, T, w, ldw, n, rows);
#endif
  if (rows * n * static_cast<int64_t>(sizeof(float)) <= kCachedWeightBytes) {  // same blocks, same dots
    for (int64_t t = 0; t < T; ++t) gemv(x_of(t), w, ldw, n, rows, out_of(t));
    return;
  }
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8)
    for (int64_t t = 0; t < T; ++t) dot_rows<8>(x_of(t), [&](int i) { return w + (r + i) * ldw; }, n, out_of(t) + r);
  for (; r + 4 <= rows; r += 4)
    for (int64_t t = 0; t < T; ++t) dot_rows<4>(x_of(t), [&](int i) { return w + (r + i) * ldw; }, n, out_of(t) + r);
  for (; r < rows; ++r)
    for (int64_t t = 0; t < T; ++t) dot_rows<1>(x_of(t), [&](int) { return w + r * ldw; }, n, out_of(t) + r);
}

// A decode-sized call (a token or a few) has one task per token: at batch 1 it would run on one
// core whatever the intra-op threads, and a GEMV there is bound by one core's share of the memory
// bandwidth (~21 GB/s here; two cores read ~42). So the GEMV-shaped kernels split such a call by
// output rows instead: [0, rows) in chunks whose bounds are multiples of 8, gemv's widest block,
// so every row goes through the same dot_rows<R> as on one thread and the bits depend on neither
// the thread count nor the batch. A chunk gets at least kMinChunkMacs multiply-adds (~3 us of one
// core's work; a parallel region costs ~1-2 us): small matrices stay on one thread.
constexpr int64_t kMinChunkMacs = 16 * 1024;

template <class F>
inline void parallel_rows(int64_t rows, int64_t macs_per_row, F fn) {
  const int64_t units = (rows + 7) / 8, grain = std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(1, 8 * macs_per_row));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) { fn(u0 * 8, std::min(u1 * 8, rows)); });
}

// out[d] += p * row[d]
inline void axpy(float p, const float* __restrict row, float* __restrict out, int64_t D) {
  for (int64_t d = 0; d < D; ++d) out[d] += p * row[d];
}

// out = sum_i w[i] * x[i * D .. (i + 1) * D), the streams of one token weighted (the mHC collapse)
inline void collapse_streams(const float* x, const float* w, int64_t n, int64_t D, float* out) {
  std::fill(out, out + D, 0.0f);
  for (int64_t i = 0; i < n; ++i) axpy(w[i], x + i * D, out, D);
}

// Pointers to the rows of a [rows, D] pool named by idx[0..n) (-1 = absent, skipped); returns how
// many were present. Checks the range.
int64_t present_rows(const int64_t* idx, int64_t n, const float* pool, int64_t rows, int64_t stride, const char* what,
                     const float** out) {
  int64_t valid = 0;
  for (int64_t m = 0; m < n; ++m) {
    if (idx[m] < 0) continue;
    TORCH_CHECK(idx[m] < rows, what, " ", idx[m], " out of range for ", rows, " rows");
    out[valid++] = pool + idx[m] * stride;
  }
  return valid;
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the cpu");
}

// Rows of `x` ([..., D], last dim contiguous) as (pointer, row stride, rows); copies only when
// the leading dims cannot be walked with one stride.
std::tuple<at::Tensor, int64_t, int64_t> as_rows(const at::Tensor& x) {
  const int64_t d = x.size(-1);
  at::Tensor v = x;
  if (x.stride(-1) != 1) v = x.contiguous();
  if (v.dim() == 1) return {v, d, 1};
  if (v.dim() == 2) return {v, v.stride(0), v.size(0)};
  v = v.contiguous();
  return {v, d, v.numel() / std::max<int64_t>(d, 1)};
}

// ---------------------------------------------------------------- mHC
// One Sinkhorn half-step for a block of B tokens: each n x n matrix divided by its column sums
// (`columns`) or row sums (+ eps), vectorised across the tokens. c[(i * n + j) * B + b] is element
// (i, j) of token b's matrix. A function of its own so the compiler sees the pointers do not alias
// (inside hc_pre's lambda, eps was reloaded after every store and nothing vectorised).
template <int64_t B>
void sinkhorn_half_step(float* __restrict c, float* __restrict sums, int64_t n, bool columns, float eps) {
  std::fill(sums, sums + n * B, 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float* __restrict acc = sums + (columns ? j : i) * B;
      const float* __restrict e = c + (i * n + j) * B;
#pragma omp simd
      for (int64_t b = 0; b < B; ++b) acc[b] += e[b];
    }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float* __restrict acc = sums + (columns ? j : i) * B;
      float* __restrict e = c + (i * n + j) * B;
#pragma omp simd
      for (int64_t b = 0; b < B; ++b) e[b] = e[b] / (acc[b] + eps);
    }
}

// Column normalisation, then sinkhorn_iters - 1 rounds of rows then columns
template <int64_t B>
void sinkhorn(float* c, float* sums, int64_t n, int64_t iters, float eps) {
  sinkhorn_half_step<B>(c, sums, n, true, eps);
  for (int64_t it = 1; it < iters; ++it) {
    sinkhorn_half_step<B>(c, sums, n, false, eps);
    sinkhorn_half_step<B>(c, sums, n, true, eps);
  }
}

// The mixes of every token (pre, post and the Sinkhorn-normalised comb) and, for hc_pre, the streams
// collapsed by pre: `collapse` false leaves pre as the first result (DeepSeek-V4.1's hc_mixes, whose
// collapse comes a sub-layer later), true gives the collapsed [T, D] there.
static std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_mix_tokens(const at::Tensor& streams_in, const at::Tensor& fn_in,
                                                              const at::Tensor& base_in, const at::Tensor& scale_in,
                                                              double norm_eps, double hc_eps, int64_t sinkhorn_iters,
                                                              bool collapse) {
  check_float(streams_in, "streams");
  check_float(fn_in, "fn");
  TORCH_CHECK(streams_in.dim() == 3, "streams must be [T, n, D]");
  const at::Tensor streams = streams_in.contiguous(), fn = fn_in.contiguous();
  const at::Tensor base = base_in.contiguous().to(at::kFloat), scale = scale_in.contiguous().to(at::kFloat);
  const int64_t T = streams.size(0), n = streams.size(1), D = streams.size(2), nd = n * D, mixes = (2 + n) * n;
  TORCH_CHECK(fn.size(0) == mixes && fn.size(1) == nd, "fn must be [(2+n)*n, n*D]");
  constexpr int64_t kMaxStreams = 64;
  TORCH_CHECK(n <= kMaxStreams, "hc_mult > ", kMaxStreams, " is not supported");
  auto opts = streams.options();
  at::Tensor first = collapse ? at::empty({T, D}, opts) : at::empty({T, n}, opts);
  at::Tensor post = at::empty({T, n}, opts), comb = at::empty({T, n, n}, opts);
  const float *S = streams.data_ptr<float>(), *F = fn.data_ptr<float>(), *B = base.data_ptr<float>();
  const float s0 = scale.data_ptr<float>()[0], s1 = scale.data_ptr<float>()[1], s2 = scale.data_ptr<float>()[2];
  const float neps = static_cast<float>(norm_eps), heps = static_cast<float>(hc_eps);
  float *C = first.data_ptr<float>(), *P = post.data_ptr<float>(), *M = comb.data_ptr<float>();
  // Tokens go in blocks of kBlock: the per-token parts (mixes, gates, softmax) run token by token,
  // the Sinkhorn iterations (n*n divisions per half-step) run vectorised across the block, where a
  // token's lane does the same operations whatever the other lanes hold.
  constexpr int64_t kBlock = 16;
  const int64_t nn = n * n;
  at::parallel_for(0, (T + kBlock - 1) / kBlock, 1, [&](int64_t block_begin, int64_t block_end) {
    Scratch<float, 4096> mix_buf(mixes), pre_buf(n * kBlock), cb_buf(nn * kBlock), sums_buf(n * kBlock);
    float *mix = mix_buf.data(), *pre = pre_buf.data(), *cb = cb_buf.data(), *sums = sums_buf.data();
    // lanes past the last token of a short block still go through Sinkhorn: zeros, not garbage
    // (denormals or NaNs there would only cost time)
    std::fill(cb, cb + nn * kBlock, 0.0f);
    for (int64_t blk = block_begin; blk < block_end; ++blk) {
      const int64_t t0 = blk * kBlock, bt = std::min(kBlock, T - t0);
      // a short block (a decode batch of a few tokens) runs Sinkhorn on fewer lanes; a lane's
      // arithmetic is the same at any width (adds and divisions, nothing to contract)
      const int64_t lanes = bt <= 4 ? 4 : bt <= 8 ? 8 : kBlock;
      for (int64_t b = 0; b < bt; ++b) {
        const int64_t t = t0 + b;
        const float* x = S + t * nd;
        const float r = inv_rms(x, nd, neps);
        gemv(x, F, nd, nd, mixes, mix);  // all mixes in one pass over x: no per-mix reduction
        for (int64_t m = 0; m < mixes; ++m) mix[m] *= r;
        for (int64_t j = 0; j < n; ++j) {
          pre[b * n + j] = sigmoid(mix[j] * s0 + B[j]) + heps;
          P[t * n + j] = 2.0f * sigmoid(mix[n + j] * s1 + B[n + j]);
        }
        for (int64_t i = 0; i < n; ++i) {  // row softmax of the combination logits, + eps
          float row[kMaxStreams];
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            row[j] = mix[2 * n + i * n + j] * s2 + B[2 * n + i * n + j];
            mx = std::max(mx, row[j]);
          }
          float sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) sum += (row[j] = fast_exp(row[j] - mx));
          for (int64_t j = 0; j < n; ++j) cb[(i * n + j) * lanes + b] = row[j] / sum + heps;
        }
      }
      // cb[(i * n + j) * lanes + b]: element (i, j) of token b's matrix
      if (lanes == 4)
        sinkhorn<4>(cb, sums, n, sinkhorn_iters, heps);
      else if (lanes == 8)
        sinkhorn<8>(cb, sums, n, sinkhorn_iters, heps);
      else
        sinkhorn<kBlock>(cb, sums, n, sinkhorn_iters, heps);
      for (int64_t b = 0; b < bt; ++b) {
        const int64_t t = t0 + b;
        for (int64_t e = 0; e < nn; ++e) M[t * nn + e] = cb[e * lanes + b];
        if (!collapse) {
          std::copy(pre + b * n, pre + (b + 1) * n, C + t * n);
          continue;
        }
        collapse_streams(S + t * nd, pre + b * n, n, D, C + t * D);
      }
    }
  });
  return {first, post, comb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams, const at::Tensor& fn,
                                                       const at::Tensor& base, const at::Tensor& scale,
                                                       double norm_eps, double hc_eps, int64_t sinkhorn_iters) {
  return hc_mix_tokens(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_mixes(const at::Tensor& streams, const at::Tensor& fn,
                                                         const at::Tensor& base, const at::Tensor& scale,
                                                         double norm_eps, double hc_eps, int64_t sinkhorn_iters) {
  return hc_mix_tokens(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, false);
}

// hc_collapse: out[t] = sum_i weights[t, i] * streams[t, i], streams [T, n, D], weights [T, n]
at::Tensor hc_collapse(const at::Tensor& streams_in, const at::Tensor& weights_in) {
  check_float(streams_in, "streams");
  check_float(weights_in, "weights");
  TORCH_CHECK(streams_in.dim() == 3 && weights_in.dim() == 2 && weights_in.size(0) == streams_in.size(0) &&
                  weights_in.size(1) == streams_in.size(1),
              "streams must be [T, n, D], weights [T, n]");
  const at::Tensor streams = streams_in.contiguous(), weights = weights_in.contiguous();
  const int64_t T = streams.size(0), n = streams.size(1), D = streams.size(2);
  at::Tensor out = at::empty({T, D}, streams.options());
  const float *S = streams.data_ptr<float>(), *W = weights.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(1, n * D)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) collapse_streams(S + t * n * D, W + t * n, n, D, O + t * D);
  });
  return out;
}

// The final collapse before the LM head: pre = sigmoid(mix * scale + base) + hc_eps with
// mix = rms(x) . fn_j as in hc_pre, out = sum_j pre_j * x_j. streams [T, n, D], fn [n, n*D].
at::Tensor hc_head(const at::Tensor& streams_in, const at::Tensor& fn_in, const at::Tensor& base_in,
                   const at::Tensor& scale_in, double norm_eps, double hc_eps) {
  check_float(streams_in, "streams");
  check_float(fn_in, "fn");
  TORCH_CHECK(streams_in.dim() == 3, "streams must be [T, n, D]");
  const at::Tensor streams = streams_in.contiguous(), fn = fn_in.contiguous();
  const at::Tensor base = base_in.contiguous().to(at::kFloat), scale = scale_in.contiguous().to(at::kFloat);
  const int64_t T = streams.size(0), n = streams.size(1), D = streams.size(2), nd = n * D;
  TORCH_CHECK(fn.size(0) == n && fn.size(1) == nd && base.numel() == n, "fn must be [n, n*D] and base [n]");
  at::Tensor out = at::empty({T, D}, streams.options());
  const float *S = streams.data_ptr<float>(), *F = fn.data_ptr<float>(), *B = base.data_ptr<float>();
  const float s0 = scale.data_ptr<float>()[0], neps = static_cast<float>(norm_eps), heps = static_cast<float>(hc_eps);
  float* O = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    Scratch<float, 64> mix_buf(n);
    float* mix = mix_buf.data();
    for (int64_t t = begin; t < end; ++t) {
      const float* x = S + t * nd;
      const float r = inv_rms(x, nd, neps);
      gemv(x, F, nd, nd, n, mix);
      float* o = O + t * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < n; ++j) axpy(sigmoid(mix[j] * r * s0 + B[j]) + heps, x + j * D, o, D);
    }
  });
  return out;
}

at::Tensor hc_post(const at::Tensor& block_in, const at::Tensor& streams_in, const at::Tensor& post_in,
                   const at::Tensor& comb_in) {
  check_float(block_in, "block_out");
  check_float(streams_in, "streams");
  check_float(post_in, "post");
  check_float(comb_in, "comb");
  const at::Tensor block = block_in.contiguous(), streams = streams_in.contiguous();
  const at::Tensor post = post_in.contiguous(), comb = comb_in.contiguous();
  const int64_t T = streams.size(0), n = streams.size(1), D = streams.size(2);
  TORCH_CHECK(block.size(0) == T && block.size(-1) == D, "block_out must be [T, D]");
  at::Tensor out = at::empty({T, n, D}, streams.options());
  const float *X = block.data_ptr<float>(), *S = streams.data_ptr<float>(), *P = post.data_ptr<float>(),
              *M = comb.data_ptr<float>();
  float* O = out.data_ptr<float>();
  // out[t, j] = post[t, j] * x[t] + sum_i comb[t, i, j] * streams[t, i], kChunk columns at a time
  // with the sum over i in registers (sequential in i, as before)
  constexpr int64_t kChunk = 32;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *x = X + t * D, *s = S + t * n * D, *c = M + t * n * n;
      for (int64_t j = 0; j < n; ++j) {
        const float p = P[t * n + j];
        float* o = O + (t * n + j) * D;
        int64_t d0 = 0;
        for (; d0 + kChunk <= D; d0 += kChunk) {
          float acc[kChunk] = {};
          for (int64_t i = 0; i < n; ++i) {
            const float w = c[i * n + j], *si = s + i * D + d0;
#pragma omp simd
            for (int64_t d = 0; d < kChunk; ++d) acc[d] += w * si[d];
          }
#pragma omp simd
          for (int64_t d = 0; d < kChunk; ++d) o[d0 + d] = p * x[d0 + d] + acc[d];
        }
        if (d0 < D) {  // the same arithmetic on the last partial chunk
          float acc[kChunk] = {};
          const int64_t len = D - d0;
          for (int64_t i = 0; i < n; ++i) {
            const float w = c[i * n + j], *si = s + i * D + d0;
            for (int64_t d = 0; d < len; ++d) acc[d] += w * si[d];
          }
          for (int64_t d = 0; d < len; ++d) o[d0 + d] = p * x[d0 + d] + acc[d];
        }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------- norms and rope
at::Tensor rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight_in, double eps) {
  check_float(x_in, "x");
  auto [x, stride, rows] = as_rows(x_in);
  const int64_t D = x_in.size(-1);
  at::Tensor out = at::empty(x_in.sizes(), x_in.options());
  at::Tensor weight;
  const float* W = nullptr;
  if (weight_in.has_value() && weight_in->defined()) {
    weight = weight_in->contiguous().to(at::kFloat);
    TORCH_CHECK(weight.numel() == D, "weight must have ", D, " elements");
    W = weight.data_ptr<float>();
  }
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = X + r * stride;
      float* o = O + r * D;
      const float scale = inv_rms(xr, D, e);
      if (W) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * scale * W[d];
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * scale;
      }
    }
  });
  return out;
}

// x [T, D] or [T, H, D]; the last 2*R dims rotate as interleaved pairs by (cos, sin) [T, R].
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, bool inverse) {
  check_float(x_in, "x");
  check_float(cos_in, "cos");
  check_float(sin_in, "sin");
  TORCH_CHECK(x_in.dim() == 2 || x_in.dim() == 3, "x must be [T, D] or [T, H, D]");
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t T = x.size(0), H = x.dim() == 3 ? x.size(1) : 1, D = x.size(-1), R = cos.size(-1);
  TORCH_CHECK(cos.size(0) == T && sin.sizes() == cos.sizes() && 2 * R <= D, "cos/sin must be [T, R] with 2R <= D");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *X = x.data_ptr<float>(), *Cs = cos.data_ptr<float>(), *Sn = sin.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float sign = inverse ? -1.0f : 1.0f;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = Cs + t * R, *s = Sn + t * R;
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = X + (t * H + h) * D;
        float* o = O + (t * H + h) * D;
        const int64_t nope = D - 2 * R;
        std::copy(xr, xr + nope, o);
        rotate_pairs(xr + nope, o + nope, c, s, R, sign);
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------- attention and indexer
// q [T, H, Dh], kv [rows, Dh] (a pool), indices [T, K] rows of kv (-1 = absent), sinks [H].
// The checks and views both attention kernels share: q [T, H, Dh], kv [rows, Dh] (a pool with
// contiguous rows), indices [T, K] (int64), sinks [H]; the output [T, H, Dh] allocated.
struct AttentionCall {
  at::Tensor q, indices, sinks, out;
  int64_t T, H, Dh, K, rows, kv_stride;
  const float *Q, *KV, *SK;
  const int64_t* I;
  float* O;
  float sc;
};

AttentionCall attention_call(const at::Tensor& q_in, const at::Tensor& kv, const at::Tensor& indices_in,
                             const at::Tensor& sinks_in, double scale) {
  check_float(q_in, "q");
  check_float(kv, "kv");
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1, "kv must be [rows, Dh] with contiguous rows");
  TORCH_CHECK(indices_in.scalar_type() == at::kLong, "indices must be int64");
  AttentionCall c;
  c.q = q_in.contiguous(), c.indices = indices_in.contiguous(), c.sinks = sinks_in.contiguous().to(at::kFloat);
  c.T = c.q.size(0), c.H = c.q.size(1), c.Dh = c.q.size(2), c.K = c.indices.size(1), c.rows = kv.size(0);
  c.kv_stride = kv.stride(0);
  TORCH_CHECK(kv.size(1) == c.Dh && c.indices.size(0) == c.T, "shape mismatch between q, kv and indices");
  c.out = at::empty({c.T, c.H, c.Dh}, c.q.options());
  c.Q = c.q.data_ptr<float>(), c.KV = kv.data_ptr<float>(), c.SK = c.sinks.data_ptr<float>();
  c.I = c.indices.data_ptr<int64_t>(), c.O = c.out.data_ptr<float>(), c.sc = static_cast<float>(scale);
  return c;
}

at::Tensor sparse_attention(const at::Tensor& q_in, const at::Tensor& kv, const at::Tensor& indices_in,
                            const at::Tensor& sinks_in, double scale) {
  const AttentionCall call = attention_call(q_in, kv, indices_in, sinks_in, scale);
  const int64_t T = call.T, H = call.H, Dh = call.Dh, K = call.K, rows = call.rows, kv_stride = call.kv_stride;
  const float *Q = call.Q, *KV = call.KV, *SK = call.SK, sc = call.sc;
  const int64_t* I = call.I;
  float* O = call.O;
  // Keys are shared by the heads (MQA): no transposed copy of them, the logits come from dot_rows
  // over blocks of 8 key rows per head, and the output accumulates kHeads heads x kChunk dims in
  // registers while walking the keys once (each element summed over the keys in order).
  constexpr int64_t kHeads = 4, kChunk = 32;
  // One task per (token, block of kHeads heads): a decode token's heads spread over the threads.
  const int64_t HB = (H + kHeads - 1) / kHeads;
  const int64_t grain = std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(1, 2 * K * Dh * std::min(kHeads, H)));
  at::parallel_for(0, T * HB, grain, [&](int64_t begin, int64_t end) {
    Scratch<const float*, 512> keys_buf(K);
    Scratch<float, 4096> probs_buf(kHeads * K);
    const float** keys = keys_buf.data();
    float* probs = probs_buf.data();  // [kHeads, K]: this block's heads
    int64_t keys_of = -1, valid = 0;  // the token whose keys are in `keys`
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / HB, h0 = item % HB * kHeads, hb = std::min(kHeads, H - h0);
      if (t != keys_of) {
        valid = present_rows(I + t * K, K, KV, rows, kv_stride, "attention index", keys);
        keys_of = t;
      }
      for (int64_t hh = 0; hh < hb; ++hh) {
        const int64_t h = h0 + hh;
        float* l = probs + hh * K;
        dot_many(Q + (t * H + h) * Dh, [keys](int64_t k) { return keys[k]; }, Dh, valid, l);
        float mx = SK[h];
#pragma omp simd reduction(max : mx)
        for (int64_t k = 0; k < valid; ++k) mx = max_of(mx, l[k] *= sc);
#pragma omp simd
        for (int64_t k = 0; k < valid; ++k) l[k] = fast_exp(l[k] - mx);
        const float denom = fast_exp(SK[h] - mx) + sum_of(l, valid);  // the sink: a logit with no value
#pragma omp simd
        for (int64_t k = 0; k < valid; ++k) l[k] = l[k] / denom;
      }
      for (int64_t d0 = 0; d0 < Dh; d0 += kChunk) {
        const int64_t db = std::min(kChunk, Dh - d0);
        float acc[kHeads][kChunk] = {};
        if (hb == kHeads && db == kChunk) {
          for (int64_t k = 0; k < valid; ++k) {
            const float* __restrict key = keys[k] + d0;
            for (int64_t hh = 0; hh < kHeads; ++hh) {
              const float p = probs[hh * K + k];
#pragma omp simd
              for (int64_t d = 0; d < kChunk; ++d) acc[hh][d] += p * key[d];
            }
          }
        } else {  // a partial block: the same arithmetic, slower
          for (int64_t k = 0; k < valid; ++k)
            for (int64_t hh = 0; hh < hb; ++hh) {
              const float p = probs[hh * K + k];
              for (int64_t d = 0; d < db; ++d) acc[hh][d] += p * keys[k][d0 + d];
            }
        }
        for (int64_t hh = 0; hh < hb; ++hh) std::copy(acc[hh], acc[hh] + db, O + (t * H + h0 + hh) * Dh + d0);
      }
    }
  });
  return call.out;
}

// DeepSeek-V4.1's sparse attention (backends/base.py sparse_attention_bf16): per token and head, an
// online softmax over the index list in blocks of kBlock positions (the running max from -1e30, -1
// entries contributing nothing), each block's probabilities rounded to bfloat16 before P.V while
// the denominator sums them unrounded, then the sink joins the denominator at the final max. The
// reference's block structure is kept so the rounding points are its own; the dots and sums run in
// this file's fixed orders (within op_checks.V41_OPS' tolerance of the reference).
at::Tensor sparse_attention_bf16(const at::Tensor& q_in, const at::Tensor& kv, const at::Tensor& indices_in,
                                 const at::Tensor& sinks_in, double scale) {
  constexpr int64_t kBlock = 64;  // reference.py SPARSE_BLOCK
  const AttentionCall call = attention_call(q_in, kv, indices_in, sinks_in, scale);
  const int64_t T = call.T, H = call.H, Dh = call.Dh, K = call.K, rows = call.rows, kv_stride = call.kv_stride;
  const float *Q = call.Q, *KV = call.KV, *SK = call.SK, sc = call.sc;
  const int64_t* I = call.I;
  float* O = call.O;
  const int64_t grain = std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(1, 2 * K * Dh));
  at::parallel_for(0, T * H, grain, [&](int64_t begin, int64_t end) {
    Scratch<const float*, 512> keys_buf(K);
    Scratch<float, 1024> acc_buf(2 * Dh);
    const float** keys = keys_buf.data();
    float *acc = acc_buf.data(), *part = acc + Dh;
    float logits[kBlock], probs[kBlock];
    int64_t keys_of = -1;  // the token whose keys are in `keys` (nullptr: a -1 entry)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / H, h = item % H;
      if (t != keys_of) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = I[t * K + k];
          TORCH_CHECK(r < rows, "attention index ", r, " out of range for ", rows, " rows");
          keys[k] = r < 0 ? nullptr : KV + r * kv_stride;
        }
        keys_of = t;
      }
      const float* qh = Q + (t * H + h) * Dh;
      float run_max = -1e30f, denom = 0.0f;
      std::fill(acc, acc + Dh, 0.0f);
      for (int64_t b0 = 0; b0 < K; b0 += kBlock) {
        const int64_t nb = std::min(kBlock, K - b0);
        const float** bk = keys + b0;
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < nb; ++k) {
          logits[k] = bk[k] ? dot(qh, bk[k], Dh) * sc : -std::numeric_limits<float>::infinity();
          block_max = max_of(block_max, logits[k]);
        }
        const float new_max = max_of(run_max, block_max), rescale = fast_exp(run_max - new_max);
        for (int64_t k = 0; k < nb; ++k) probs[k] = fast_exp(logits[k] - new_max);
        denom = denom * rescale + sum_of(probs, nb);
        std::fill(part, part + Dh, 0.0f);
        for (int64_t k = 0; k < nb; ++k)
          if (bk[k]) axpy(round_bf16(probs[k]), bk[k], part, Dh);
        for (int64_t d = 0; d < Dh; ++d) acc[d] = acc[d] * rescale + part[d];
        run_max = new_max;
      }
      denom += fast_exp(SK[h] - run_max);
      float* o = O + (t * H + h) * Dh;
      for (int64_t d = 0; d < Dh; ++d) o[d] = acc[d] / denom;
    }
  });
  return call.out;
}

// Lightning Indexer: score(t, m) = sum_h w[t, h] * relu(q[t, h] . keys[cand[t, m]]) * scale; the k best
// candidates per token, best first, ties to the earlier candidate (the reference's stable sort), -1 past
// the valid ones.
at::Tensor indexer_topk(const at::Tensor& q_in, const at::Tensor& weights_in, const at::Tensor& keys,
                        const at::Tensor& cand_in, int64_t topk, double scale) {
  check_float(q_in, "q");
  check_float(weights_in, "weights");
  check_float(keys, "keys");
  TORCH_CHECK(keys.dim() == 2 && keys.stride(1) == 1, "keys must be [rows, Di] with contiguous rows");
  TORCH_CHECK(cand_in.scalar_type() == at::kLong, "candidates must be int64");
  const at::Tensor q = q_in.contiguous(), weights = weights_in.contiguous(), cand = cand_in.contiguous();
  const int64_t T = cand.size(0), M = cand.size(1), H = q.size(1), Di = q.size(2), k = std::min(topk, M),
                rows = keys.size(0), key_stride = keys.stride(0);
  TORCH_CHECK(q.size(0) == T && weights.size(0) == T && weights.size(1) == H && keys.size(1) == Di,
              "shape mismatch between q, weights, keys and candidates");
  at::Tensor out = at::full({T, k}, -1, cand.options());
  if (T == 0 || k == 0) return out;
  const float *Q = q.data_ptr<float>(), *W = weights.data_ptr<float>(), *KS = keys.data_ptr<float>();
  const int64_t* C = cand.data_ptr<int64_t>();
  int64_t* O = out.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  // Vectorised over the heads: the token's queries are transposed once to qt [Di, Hp] (heads padded
  // with zero queries and weights to kHeadLanes, which add exact zeros), then each candidate key is
  // read once for all heads, kCands candidates at a time (independent accumulator chains). A
  // candidate's score sums its heads lane-wise over the head blocks, then over the lanes in a fixed tree.
  constexpr int64_t kHeadLanes = 16, kCands = 8;
  static_assert(kHeadLanes == 2 * kLanes && kCands == 8, "the score reduction below folds 16 lanes of 8 candidates");
  const int64_t Hp = (H + kHeadLanes - 1) / kHeadLanes * kHeadLanes;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    Scratch<float, 4096> qt_buf(Di * Hp), score_buf(M);
    Scratch<float, 256> w_buf(Hp);
    Scratch<const float*, 1024> keys_buf(M);
    Scratch<int64_t, 1024> column_buf(M), best_buf(k);
    float *qt = qt_buf.data(), *score = score_buf.data(), *wt = w_buf.data();
    const float** keys = keys_buf.data();
    int64_t *column = column_buf.data(), *best = best_buf.data();
    std::fill(qt, qt + Di * Hp, 0.0f);  // the padding heads stay zero
    std::fill(wt, wt + Hp, 0.0f);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* cand = C + t * M;
      int64_t valid = 0;
      for (int64_t m = 0; m < M; ++m) {
        if (cand[m] < 0) continue;
        TORCH_CHECK(cand[m] < rows, "indexer candidate ", cand[m], " out of range for ", rows, " rows");
        column[valid] = m;
        keys[valid++] = KS + cand[m] * key_stride;
      }
      if (valid == 0) continue;
      std::copy(W + t * H, W + t * H + H, wt);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < Di; ++d) qt[d * Hp + h] = Q[(t * H + h) * Di + d];
      for (int64_t j0 = 0; j0 < valid; j0 += kCands) {
        const float* key[kCands];  // a short last block repeats its last key; those scores are dropped
        for (int64_t c = 0; c < kCands; ++c) key[c] = keys[std::min(j0 + c, valid - 1)];
        float tot[kCands][kHeadLanes] = {};
        for (int64_t h0 = 0; h0 < Hp; h0 += kHeadLanes) {
          float s[kCands][kHeadLanes] = {};
          for (int64_t d = 0; d < Di; ++d) {
            const float* __restrict q = qt + d * Hp + h0;
            for (int64_t c = 0; c < kCands; ++c) {
              const float kd = key[c][d];
#pragma omp simd
              for (int64_t l = 0; l < kHeadLanes; ++l) s[c][l] += kd * q[l];
            }
          }
          for (int64_t c = 0; c < kCands; ++c)
#pragma omp simd
            for (int64_t l = 0; l < kHeadLanes; ++l) tot[c][l] += max_of(s[c][l], 0.0f) * sc * wt[h0 + l];
        }
        float half[kCands][kLanes], block_score[kCands];  // lanes l and l + 8, then the tree of dot()
        for (int64_t c = 0; c < kCands; ++c)
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) half[c][l] = tot[c][l] + tot[c][l + kLanes];
        sum_lanes_8_rows(half, block_score);
        std::copy(block_score, block_score + std::min(kCands, valid - j0), score + j0);
      }
      // the k best, best first; a later candidate must beat, not tie, to pass an earlier one (the
      // reference's stable sort). Insertion into a sorted list of at most k: k is small.
      const int64_t take = std::min(k, valid);
      int64_t kept = 0;
      for (int64_t j = 0; j < valid; ++j) {
        const float sj = score[j];
        if (kept == take && !(sj > score[best[take - 1]])) continue;
        int64_t pos = kept < take ? kept++ : take - 1;
        for (; pos > 0 && sj > score[best[pos - 1]]; --pos) best[pos] = best[pos - 1];
        best[pos] = j;
      }
      for (int64_t j = 0; j < take; ++j) O[t * k + j] = cand[column[best[j]]];
    }
  });
  return out;
}


// ---------------------------------------------------------------- small-batch projections and routing
// grouped_linear: x [T, G, K], weight [G*N, K] -> [T, G, N] (group g uses rows g*N..g*N+N-1).
at::Tensor grouped_linear(const at::Tensor& x_in, const at::Tensor& w_in) {
  check_float(x_in, "x");
  check_float(w_in, "weight");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t T = x.size(0), G = x.size(1), K = x.size(2), N = w.size(0) / G;
  TORCH_CHECK(w.size(1) == K && w.size(0) == G * N, "weight must be [G*N, K]");
  at::Tensor out = at::empty({T, G, N}, x.options());
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  // one task per (group, block of up to kRowGroup tokens): a decode step's groups (heads) spread over
  // the threads, and a group's weight is read once for the block's tokens (gemm_rows)
  const int64_t blocks = (T + kRowGroup - 1) / kRowGroup;
  at::parallel_for(0, G * blocks, std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(1, std::min(T, kRowGroup) * N * K)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i % G, t0 = (i / G) * kRowGroup;
      gemm_rows([&](int64_t t) { return X + ((t0 + t) * G + g) * K; }, [&](int64_t t) { return O + ((t0 + t) * G + g) * N; },
                std::min(kRowGroup, T - t0), W + g * N * K, K, K, N);
    }
  });
  return out;
}

// linear: x [T, K], weight [N, K] -> [T, N], a GEMV per token (small batches: kernels.py)
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w_in) {
  check_float(x_in, "x");
  check_float(w_in, "weight");
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1), "x must be [T, K], weight [N, K]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({T, N}, x.options());
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  if (T <= kRowGroup) {  // few tokens: split the weight's rows (parallel_rows), each read once for all tokens
    parallel_rows(N, T * K, [&](int64_t r0, int64_t r1) {
      gemm_rows([&](int64_t t) { return X + t * K; }, [&](int64_t t) { return O + t * N + r0; }, T, W + r0 * K, K, K,
                r1 - r0);
    });
    return out;
  }
  at::parallel_for(0, T, kRowGroup, [&](int64_t begin, int64_t end) {
    gemm_rows([&](int64_t t) { return X + (begin + t) * K; }, [&](int64_t t) { return O + (begin + t) * N; },
              end - begin, W, K, K, N);
  });
  return out;
}

// out[t * ld_out + r] = dot(x[t], w[r]) for t < T, r < rows: a block of linear's output with the
// same dots as linear (gemm_rows), for a consumer that reads the block while it is in cache.
void linear_block(const float* X, int64_t T, int64_t K, const float* W, int64_t rows, float* out, int64_t ld_out) {
  gemm_rows([&](int64_t t) { return X + t * K; }, [&](int64_t t) { return out + t * ld_out; }, T, W, K, K, rows);
}

// route_topk: the top_k experts by score + bias (best first), weighted by their scores normalised.
std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& x_in, const at::Tensor& gate_in,
                                              const at::Tensor& bias_in, int64_t top_k, double scaling) {
  check_float(x_in, "x");
  check_float(gate_in, "gate");
  const at::Tensor x = x_in.contiguous(), gate = gate_in.contiguous(), bias = bias_in.contiguous().to(at::kFloat);
  const int64_t T = x.size(0), D = x.size(1), E = gate.size(0);
  TORCH_CHECK(gate.size(1) == D && bias.numel() == E && top_k <= E, "gate must be [E, D], bias [E], top_k <= E");
  at::Tensor weights = at::empty({T, top_k}, x.options()), ids = at::empty({T, top_k}, x.options().dtype(at::kLong));
  const float *X = x.data_ptr<float>(), *Gt = gate.data_ptr<float>(), *Bs = bias.data_ptr<float>();
  float* Wo = weights.data_ptr<float>();
  int64_t* Io = ids.data_ptr<int64_t>();
  const float sc = static_cast<float>(scaling);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    Scratch<float, 1024> score_buf(E), biased_buf(E);
    Scratch<int64_t, 1024> order_buf(E);
    float *score = score_buf.data(), *biased = biased_buf.data();
    int64_t* order = order_buf.data();
    for (int64_t t = begin; t < end; ++t) {
      gemv(X + t * D, Gt, D, D, E, score);
      pick_route(score, biased, order, Bs, E, top_k, sc, Io + t * top_k, Wo + t * top_k);
    }
  });
  return {weights, ids};
}

// route_hash: fixed expert ids per token; only their scores are computed.
at::Tensor route_hash(const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& ids_in, double scaling) {
  check_float(x_in, "x");
  check_float(gate_in, "gate");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong, "ids must be int64");
  const at::Tensor x = x_in.contiguous(), gate = gate_in.contiguous(), ids = ids_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), E = gate.size(0), k = ids.size(1);
  at::Tensor weights = at::empty({T, k}, x.options());
  const float *X = x.data_ptr<float>(), *Gt = gate.data_ptr<float>();
  const int64_t* I = ids.data_ptr<int64_t>();
  float* Wo = weights.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = I[t * k + j];
        TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of range for ", E, " experts");
        Wo[t * k + j] = router_score(dot(X + t * D, Gt + e * D, D));
      }
      normalize_route(Wo + t * k, k, static_cast<float>(scaling));
    }
  });
  return weights;
}

// route_grouped_topk (DeepSeek-V3): sigmoid scores; the topk_group groups (of E / n_group experts) whose
// two best biased scores sum highest are kept; the top_k experts by biased score among them, weighted by
// their unbiased scores (normalised if asked), times scaling. Ties go to the lower index (the contract
// leaves them open). One token at a time, so a row never depends on its batch.
std::tuple<at::Tensor, at::Tensor> route_grouped_topk(const at::Tensor& x_in, const at::Tensor& gate_in,
                                                      const at::Tensor& bias_in, int64_t top_k, int64_t n_group,
                                                      int64_t topk_group, bool normalize, double scaling) {
  check_float(x_in, "x");
  check_float(gate_in, "gate");
  const at::Tensor x = x_in.contiguous(), gate = gate_in.contiguous(), bias = bias_in.contiguous().to(at::kFloat);
  const int64_t T = x.size(0), D = x.size(1), E = gate.size(0);
  TORCH_CHECK(gate.size(1) == D && bias.numel() == E, "gate must be [E, D] and bias [E] for x [T, D]");
  TORCH_CHECK(n_group > 0 && E % n_group == 0 && topk_group > 0 && topk_group <= n_group,
              "n_group must divide the experts and 0 < topk_group <= n_group");
  const int64_t per_group = E / n_group;
  TORCH_CHECK(top_k > 0 && top_k <= topk_group * per_group && (topk_group == n_group || per_group >= 2),
              "top_k must be in [1, topk_group * E / n_group], and a limited group needs >= 2 experts");
  at::Tensor weights = at::empty({T, top_k}, x.options()), ids = at::empty({T, top_k}, x.options().dtype(at::kLong));
  const float *X = x.data_ptr<float>(), *Gt = gate.data_ptr<float>(), *Bs = bias.data_ptr<float>();
  float* Wo = weights.data_ptr<float>();
  int64_t* Io = ids.data_ptr<int64_t>();
  const float sc = static_cast<float>(scaling);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    Scratch<float, 1024> score_buf(E), biased_buf(E), group_buf(n_group);
    Scratch<int64_t, 1024> order_buf(E), group_order_buf(n_group);
    float *score = score_buf.data(), *biased = biased_buf.data(), *group_score = group_buf.data();
    int64_t *order = order_buf.data(), *groups = group_order_buf.data();
    auto better = [&](const float* v) {
      return [v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
    };
    for (int64_t t = begin; t < end; ++t) {
      gemv(X + t * D, Gt, D, D, E, score);
      for (int64_t e = 0; e < E; ++e) {
        score[e] = 1.0f / (1.0f + std::exp(-score[e]));
        biased[e] = score[e] + Bs[e];
      }
      int64_t n_candidates = E;
      if (topk_group < n_group) {
        for (int64_t g = 0; g < n_group; ++g) {  // the sum of the group's two best biased scores
          const float* b = biased + g * per_group;
          float first = -std::numeric_limits<float>::infinity(), second = first;
          for (int64_t j = 0; j < per_group; ++j) {
            if (b[j] > first) {
              second = first;
              first = b[j];
            } else if (b[j] > second) {
              second = b[j];
            }
          }
          group_score[g] = first + second;
        }
        std::iota(groups, groups + n_group, 0);
        std::partial_sort(groups, groups + topk_group, groups + n_group, better(group_score));
        std::sort(groups, groups + topk_group);
        n_candidates = 0;
        for (int64_t i = 0; i < topk_group; ++i)
          for (int64_t j = 0; j < per_group; ++j) order[n_candidates++] = groups[i] * per_group + j;
      } else {
        std::iota(order, order + E, 0);
      }
      std::partial_sort(order, order + top_k, order + n_candidates, better(biased));
      float* w = Wo + t * top_k;
      for (int64_t j = 0; j < top_k; ++j) {
        Io[t * top_k + j] = order[j];
        w[j] = score[order[j]];
      }
      if (normalize) {
        normalize_route(w, top_k, sc);
      } else {
        for (int64_t j = 0; j < top_k; ++j) w[j] *= sc;
      }
    }
  });
  return {weights, ids};
}

// ---------------------------------------------------------------- MoE (small batches)
// out_of(t) = down @ (silu(min(g, limit)) * clamp(u, -limit, limit)), (g, u) = gate_up @ x_of(t), for
// T rows with the same weights: gate_up [2I, D] (gate rows 0..I-1, up rows I..2I-1), down [D, I];
// gu [T, 2I] and hidden [T, I] are scratch. Weight-stationary (gemm_rows): each matrix is read once.
// Inside a parallel region (one task per expert) each call runs on its thread; outside one, each
// matrix's rows are split over the threads (parallel_rows), the activation in between on this one.
template <class XOf, class OutOf>
inline void swiglu_rows(XOf x_of, OutOf out_of, int64_t T, const float* gate_up, const float* down, int64_t D,
                        int64_t I, float lim, float* gu, float* hidden) {
  parallel_rows(2 * I, T * D, [&](int64_t r0, int64_t r1) {
    gemm_rows(x_of, [&](int64_t t) { return gu + t * 2 * I + r0; }, T, gate_up + r0 * D, D, D, r1 - r0);
  });
  for (int64_t t = 0; t < T; ++t) {
    const float* __restrict g_row = gu + t * 2 * I;
    float* __restrict h = hidden + t * I;
#pragma omp simd
    for (int64_t j = 0; j < I; ++j) {
      const float g = min_of(g_row[j], lim);
      const float u = min_of(max_of(g_row[I + j], -lim), lim);  // std::clamp returns a reference: no vectorising
      h[j] = g / (1.0f + fast_exp(-g)) * u;
    }
  }
  parallel_rows(D, T * I, [&](int64_t r0, int64_t r1) {
    gemm_rows([&](int64_t t) { return hidden + t * I; }, [&](int64_t t) { return out_of(t) + r0; }, T, down + r0 * I,
              I, I, r1 - r0);
  });
}

// The shared expert: swiglu_rows over all tokens. x [T, D], gate_up [2I, D], down [D, I] -> [T, D].
at::Tensor swiglu_mlp(const at::Tensor& x_in, const at::Tensor& gate_up_in, const at::Tensor& down_in, double limit) {
  check_float(x_in, "x");
  check_float(gate_up_in, "gate_up");
  check_float(down_in, "down");
  const at::Tensor x = x_in.contiguous(), gate_up = gate_up_in.contiguous(), down = down_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), I = gate_up.size(0) / 2;
  TORCH_CHECK(gate_up.size(0) == 2 * I && gate_up.size(1) == D && down.size(0) == D && down.size(1) == I,
              "gate_up must be [2I, D] and down [D, I] for x [T, D]");
  at::Tensor out = at::empty({T, D}, x.options());
  const float *X = x.data_ptr<float>(), *GU = gate_up.data_ptr<float>(), *DN = down.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float lim = static_cast<float>(limit);
  if (T <= kRowGroup) {  // one group of tokens: its matrices' rows split over the threads (swiglu_rows)
    Scratch<float, 8192> gu(T * 2 * I), hidden(T * I);
    swiglu_rows([&](int64_t t) { return X + t * D; }, [&](int64_t t) { return O + t * D; }, T, GU, DN, D, I, lim,
                gu.data(), hidden.data());
    return out;
  }
  at::parallel_for(0, T, kRowGroup, [&](int64_t begin, int64_t end) {
    const int64_t group = std::min(kRowGroup, end - begin);
    Scratch<float, 8192> gu(group * 2 * I), hidden(group * I);  // uninitialised, on the stack at decode sizes
    for (int64_t t0 = begin; t0 < end; t0 += kRowGroup)
      swiglu_rows([&](int64_t t) { return X + (t0 + t) * D; }, [&](int64_t t) { return O + (t0 + t) * D; },
                  std::min(kRowGroup, end - t0), GU, DN, D, I, lim, gu.data(), hidden.data());
  });
  return out;
}

// x [T, D], weights/ids [T, k], gate_up [E, 2I, D], down [E, D, I]: sum_j weights[t, j] *
// expert_{ids[t, j]}(x[t]), the expert's SwiGLU MLP with clamped inputs. GEMVs, weight-stationary
// per expert: meant for decode-sized batches, where the per-expert GEMMs of the reference are
// launch-bound; kernels.py sends large batches to the reference.
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& ids_in,
                       const at::Tensor& gate_up_in, const at::Tensor& down_in, double limit) {
  check_float(x_in, "x");
  check_float(gate_up_in, "gate_up");
  check_float(down_in, "down");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong, "ids must be int64");
  const at::Tensor x = x_in.contiguous(), weights = weights_in.contiguous().to(at::kFloat), ids = ids_in.contiguous();
  const at::Tensor gate_up = gate_up_in.contiguous(), down = down_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), k = ids.size(1), E = gate_up.size(0), I2 = gate_up.size(1),
                I = I2 / 2;
  TORCH_CHECK(gate_up.size(2) == D && down.size(0) == E && down.size(1) == D && down.size(2) == I,
              "expert weight shapes do not match x");
  at::Tensor out = at::empty({T, D}, x.options());
  const float *X = x.data_ptr<float>(), *Wt = weights.data_ptr<float>(), *GU = gate_up.data_ptr<float>(),
              *DN = down.data_ptr<float>();
  const int64_t* ID = ids.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float lim = static_cast<float>(limit);
  // (token, slot) rows grouped by expert (a counting sort), so each expert's weights are read once
  // for all its rows; a row's arithmetic does not depend on the grouping, and the sum over a
  // token's experts below runs in slot order, as the reference.
  const int64_t R = T * k;
  const RowsByExpert grouped(ID, R, E);
  const std::vector<int64_t>&first = grouped.first, &by_expert = grouped.by_expert;
  std::vector<float> expert_rows(R * D);  // expert_{ids[t, j]}(x[t]) at row t * k + j
  float* ER = expert_rows.data();
  // The experts with rows, one task each (a decode token's k experts go to different threads),
  // an expert's rows in groups of kRowGroup through swiglu_rows. Fewer experts than threads: one
  // after another, each matrix's rows split over the threads instead (swiglu_rows).
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; ++e)
    if (first[e + 1] > first[e]) hit.push_back(e);
  auto run_experts = [&](int64_t h_begin, int64_t h_end) {
    int64_t group = 0;  // the most rows one call of swiglu_rows takes here
    for (int64_t h = h_begin; h < h_end; ++h)
      group = std::max(group, std::min(kRowGroup, first[hit[h] + 1] - first[hit[h]]));
    Scratch<float, 8192> gu(group * I2), hidden(group * I);
    for (int64_t h = h_begin; h < h_end; ++h)
      for (int64_t e = hit[h], i0 = first[e]; i0 < first[e + 1]; i0 += kRowGroup) {
        const int64_t* rows = by_expert.data() + i0;
        swiglu_rows([&](int64_t j) { return X + (rows[j] / k) * D; }, [&](int64_t j) { return ER + rows[j] * D; },
                    std::min(kRowGroup, first[e + 1] - i0), GU + e * I2 * D, DN + e * D * I, D, I, lim, gu.data(),
                    hidden.data());
      }
  };
  const int64_t n_hit = static_cast<int64_t>(hit.size());
  if (n_hit < at::get_num_threads() && !at::in_parallel_region())
    run_experts(0, n_hit);
  else
    at::parallel_for(0, n_hit, 1, run_experts);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = O + t * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < k; ++j) axpy(Wt[t * k + j], ER + (t * k + j) * D, o, D);  // slot order
    }
  });
  return out;
}

// ---------------------------------------------------------------- compressor
// Entries of finished windows from the compressor's staged rows. ring [R, 2C] holds each token's
// [kv | gate] (C channels each); rows [W, S] name a window's tokens (-1 = absent: weight 0); bias
// [rate, C] is the gate's position bias. Without overlap (HCA) S = rate and C = dim; with it (CSA)
// S = 2 rate and C = 2 dim: the window's first `rate` tokens (the previous window) give their
// first dim channels, the last `rate` their second. Per channel a softmax over the tokens weights
// the kv; then RMSNorm (weight [dim]) and RoPE by (cos, sin) [W, Rr] on the last 2 Rr channels.
at::Tensor compress_entries(const at::Tensor& ring_in, const at::Tensor& rows_in, const at::Tensor& bias_in,
                            bool overlap, const at::Tensor& norm_in, double eps, const at::Tensor& cos_in,
                            const at::Tensor& sin_in) {
  check_float(ring_in, "ring");
  check_float(bias_in, "bias");
  check_float(norm_in, "norm_weight");
  TORCH_CHECK(ring_in.dim() == 2 && ring_in.stride(1) == 1, "ring must be [R, 2C] with contiguous rows");
  TORCH_CHECK(rows_in.scalar_type() == at::kLong && rows_in.dim() == 2, "rows must be int64 [W, S]");
  const at::Tensor rows = rows_in.contiguous(), bias = bias_in.contiguous(), norm = norm_in.contiguous();
  const at::Tensor cos = cos_in.contiguous().to(at::kFloat), sin = sin_in.contiguous().to(at::kFloat);
  const int64_t W = rows.size(0), S = rows.size(1), dim = norm.numel(), C = overlap ? 2 * dim : dim;
  const int64_t rate = bias.size(0), Rr = cos.size(-1), ld = ring_in.stride(0), R = ring_in.size(0);
  TORCH_CHECK(ring_in.size(1) == 2 * C && bias.size(1) == C, "ring must be [R, 2C] and bias [rate, C], C = ",
              C, " for ", dim, " channels", overlap ? " (overlapping windows)" : "");
  TORCH_CHECK(S == (overlap ? 2 * rate : rate), "rows must have ", overlap ? 2 * rate : rate, " tokens per window");
  TORCH_CHECK(cos.size(0) == W && sin.sizes() == cos.sizes() && 2 * Rr <= dim, "cos/sin must be [W, R], 2R <= dim");
  at::Tensor out = at::empty({W, dim}, ring_in.options());
  const float *Ring = ring_in.data_ptr<float>(), *Bias = bias.data_ptr<float>(), *Nw = norm.data_ptr<float>();
  const float *Cs = cos.data_ptr<float>(), *Sn = sin.data_ptr<float>();
  const int64_t* Idx = rows.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, W, 1, [&](int64_t begin, int64_t end) {
    Scratch<float, 512> buf(3 * dim);
    float *mx = buf.data(), *sum = mx + dim, *acc = sum + dim;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t* idx = Idx + w * S;
      std::fill(mx, mx + dim, -std::numeric_limits<float>::infinity());
      std::fill(sum, sum + 2 * dim, 0.0f);
      for (int64_t j = 0; j < S; ++j) {  // the gates' maximum per channel
        if (idx[j] < 0) continue;
        TORCH_CHECK(idx[j] < R, "row ", idx[j], " out of range for ", R, " ring rows");
        const int64_t off = overlap && j >= rate ? dim : 0;
        const float *g = Ring + idx[j] * ld + C + off, *b = Bias + (j % rate) * C + off;
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) mx[c] = max_of(mx[c], g[c] + b[c]);
      }
      for (int64_t j = 0; j < S; ++j) {
        if (idx[j] < 0) continue;
        const int64_t off = overlap && j >= rate ? dim : 0;
        const float *kv = Ring + idx[j] * ld + off, *g = kv + C, *b = Bias + (j % rate) * C + off;
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) {
          const float p = fast_exp(g[c] + b[c] - mx[c]);
          sum[c] += p;
          acc[c] += p * kv[c];
        }
      }
      float* o = O + w * dim;
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) o[c] = acc[c] / sum[c];
      const float scale = inv_rms(o, dim, e);
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) o[c] = o[c] * scale * Nw[c];
      rotate_pairs(o + dim - 2 * Rr, o + dim - 2 * Rr, Cs + w * Rr, Sn + w * Rr, Rr, 1.0f);
    }
  });
  return out;
}

// ---------------------------------------------------------------- fused sequences
// The Accelerator's composites (base.py) as one call each: the same kernels in the same order, so
// the results are those of the separate calls, bit for bit, without a Python round trip between.
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_norm(const at::Tensor& streams, const at::Tensor& fn,
                                                           const at::Tensor& base, const at::Tensor& scale,
                                                           double norm_eps, double hc_eps, int64_t sinkhorn_iters,
                                                           const at::Tensor& norm_weight) {
  auto [collapsed, post, comb] = hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters);
  return {rms_norm(collapsed, norm_weight, norm_eps), post, comb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre_norm(
    const at::Tensor& block_out, const at::Tensor& streams_in, const at::Tensor& post_in, const at::Tensor& comb_in,
    const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale, double norm_eps, double hc_eps,
    int64_t sinkhorn_iters, const at::Tensor& norm_weight) {
  at::Tensor streams = hc_post(block_out, streams_in, post_in, comb_in);
  auto [h, post, comb] = hc_pre_norm(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight);
  return {streams, h, post, comb};
}

at::Tensor rms_norm_rope(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                         const at::Tensor& cos, const at::Tensor& sin) {
  return rope(rms_norm(x, weight, eps), cos, sin, false);
}

}  // namespace deepinfer_cpu

using namespace deepinfer_cpu;

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("hc_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, float norm_eps, float hc_eps, "
        "int sinkhorn_iters) -> (Tensor, Tensor, Tensor)");
  m.def("hc_mixes(Tensor streams, Tensor fn, Tensor base, Tensor scale, float norm_eps, float hc_eps, "
        "int sinkhorn_iters) -> (Tensor, Tensor, Tensor)");
  m.def("hc_collapse(Tensor streams, Tensor weights) -> Tensor");
  m.def("hc_post(Tensor block_out, Tensor streams, Tensor post, Tensor comb) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("sparse_attention(Tensor q, Tensor kv, Tensor indices, Tensor sinks, float scale) -> Tensor");
  m.def("sparse_attention_bf16(Tensor q, Tensor kv, Tensor indices, Tensor sinks, float scale) -> Tensor");
  m.def("grouped_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("route_topk(Tensor x, Tensor gate, Tensor bias, int top_k, float scaling) -> (Tensor, Tensor)");
  m.def("route_hash(Tensor x, Tensor gate, Tensor ids, float scaling) -> Tensor");
  m.def("route_grouped_topk(Tensor x, Tensor gate, Tensor bias, int top_k, int n_group, int topk_group, "
        "bool normalize, float scaling) -> (Tensor, Tensor)");
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, float limit) -> Tensor");
  m.def("indexer_topk(Tensor q, Tensor weights, Tensor keys, Tensor candidates, int topk, float scale) -> Tensor");
  m.def("swiglu_mlp(Tensor x, Tensor gate_up, Tensor down, float limit) -> Tensor");
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.def("hc_head(Tensor streams, Tensor fn, Tensor base, Tensor scale, float norm_eps, float hc_eps) -> Tensor");
  m.def("compress_entries(Tensor ring, Tensor rows, Tensor bias, bool overlap, Tensor norm_weight, float eps, "
        "Tensor cos, Tensor sin) -> Tensor");
  m.def("hc_pre_norm(Tensor streams, Tensor fn, Tensor base, Tensor scale, float norm_eps, float hc_eps, "
        "int sinkhorn_iters, Tensor norm_weight) -> (Tensor, Tensor, Tensor)");
  m.def("hc_post_pre_norm(Tensor block_out, Tensor streams, Tensor post, Tensor comb, Tensor fn, Tensor base, "
        "Tensor scale, float norm_eps, float hc_eps, int sinkhorn_iters, Tensor norm_weight) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("rms_norm_rope(Tensor x, Tensor? weight, float eps, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("hc_pre", &hc_pre);
  m.impl("hc_mixes", &hc_mixes);
  m.impl("hc_collapse", &hc_collapse);
  m.impl("hc_post", &hc_post);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("sparse_attention", &sparse_attention);
  m.impl("sparse_attention_bf16", &sparse_attention_bf16);
  m.impl("indexer_topk", &indexer_topk);
  m.impl("moe_experts", &moe_experts);
  m.impl("grouped_linear", &grouped_linear);
  m.impl("route_topk", &route_topk);
  m.impl("route_hash", &route_hash);
  m.impl("route_grouped_topk", &route_grouped_topk);
  m.impl("swiglu_mlp", &swiglu_mlp);
  m.impl("linear", &linear);
  m.impl("hc_head", &hc_head);
  m.impl("compress_entries", &compress_entries);
  m.impl("hc_pre_norm", &hc_pre_norm);
  m.impl("hc_post_pre_norm", &hc_post_pre_norm);
  m.impl("rms_norm_rope", &rms_norm_rope);
}
