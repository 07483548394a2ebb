// Row copies within a cache pool for the cpu backend (loaded with fused_ops.cpp into one library):
// Accelerator.copy_rows, pool[dst[i]] = pool[src[i]], the commit of a step's staged rows into a
// ring. The composite (index_select, then index_copy_) is two generic indexing ops, ~1.5 us each
// on decode-sized index lists, nine times per step of the 4-layer test model: most of it is the
// ops' fixed cost, not the copy. Rows are copied as bytes, so any dtype is taken.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace deepinfer_cpu {

void copy_rows(const at::Tensor& pool, const at::Tensor& src_in, const at::Tensor& dst_in) {
  TORCH_CHECK(pool.dim() == 2 && pool.stride(1) == 1, "copy_rows: pool must be [R, W] with contiguous rows");
  TORCH_CHECK(src_in.scalar_type() == at::kLong && dst_in.scalar_type() == at::kLong, "copy_rows: int64 rows");
  TORCH_CHECK(src_in.numel() == dst_in.numel(), "copy_rows: ", src_in.numel(), " source rows, ", dst_in.numel(),
              " destination rows");
  const at::Tensor src = src_in.contiguous(), dst = dst_in.contiguous();
  const int64_t n = src.numel(), rows = pool.size(0), row_bytes = pool.size(1) * pool.element_size();
  const int64_t stride_bytes = pool.stride(0) * pool.element_size();
  const int64_t *S = src.data_ptr<int64_t>(), *D = dst.data_ptr<int64_t>();
  char* base = static_cast<char*>(pool.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(S[i] >= 0 && S[i] < rows && D[i] >= 0 && D[i] < rows, "copy_rows: row ", S[i], " -> ", D[i],
                " outside the pool's ", rows, " rows");
    std::memcpy(base + D[i] * stride_bytes, base + S[i] * stride_bytes, row_bytes);
  }
}

}  // namespace deepinfer_cpu

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) { m.def("copy_rows(Tensor(a!) pool, Tensor src, Tensor dst) -> ()"); }

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("copy_rows", &deepinfer_cpu::copy_rows); }
