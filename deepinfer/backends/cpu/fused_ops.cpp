// Fused CPU kernels for the cpu backend's hot path (loaded by kernels.py beside it, compiled on first use).
//
// A decode step of a small model is bound by per-op overhead, not arithmetic: the mHC mix alone
// (RMSNorm, a [T, n*D] x [n*D, (2+n)*n] product, sigmoids, a softmax and 20 Sinkhorn iterations)
// is ~80 torch ops per call, 8 calls per 4-layer step. Each kernel here does one op of
// backends/base.py in one pass, with the same semantics as the reference in
// backends/cpu/ops.py (tests/unit/test_cpu_kernels.py bounds the difference).
//
// Every kernel works token by token with a fixed summation order inside a token, so a token's
// result never depends on which other tokens share the batch (batch-invariant by construction).

#include <ATen/ATen.h>
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

namespace {

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

inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; ++k) acc += a[k] * b[k];
  return acc;
}

// scores[m] (+)= sum_d q[d] * kt[d * M + m] for one query row against M gathered keys stored
// transposed ([D, M]): vectorised over the keys, with no horizontal reduction per key.
// __restrict matters: without it GCC keeps the accumulator in memory (~6x slower here).
inline void query_keys(const float* __restrict q, const float* __restrict kt, float* __restrict out, int64_t D,
                       int64_t M) {
  for (int64_t m = 0; m < M; ++m) out[m] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float qd = q[d];
    const float* __restrict kd = kt + d * M;
    for (int64_t m = 0; m < M; ++m) out[m] += qd * kd[m];
  }
}

// out[d] += p * row[d]
inline void axpy(float p, const float* __restrict row, float* __restrict out, int64_t D) {
  for (int64_t d = 0; d < D; ++d) out[d] += p * row[d];
}

// The rows of a [rows, D] pool named by idx[0..n) (-1 = absent), gathered transposed into kt [D, valid]
// for query_keys; returns how many were present and writes their positions in idx to `present`.
int64_t gather_transposed(const int64_t* idx, int64_t n, const float* pool, int64_t rows, int64_t stride, int64_t D,
                          const char* what, int64_t* present, float* kt) {
  int64_t valid = 0;
  for (int64_t m = 0; m < n; ++m) {
    if (idx[m] < 0) continue;
    TORCH_CHECK(idx[m] < rows, what, " ", idx[m], " out of range for ", rows, " rows");
    present[valid++] = m;
  }
  for (int64_t j = 0; j < valid; ++j) {
    const float* row = pool + idx[present[j]] * stride;
    for (int64_t d = 0; d < D; ++d) kt[d * valid + j] = row[d];
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
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams_in, const at::Tensor& fn_in,
                                                       const at::Tensor& base_in, const at::Tensor& scale_in,
                                                       double norm_eps, double hc_eps, int64_t sinkhorn_iters) {
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
  at::Tensor collapsed = at::empty({T, D}, opts), post = at::empty({T, n}, opts), comb = at::empty({T, n, n}, opts);
  const float *S = streams.data_ptr<float>(), *F = fn.data_ptr<float>(), *B = base.data_ptr<float>();
  const float s0 = scale.data_ptr<float>()[0], s1 = scale.data_ptr<float>()[1], s2 = scale.data_ptr<float>()[2];
  const float neps = static_cast<float>(norm_eps), heps = static_cast<float>(hc_eps);
  float *C = collapsed.data_ptr<float>(), *P = post.data_ptr<float>(), *M = comb.data_ptr<float>();
  // Tokens go in blocks of kBlock: the per-token parts (mixes, gates, softmax) run token by token,
  // the Sinkhorn iterations (n*n divisions per half-step) run vectorised across the block.
  constexpr int64_t kBlock = 16;
  const int64_t nn = n * n;
  at::parallel_for(0, (T + kBlock - 1) / kBlock, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<float> mix(mixes), pre(n * kBlock), cb(nn * kBlock), sums(n * kBlock);
    for (int64_t blk = block_begin; blk < block_end; ++blk) {
      const int64_t t0 = blk * kBlock, bt = std::min(kBlock, T - t0);
      for (int64_t b = 0; b < bt; ++b) {
        const int64_t t = t0 + b;
        const float* x = S + t * nd;
        const float r = 1.0f / std::sqrt(dot(x, x, nd) / static_cast<float>(nd) + neps);
        for (int64_t m = 0; m < mixes; ++m) mix[m] = dot(x, F + m * nd, nd) * r;
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
          for (int64_t j = 0; j < n; ++j) cb[(i * n + j) * kBlock + b] = row[j] / sum + heps;
        }
      }
      // cb[(i * n + j) * kBlock + b]: element (i, j) of token b's matrix
      auto normalize = [&](bool columns) {
        float* __restrict sm = sums.data();
        float* __restrict c = cb.data();
        std::fill(sums.begin(), sums.end(), 0.0f);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) {
            float* __restrict acc = sm + (columns ? j : i) * kBlock;
            const float* __restrict e = c + (i * n + j) * kBlock;
            for (int64_t b = 0; b < kBlock; ++b) acc[b] += e[b];
          }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) {
            const float* __restrict acc = sm + (columns ? j : i) * kBlock;
            float* __restrict e = c + (i * n + j) * kBlock;
            for (int64_t b = 0; b < kBlock; ++b) e[b] = e[b] / (acc[b] + heps);
          }
      };
      normalize(true);
      for (int64_t it = 1; it < sinkhorn_iters; ++it) {  // Sinkhorn: rows, then columns
        normalize(false);
        normalize(true);
      }
      for (int64_t b = 0; b < bt; ++b) {
        const int64_t t = t0 + b;
        for (int64_t e = 0; e < nn; ++e) M[t * nn + e] = cb[e * kBlock + b];
        const float* x = S + t * nd;
        float* out = C + t * D;
        std::fill(out, out + D, 0.0f);
        for (int64_t i = 0; i < n; ++i) axpy(pre[b * n + i], x + i * D, out, D);
      }
    }
  });
  return {collapsed, post, comb};
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
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t t = begin; t < end; ++t) {
      const float *x = X + t * D, *s = S + t * n * D, *c = M + t * n * n;
      for (int64_t j = 0; j < n; ++j) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t i = 0; i < n; ++i) {
          const float w = c[i * n + j], *si = s + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += w * si[d];
        }
        const float p = P[t * n + j];
        float* o = O + (t * n + j) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = p * x[d] + acc[d];
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
      const float scale = 1.0f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + e);
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
        for (int64_t k = 0; k < R; ++k) {
          const float x0 = xr[nope + 2 * k], x1 = xr[nope + 2 * k + 1], sk = sign * s[k];
          o[nope + 2 * k] = x0 * c[k] - x1 * sk;
          o[nope + 2 * k + 1] = x1 * c[k] + x0 * sk;
        }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------- attention and indexer
