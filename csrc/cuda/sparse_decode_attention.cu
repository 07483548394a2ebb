// DeepSeek-V4 decode attention over a paged KV pool: shared-KV MQA (K == V, one KV head),
// a per-token list of pool rows (-1 = masked), per-head sink logits, fp32 accumulation.
//
// One thread block per (token, group of HG heads). Each chunk of kChunk index rows is gathered
// from the pool once into shared memory (as fp32) and reused by every head of the group: the MQA
// saving, as in FlashMLA. Online softmax over fixed kChunk-row chunks, seeded with the sink
// (max = sink, denominator = 1, no value). Nothing in the reduction order depends on T or on
// which head group a head lands in, so results are batch invariant and deterministic.
//
// Phases per chunk (8 warps):
//   gather : warp w copies rows w, w+8, ... (coalesced, 16-byte loads when aligned).
//   scores : warp w owns heads w, w+8; lane k owns row k of the chunk and runs the D-long dot
//            products serially (16-byte loads of a padded, bank-conflict-free row; q is a
//            broadcast), so a score lands on lane k, where the softmax's warp reductions want it,
//            with no shuffle per dot product.
//   softmax: warp-shuffle max / sum over the 32 rows (fixed butterfly order).
//   p @ kv : thread owns columns d = tid + 256 j for all HG heads; each kv value is read from
//            shared memory once and used HG times.

#include "sparse_decode_attention.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

