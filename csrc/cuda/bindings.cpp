// pybind11 module `deepinfer_cuda`: integer pointers in, RuntimeError on failure. No torch.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "sparse_decode_attention.h"

namespace py = pybind11;

static deepinfer::KvDtype parse_kv_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return deepinfer::KvDtype::kFloat32;
  if (name == "bfloat16" || name == "bf16") return deepinfer::KvDtype::kBFloat16;
  throw std::invalid_argument("sparse_decode_attention: kv_dtype must be float32 or bfloat16, got " + name);
}

PYBIND11_MODULE(deepinfer_cuda, m) {
  m.doc() = "deepinfer CUDA kernels (sm_90a, sm_100a); torch-free: device pointers as integers";
  m.def(
      "sparse_decode_attention",
      [](std::uintptr_t q, std::uintptr_t kv, std::uintptr_t idx, std::uintptr_t sinks, std::uintptr_t out,
         std::int64_t T, std::int64_t H, std::int64_t D, std::int64_t K, float scale, const std::string& kv_dtype,
         std::uintptr_t stream) {
        const auto dtype = parse_kv_dtype(kv_dtype);
        std::string err;
        {
          py::gil_scoped_release release;
          err = deepinfer::sparse_decode_attention(q, kv, idx, sinks, out, T, H, D, K, scale, dtype, stream);
        }
        if (!err.empty()) throw std::runtime_error(err);
      },
      py::arg("q_ptr"), py::arg("kv_ptr"), py::arg("idx_ptr"), py::arg("sinks_ptr"), py::arg("out_ptr"),
      py::arg("T"), py::arg("H"), py::arg("D"), py::arg("K"), py::arg("scale"), py::arg("kv_dtype"),
      py::arg("stream"),
      "Decode attention of DeepSeek-V4 (Accelerator.sparse_attention): q [T,H,D] fp32, kv [P,D] fp32|bf16, "
      "idx [T,K] int64, sinks [H] fp32, out [T,H,D] fp32; contiguous device memory; launched on `stream`.");
}
