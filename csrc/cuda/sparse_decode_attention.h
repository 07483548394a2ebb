// Torch-free launcher for DeepSeek-V4 sparse decode attention (shared-KV MQA with sinks).
#pragma once

#include <cstdint>
#include <string>

namespace deepinfer {

enum class KvDtype { kFloat32, kBFloat16 };

// Semantics of Accelerator.sparse_attention (deepinfer/backends/base.py):
//   q [T, H, D] fp32, kv [P, D] (fp32 or bf16), idx [T, K] int64 rows of kv (-1 = masked),
//   sinks [H] fp32, out [T, H, D] fp32 (written), all contiguous device memory.
//   out[t, h] = sum_k p[t, h, k] kv[idx[t, k]], p = softmax over (q.kv * scale, sink).
// Pointers and the cudaStream_t are passed as integers. Returns "" on success, else the error.
std::string sparse_decode_attention(std::uintptr_t q, std::uintptr_t kv, std::uintptr_t idx,
                                    std::uintptr_t sinks, std::uintptr_t out, std::int64_t T,
                                    std::int64_t H, std::int64_t D, std::int64_t K, float scale,
                                    KvDtype kv_dtype, std::uintptr_t stream);

}  // namespace deepinfer
