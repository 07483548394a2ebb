// Greedy sampling for the cpu backend (loaded with fused_ops.cpp into one library): the argmax of
// each row of a [B, V] float32 logits tensor, torch.argmax's rule (the first of equal maxima, a NaN
// counting as the largest). torch's own argmax over 32 rows of a 129,280-token vocabulary took
// 13.4 ms on one thread here (40% of the step, benchmarks/results/step_profile_tiny_test_deepseek_vocab.json):
// its reduction carries the index with every compare. This one finds each chunk's maximum with
// plain vectorised compares, then the first index that holds it, in a second pass over the
// chunk while it is still in cache (chunk_max).
//
// linear_argmax is argmax_rows(linear(x, weight)) without the logits: the greedy pick of a decode
// step straight from the LM head. Each task computes a block of the head's rows for every token
// with linear's own dots (fused_ops.cpp, linear_block) into a buffer that stays in cache, and finds
// the block's maxima there; the [tokens, vocab] logits are never written to memory and read back
// (16 x 129,280 floats: 8 MB each way). The cpu step replay substitutes it for that pair of calls
// (replay.py, fuse_calls); the tokens are the pair's, bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fused_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace deepinfer_cpu {

namespace {

constexpr int64_t kChunk = 8192;  // floats per work item: 32 KB, one L1/L2-resident pass

struct ChunkMax {
  float value;
  int64_t index;  // first index of value in the chunk
  bool nan;       // the chunk holds a NaN at `index` (its first one)
};

#if defined(__AVX512F__)
// The first index i in [0, n) where p[i] equals m (unordered: the first NaN); one is known to exist.
template <int kPredicate>
int64_t first_where(const float* p, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), mv, kPredicate))
      return i + __builtin_ctz(hit);
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  return i + __builtin_ctz(_mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, p + i), mv, kPredicate));
}
#endif

ChunkMax chunk_max(const float* x, int64_t begin, int64_t end) {
  // Pass 1: the maximum and whether a NaN is present (max and compare over independent vector
  // accumulators, no index bookkeeping). Pass 2, over the chunk again while it is in cache: the
  // first index that holds the maximum (or the first NaN), stopping there.
  const float* p = x + begin;
  const int64_t n = end - begin;
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_set1_ps(kLowest), _mm512_set1_ps(kLowest), _mm512_set1_ps(kLowest), _mm512_set1_ps(kLowest)};
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int a = 0; a < 4; ++a) {
      const __m512 v = _mm512_loadu_ps(p + i + 16 * a);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      acc[a] = _mm512_max_ps(v, acc[a]);  // a NaN v leaves acc (max returns its second operand)
    }
  for (; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(kLowest), live, p + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc[0] = _mm512_max_ps(v, acc[0]);
  }
  if (nan) return {std::numeric_limits<float>::quiet_NaN(), begin + first_where<_CMP_UNORD_Q>(p, n, 0.0f), true};
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(acc[0], acc[1]), _mm512_max_ps(acc[2], acc[3])));
  return {m, begin + first_where<_CMP_EQ_OQ>(p, n, m), false};  // every element -inf: m = -inf, index 0
#else
  constexpr int kLanes = 16;
  const int64_t full = n - n % kLanes;
  float best[kLanes];
  int nan[kLanes];
  for (int l = 0; l < kLanes; ++l) best[l] = kLowest, nan[l] = 0;
  for (int64_t i = 0; i < full; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float v = p[i + l];
      best[l] = v > best[l] ? v : best[l];
      nan[l] |= v != v;
    }
  }
  float m = kLowest;
  bool any_nan = false;
  for (int l = 0; l < kLanes; ++l) m = best[l] > m ? best[l] : m, any_nan |= nan[l] != 0;
  for (int64_t i = full; i < n; ++i) m = p[i] > m ? p[i] : m, any_nan |= p[i] != p[i];
  int64_t i = 0;
  if (any_nan) {
    while (p[i] == p[i]) ++i;
    return {std::numeric_limits<float>::quiet_NaN(), begin + i, true};
  }
  while (p[i] != m) ++i;  // m is in the chunk (every element -inf: m = -inf, index 0)
  return {m, begin + i, false};
#endif
}

// A row's argmax from its chunks' results, in index order: the first NaN, else the first chunk that
// holds the maximum (whose index is the first of it in that chunk).
int64_t first_max(const ChunkMax* f, int64_t chunks, int64_t stride) {
  ChunkMax best = f[0];
  for (int64_t c = 1; c < chunks && !best.nan; ++c)
    if (f[c * stride].nan || f[c * stride].value > best.value) best = f[c * stride];
  return best.index;
}

constexpr int64_t kHeadRows = 2048;  // LM-head rows per task: a [tokens, 2048] block of logits (<= 256 KB at 32 tokens)

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat, "argmax_rows: [B, V] float32");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: empty rows");
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  std::vector<ChunkMax> found(B * chunks);
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / chunks, c = item % chunks;
      const float* r = x + row * V;
      found[item] = chunk_max(r, c * kChunk, std::min(V, (c + 1) * kChunk));
    }
  });
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < B; ++row) o[row] = first_max(found.data() + row * chunks, chunks, 1);
  return out;
}

at::Tensor linear_argmax(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "linear_argmax: x must be [T, K], weight [N, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "linear_argmax: float32 only");
  TORCH_CHECK(w_in.size(0) > 0, "linear_argmax: empty weight");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0), blocks = (N + kHeadRows - 1) / kHeadRows;
  std::vector<ChunkMax> found(blocks * T);  // [block][token]
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits(T * std::min(kHeadRows, N));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * kHeadRows, rows = std::min(kHeadRows, N - r0);
      linear_block(X, T, K, W + r0 * K, rows, logits.data(), rows);
      for (int64_t t = 0; t < T; ++t) {
        ChunkMax m = chunk_max(logits.data() + t * rows, 0, rows);
        m.index += r0;
        found[b * T + t] = m;
      }
    }
  });
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) o[t] = first_max(found.data() + t, blocks, T);
  return out;
}

}  // namespace deepinfer_cpu

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("linear_argmax(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("argmax_rows", &deepinfer_cpu::argmax_rows);
  m.impl("linear_argmax", &deepinfer_cpu::linear_argmax);
}