namespace deepinfer {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 32;  // index rows per online-softmax step: one per lane; same as Triton's
constexpr int kMaxDim = 4 * kThreads;
constexpr int kMaxDevices = 64;

// Row stride of the gathered chunk in shared memory. Lane k reads row k, so rows are padded to
// spread the lanes over the banks: an odd stride in float4 units when D % 4 == 0 (the scores then
// use 16-byte loads), else an odd stride in floats.
__host__ __device__ constexpr int row_stride(int D) {
  return D % 4 == 0 ? ((D / 4) % 2 == 1 ? D : D + 4) : (D | 1);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// 16 loaded bytes -> fp32 in shared memory (bf16 -> fp32 is exact: the bits move up 16 places).
__device__ __forceinline__ void unpack(float, const uint4& raw, float* dst) {
  dst[0] = __uint_as_float(raw.x), dst[1] = __uint_as_float(raw.y);
  dst[2] = __uint_as_float(raw.z), dst[3] = __uint_as_float(raw.w);
}
__device__ __forceinline__ void unpack(__nv_bfloat16, const uint4& raw, float* dst) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[2 * i] = __uint_as_float(w[i] << 16);
    dst[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Copies one pool row (D values) into shared memory as fp32; lanes stride the row.
template <typename KvT>
__device__ __forceinline__ void gather_row(const KvT* __restrict__ row, float* __restrict__ dst,
                                           int D, bool vec_ok, int lane) {
  constexpr int kVec = 16 / sizeof(KvT);
  if (vec_ok) {
    for (int v = lane; v < D / kVec; v += 32) unpack(KvT(), reinterpret_cast<const uint4*>(row)[v], dst + v * kVec);
  } else {
    for (int d = lane; d < D; d += 32) dst[d] = to_float(row[d]);
  }
}

template <typename KvT, int HG, int DPT>
__global__ void __launch_bounds__(kThreads)
sparse_decode_attention_kernel(const float* __restrict__ q, const KvT* __restrict__ kv,
                               const std::int64_t* __restrict__ idx, const float* __restrict__ sinks,
                               float* __restrict__ out, int H, int D, int K, float scale, bool vec_ok) {
  static_assert(HG % kWarps == 0, "each warp owns the same number of heads");
  constexpr int kHeadsPerWarp = HG / kWarps;

  extern __shared__ __align__(16) unsigned char smem[];
  std::int64_t* idx_s = reinterpret_cast<std::int64_t*>(smem);  // [kChunk]
  float* p_s = reinterpret_cast<float*>(idx_s + kChunk);         // [kChunk][HG]
  float* alpha_s = p_s + kChunk * HG;                             // [HG]
  float* denom_s = alpha_s + HG;                                  // [HG]
  float* q_s = denom_s + HG;                                      // [HG][D]
  float* kv_s = q_s + HG * D;                                     // [kChunk][stride]
  const int stride = row_stride(D);

  const int t = blockIdx.x;
  const int h0 = blockIdx.y * HG;
  const int heads = min(HG, H - h0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const float* q_t = q + (static_cast<std::size_t>(t) * H + h0) * D;
  for (int e = tid; e < HG * D; e += kThreads) q_s[e] = e < heads * D ? q_t[e] : 0.f;

  float m[kHeadsPerWarp], denom[kHeadsPerWarp];
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    const int h = warp + kWarps * i;
    m[i] = h < heads ? sinks[h0 + h] : 0.f;
    denom[i] = m[i] == -INFINITY ? 0.f : 1.f;  // exp(sink - max) with max = sink
  }
  float acc[HG][DPT];
#pragma unroll
  for (int h = 0; h < HG; ++h)
#pragma unroll
    for (int j = 0; j < DPT; ++j) acc[h][j] = 0.f;

  const std::int64_t* idx_t = idx + static_cast<std::size_t>(t) * K;
  for (int k0 = 0; k0 < K; k0 += kChunk) {
    if (tid < kChunk) idx_s[tid] = k0 + tid < K ? idx_t[k0 + tid] : -1;
    __syncthreads();

    for (int r = warp; r < kChunk; r += kWarps) {
      const std::int64_t row = idx_s[r];
      float* dst = kv_s + r * stride;
      if (row >= 0) {
        gather_row(kv + row * D, dst, D, vec_ok, lane);
      } else {
        for (int d = lane; d < D; d += 32) dst[d] = 0.f;
      }
    }
    __syncthreads();

    // Each lane: dot products of its row with the warp's heads, d = 0, 1, ..., D-1 in order.
    float dot[kHeadsPerWarp];
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) dot[i] = 0.f;
    const float* kv_row = kv_s + lane * stride;
    if (D % 4 == 0) {
      for (int d4 = 0; d4 < D / 4; ++d4) {
        const float4 x = reinterpret_cast<const float4*>(kv_row)[d4];
#pragma unroll
        for (int i = 0; i < kHeadsPerWarp; ++i) {
          const float4 w = reinterpret_cast<const float4*>(q_s + (warp + kWarps * i) * D)[d4];  // broadcast
          dot[i] = fmaf(w.w, x.w, fmaf(w.z, x.z, fmaf(w.y, x.y, fmaf(w.x, x.x, dot[i]))));
        }
      }
    } else {
      for (int d = 0; d < D; ++d) {
        const float x = kv_row[d];
#pragma unroll
        for (int i = 0; i < kHeadsPerWarp; ++i) dot[i] = fmaf(q_s[(warp + kWarps * i) * D + d], x, dot[i]);
      }
    }
    const bool valid = idx_s[lane] >= 0;
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) {
      const int h = warp + kWarps * i;
      const float s = valid ? dot[i] * scale : -INFINITY;
      const float m_new = fmaxf(m[i], warp_max(s));
      // Guards keep a chunk with no valid row (and a -inf sink) from producing exp(-inf + inf).
      const float alpha = m_new == -INFINITY ? 1.f : expf(m[i] - m_new);
      const float p = s == -INFINITY ? 0.f : expf(s - m_new);
      denom[i] = denom[i] * alpha + warp_sum(p);
      m[i] = m_new;
      p_s[lane * HG + h] = p;
      if (lane == 0) alpha_s[h] = alpha;
    }
    __syncthreads();

#pragma unroll
    for (int h = 0; h < HG; ++h) {
      const float a = alpha_s[h];
#pragma unroll
      for (int j = 0; j < DPT; ++j) acc[h][j] *= a;
    }
    for (int k = 0; k < kChunk; ++k) {
      if (idx_s[k] < 0) continue;  // block-uniform: its p is 0 and its row is zeros
      float p[HG];
#pragma unroll
      for (int h = 0; h < HG; h += 4) {
        const float4 v = reinterpret_cast<const float4*>(p_s + k * HG)[h / 4];
        p[h] = v.x, p[h + 1] = v.y, p[h + 2] = v.z, p[h + 3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < DPT; ++j) {
        const int d = tid + j * kThreads;
        if (d < D) {
          const float x = kv_s[k * stride + d];
#pragma unroll
          for (int h = 0; h < HG; ++h) acc[h][j] = fmaf(p[h], x, acc[h][j]);
        }
      }
    }
    __syncthreads();  // the next chunk overwrites idx_s, kv_s, p_s
  }

  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) denom_s[warp + kWarps * i] = denom[i];
  }
  __syncthreads();
  float* out_t = out + (static_cast<std::size_t>(t) * H + h0) * D;
#pragma unroll
  for (int h = 0; h < HG; ++h) {
    if (h >= heads) break;
    const float dn = denom_s[h];  // divide (IEEE, as the reference), not multiply by a reciprocal
#pragma unroll
    for (int j = 0; j < DPT; ++j) {
      const int d = tid + j * kThreads;
      if (d < D) out_t[h * D + d] = acc[h][j] / dn;
    }
  }
}