// q [T, H, Dh], kv [rows, Dh] (a pool), indices [T, K] rows of kv (-1 = absent), sinks [H].
at::Tensor sparse_attention(const at::Tensor& q_in, const at::Tensor& kv, const at::Tensor& indices_in,
                            const at::Tensor& sinks_in, double scale) {
  check_float(q_in, "q");
  check_float(kv, "kv");
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1, "kv must be [rows, Dh] with contiguous rows");
  TORCH_CHECK(indices_in.scalar_type() == at::kLong, "indices must be int64");
  const at::Tensor q = q_in.contiguous(), indices = indices_in.contiguous(), sinks = sinks_in.contiguous().to(at::kFloat);
  const int64_t T = q.size(0), H = q.size(1), Dh = q.size(2), K = indices.size(1), rows = kv.size(0),
                kv_stride = kv.stride(0);
  TORCH_CHECK(kv.size(1) == Dh && indices.size(0) == T, "shape mismatch between q, kv and indices");
  at::Tensor out = at::empty({T, H, Dh}, q.options());
  const float *Q = q.data_ptr<float>(), *KV = kv.data_ptr<float>(), *SK = sinks.data_ptr<float>();
  const int64_t* I = indices.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> keys(K);
    std::vector<int64_t> present(K);
    std::vector<float> kt(Dh * K), logits(H * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* idx = I + t * K;
      const int64_t valid =
          gather_transposed(idx, K, KV, rows, kv_stride, Dh, "attention index", present.data(), kt.data());
      for (int64_t k = 0; k < valid; ++k) keys[k] = KV + idx[present[k]] * kv_stride;
      for (int64_t h = 0; h < H; ++h) {
        float* l = logits.data() + h * K;
        query_keys(Q + (t * H + h) * Dh, kt.data(), l, Dh, valid);
        float mx = SK[h];
        for (int64_t k = 0; k < valid; ++k) mx = std::max(mx, l[k] *= sc);
        float denom = fast_exp(SK[h] - mx);  // the sink: a logit with no value
        for (int64_t k = 0; k < valid; ++k) l[k] = fast_exp(l[k] - mx);
        for (int64_t k = 0; k < valid; ++k) denom += l[k];
        float* o = O + (t * H + h) * Dh;
        std::fill(o, o + Dh, 0.0f);
        for (int64_t k = 0; k < valid; ++k) axpy(l[k] / denom, keys[k], o, Dh);
      }
    }
  });
  return out;
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
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(M), kt(Di * M), acc(M);
    std::vector<int64_t> order(M);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid =
          gather_transposed(C + t * M, M, KS, rows, key_stride, Di, "indexer candidate", order.data(), kt.data());
      std::fill(score.begin(), score.end(), 0.0f);
      for (int64_t h = 0; h < H; ++h) {
        query_keys(Q + (t * H + h) * Di, kt.data(), acc.data(), Di, valid);
        const float wh = W[t * H + h];
        for (int64_t j = 0; j < valid; ++j) score[j] += std::max(acc[j], 0.0f) * sc * wh;
      }
      // order[j] is the candidate column of score[j]
      const int64_t take = std::min(k, valid);
      std::vector<int64_t> rank(valid);
      std::iota(rank.begin(), rank.end(), 0);
      // best first; equal scores keep candidate order (the reference's stable sort)
      auto better = [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
      std::partial_sort(rank.begin(), rank.begin() + take, rank.end(), better);
      for (int64_t j = 0; j < take; ++j) O[t * k + j] = C[t * M + order[rank[j]]];
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
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t n = 0; n < N; ++n) O[(t * G + g) * N + n] = dot(X + (t * G + g) * K, W + (g * N + n) * K, K);
  });
  return out;
}

