// Helpers the cpu kernels share (fused_ops.cpp, quant_ops.cpp): a vectorisable exp, scratch memory,
// and the routers' scoring and top-k pick. Header-only so every source of the library inlines them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include <c10/util/Exception.h>

namespace deepinfer_cpu {

// exp(x) for float32 in straight-line code GCC can vectorise (std::exp is a scalar libm call,
// ~20 cycles: the attention softmax and the MoE SiLU were spending most of their time in it).
// Cody-Waite reduction x = n*ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial of e^r
// (truncation error < 2e-9 there, so the result is within ~2 ulp of libm) and 2^n from the exponent
// bits. Inputs below -87.3 (incl. -inf) give 0, above 88 give inf; NaN stays NaN.
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.0f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693145751953125f;  // ln2 split in two: the product above is exact
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  std::memcpy(&bits, &p, 4);
  bits += e - (127 << 23);
  float out;
  std::memcpy(&out, &bits, 4);
  out = x < -87.3f ? 0.0f : out;
  out = x > 88.0f ? std::numeric_limits<float>::infinity() : out;
  return x != x ? x : out;
}

// float32 -> the nearest bfloat16 (ties to even), kept in float32: c10::BFloat16's rounding (NaN kept).
inline float round_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return x;
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}

// std::min / std::max by value: the std ones return a reference, which keeps GCC from vectorising
// the loops they sit in. Same results, NaN included (a NaN first argument is returned).
inline float min_of(float a, float b) { return b < a ? b : a; }
inline float max_of(float a, float b) { return a < b ? b : a; }

inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

// Scratch memory for one parallel_for chunk: on the stack up to N elements (decode sizes: no
// allocation per call), on the heap beyond. Uninitialised.
template <class T, size_t N>
class Scratch {
 public:
  explicit Scratch(int64_t n) : ptr_(stack_) {
    if (n > static_cast<int64_t>(N)) {
      heap_.resize(n);
      ptr_ = heap_.data();
    }
  }
  T* data() { return ptr_; }
  T& operator[](int64_t i) { return ptr_[i]; }

 private:
  T stack_[N];
  std::vector<T> heap_;
  T* ptr_;
};

// Calls go through gemm_rows in groups of this many rows (bounds the scratch; a weight matrix is
// read once per group).
constexpr int64_t kRowGroup = 64;

// sqrt(softplus(z)) of z = x . gate_e, softplus with torch's threshold (z > 20: z)
inline float router_score(float z) { return std::sqrt(z > 20.0f ? z : std::log1p(std::exp(z))); }

inline void normalize_route(float* w, int64_t k, float scaling) {
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) sum += w[j];
  for (int64_t j = 0; j < k; ++j) w[j] = w[j] / (sum + 1e-20f) * scaling;
}

// The routers' pick from a token's raw scores z[e] = x . gate_e (overwritten with router_score(z)):
// the top_k experts by score + bias, best first (ties: the lower expert id), weighted by their
// scores normalised. biased and order are scratch of E elements.
inline void pick_route(float* score, float* biased, int64_t* order, const float* bias, int64_t E, int64_t top_k,
                       float scaling, int64_t* ids_out, float* weights_out) {
  for (int64_t e = 0; e < E; ++e) {
    score[e] = router_score(score[e]);
    biased[e] = score[e] + bias[e];
  }
  std::iota(order, order + E, 0);
  std::partial_sort(order, order + top_k, order + E, [&](int64_t a, int64_t b) {
    return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
  });
  for (int64_t j = 0; j < top_k; ++j) {
    ids_out[j] = order[j];
    weights_out[j] = score[order[j]];
  }
  normalize_route(weights_out, top_k, scaling);
}

// The (token, slot) rows of a routing `ids` [R = T * k] grouped by expert, a counting sort:
// expert e's rows are by_expert[first[e] .. first[e + 1]), in row order, so each expert's weights
// are read once for all its rows. An id out of [0, E) is an error.
struct RowsByExpert {
  std::vector<int64_t> first, by_expert;
  RowsByExpert(const int64_t* ids, int64_t R, int64_t E) : first(E + 1, 0), by_expert(R) {
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(ids[r] >= 0 && ids[r] < E, "expert id ", ids[r], " out of range for ", E, " experts");
      ++first[ids[r] + 1];
    }
    for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t r = 0; r < R; ++r) by_expert[next[ids[r]]++] = r;
  }
};

}  // namespace deepinfer_cpu