template <typename KvT, int HG, int DPT>
std::string launch(const float* q, const KvT* kv, const std::int64_t* idx, const float* sinks, float* out,
                   int T, int H, int D, int K, float scale, cudaStream_t stream) {
  const std::size_t smem = kChunk * sizeof(std::int64_t) +
                           sizeof(float) * (kChunk * HG + 2 * HG + HG * D + kChunk * row_stride(D));
  auto kernel = sparse_decode_attention_kernel<KvT, HG, DPT>;
  // Opt into > 48 KiB of shared memory once per device and size, not on every decode step (and so
  // not inside a CUDA-graph capture after the first call).
  static std::atomic<int> opted_in[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return std::string("sparse_decode_attention: ") + cudaGetErrorString(err);
  if (device >= kMaxDevices || opted_in[device].load(std::memory_order_relaxed) < static_cast<int>(smem)) {
    int smem_max = 0;
    err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return std::string("sparse_decode_attention: ") + cudaGetErrorString(err);
    if (smem > static_cast<std::size_t>(smem_max))
      return "sparse_decode_attention: head_dim " + std::to_string(D) + " needs " + std::to_string(smem) +
             " bytes of shared memory, the device allows " + std::to_string(smem_max);
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return std::string("sparse_decode_attention: ") + cudaGetErrorString(err);
    if (device < kMaxDevices) opted_in[device].store(static_cast<int>(smem), std::memory_order_relaxed);
  }
  const bool vec_ok = D % (16 / sizeof(KvT)) == 0 && reinterpret_cast<std::uintptr_t>(kv) % 16 == 0;
  const dim3 grid(T, (H + HG - 1) / HG);
  kernel<<<grid, kThreads, smem, stream>>>(q, kv, idx, sinks, out, H, D, K, scale, vec_ok);
  err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("sparse_decode_attention: ") + cudaGetErrorString(err);
}

template <typename KvT, int HG>
std::string dispatch_dim(const float* q, const KvT* kv, const std::int64_t* idx, const float* sinks, float* out,
                         int T, int H, int D, int K, float scale, cudaStream_t stream) {
  if (D <= kThreads) return launch<KvT, HG, 1>(q, kv, idx, sinks, out, T, H, D, K, scale, stream);
  if (D <= 2 * kThreads) return launch<KvT, HG, 2>(q, kv, idx, sinks, out, T, H, D, K, scale, stream);
  return launch<KvT, HG, 4>(q, kv, idx, sinks, out, T, H, D, K, scale, stream);
}

template <typename KvT>
std::string dispatch(std::uintptr_t q, std::uintptr_t kv, std::uintptr_t idx, std::uintptr_t sinks,
                     std::uintptr_t out, int T, int H, int D, int K, float scale, cudaStream_t stream) {
  auto* qp = reinterpret_cast<const float*>(q);
  auto* kvp = reinterpret_cast<const KvT*>(kv);
  auto* ip = reinterpret_cast<const std::int64_t*>(idx);
  auto* sp = reinterpret_cast<const float*>(sinks);
  auto* op = reinterpret_cast<float*>(out);
  // Heads per block only sets occupancy: a head's arithmetic is the same in any group.
  if (H <= 8) return dispatch_dim<KvT, 8>(qp, kvp, ip, sp, op, T, H, D, K, scale, stream);
  return dispatch_dim<KvT, 16>(qp, kvp, ip, sp, op, T, H, D, K, scale, stream);
}

}  // namespace

std::string sparse_decode_attention(std::uintptr_t q, std::uintptr_t kv, std::uintptr_t idx,
                                    std::uintptr_t sinks, std::uintptr_t out, std::int64_t T,
                                    std::int64_t H, std::int64_t D, std::int64_t K, float scale,
                                    KvDtype kv_dtype, std::uintptr_t stream) {
  if (T < 0 || H < 0 || D < 0 || K < 0) return "sparse_decode_attention: negative size";
  if (T > 0x7fffffff || H > 65535L * 8 || K > 0x7fffffff)
    return "sparse_decode_attention: too many tokens, heads or indices";
  if (D > kMaxDim) return "sparse_decode_attention: head_dim > " + std::to_string(kMaxDim) + " unsupported";
  if (T == 0 || H == 0 || D == 0) return {};
  if (!q || !kv || !idx || !sinks || !out) return "sparse_decode_attention: null pointer";
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int t = static_cast<int>(T), h = static_cast<int>(H), d = static_cast<int>(D), k = static_cast<int>(K);
  switch (kv_dtype) {
    case KvDtype::kFloat32: return dispatch<float>(q, kv, idx, sinks, out, t, h, d, k, scale, s);
    case KvDtype::kBFloat16: return dispatch<__nv_bfloat16>(q, kv, idx, sinks, out, t, h, d, k, scale, s);
  }
  return "sparse_decode_attention: unknown kv dtype";
}

}  // namespace deepinfer