// sqrt(softplus(x . gate_e)), softplus with torch's threshold (x > 20: x)
inline float router_score(const float* x, const float* gate_row, int64_t D) {
  const float z = dot(x, gate_row, D);
  return std::sqrt(z > 20.0f ? z : std::log1p(std::exp(z)));
}

inline void normalize_route(float* w, int64_t k, float scaling) {
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) sum += w[j];
  for (int64_t j = 0; j < k; ++j) w[j] = w[j] / (sum + 1e-20f) * scaling;
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
    std::vector<float> score(E), biased(E);
    std::vector<int64_t> order(E);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        score[e] = router_score(X + t * D, Gt + e * D, D);
        biased[e] = score[e] + Bs[e];
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
        return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
      });
      for (int64_t j = 0; j < top_k; ++j) {
        Io[t * top_k + j] = order[j];
        Wo[t * top_k + j] = score[order[j]];
      }
      normalize_route(Wo + t * top_k, top_k, sc);
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
        Wo[t * k + j] = router_score(X + t * D, Gt + e * D, D);
      }
      normalize_route(Wo + t * k, k, static_cast<float>(scaling));
    }
  });
  return weights;
}

// ---------------------------------------------------------------- MoE (small batches)
// x [T, D], weights/ids [T, k], gate_up [E, 2I, D], down [E, D, I]: sum_j weights[t, j] *
// expert_{ids[t, j]}(x[t]), the expert's SwiGLU MLP with clamped inputs. Row by row (GEMVs):
// meant for decode-sized batches, where the per-expert GEMMs of the reference are launch-bound;
// kernels.py sends large batches to the reference.
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
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> hidden(I), row(D);
    for (int64_t t = begin; t < end; ++t) {
      const float* xt = X + t * D;
      float* o = O + t * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < k; ++j) {  // fixed order over the token's experts, as the reference
        const int64_t e = ID[t * k + j];
        TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of range for ", E, " experts");
        const float* gu = GU + e * I2 * D;
        for (int64_t i = 0; i < I; ++i) {
          const float g = std::min(dot(xt, gu + i * D, D), lim);
          const float u = std::clamp(dot(xt, gu + (I + i) * D, D), -lim, lim);
          hidden[i] = g / (1.0f + fast_exp(-g)) * u;
        }
        const float* dn = DN + e * D * I;
        for (int64_t d = 0; d < D; ++d) row[d] = dot(hidden.data(), dn + d * I, I);
        axpy(Wt[t * k + j], row.data(), o, D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("hc_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, float norm_eps, float hc_eps, "
        "int sinkhorn_iters) -> (Tensor, Tensor, Tensor)");
  m.def("hc_post(Tensor block_out, Tensor streams, Tensor post, Tensor comb) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("sparse_attention(Tensor q, Tensor kv, Tensor indices, Tensor sinks, float scale) -> Tensor");
  m.def("grouped_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("route_topk(Tensor x, Tensor gate, Tensor bias, int top_k, float scaling) -> (Tensor, Tensor)");
  m.def("route_hash(Tensor x, Tensor gate, Tensor ids, float scaling) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, float limit) -> Tensor");
  m.def("indexer_topk(Tensor q, Tensor weights, Tensor keys, Tensor candidates, int topk, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("hc_pre", &hc_pre);
  m.impl("hc_post", &hc_post);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("sparse_attention", &sparse_attention);
  m.impl("indexer_topk", &indexer_topk);
  m.impl("moe_experts", &moe_experts);
  m.impl("grouped_linear", &grouped_linear);
  m.impl("route_topk", &route_topk);
  m.impl("route_hash", &route_hash);
}
