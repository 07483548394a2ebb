// The fused kernels of fused_ops.cpp, declared for any other source of the same library that would
// chain them without a trip through Python or the dispatcher. Semantics: backends/base.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace deepinfer_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams, const at::Tensor& fn,
                                                       const at::Tensor& base, const at::Tensor& scale,
                                                       double norm_eps, double hc_eps, int64_t sinkhorn_iters);
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_mixes(const at::Tensor& streams, const at::Tensor& fn,
                                                         const at::Tensor& base, const at::Tensor& scale,
                                                         double norm_eps, double hc_eps, int64_t sinkhorn_iters);
at::Tensor hc_collapse(const at::Tensor& streams, const at::Tensor& weights);
at::Tensor hc_head(const at::Tensor& streams, const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale,
                   double norm_eps, double hc_eps);
at::Tensor hc_post(const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post,
                   const at::Tensor& comb);
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse);
at::Tensor sparse_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                            const at::Tensor& sinks, double scale);
at::Tensor indexer_topk(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& keys,
                        const at::Tensor& candidates, int64_t topk, double scale);
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight);
void linear_block(const float* x, int64_t T, int64_t K, const float* w, int64_t rows, float* out, int64_t ld_out);
std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& bias,
                                              int64_t top_k, double scaling);
at::Tensor route_hash(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& ids, double scaling);
std::tuple<at::Tensor, at::Tensor> route_grouped_topk(const at::Tensor& x, const at::Tensor& gate,
                                                      const at::Tensor& bias, int64_t top_k, int64_t n_group,
                                                      int64_t topk_group, bool normalize, double scaling);
at::Tensor swiglu_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, double limit);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const at::Tensor& gate_up, const at::Tensor& down, double limit);
at::Tensor compress_entries(const at::Tensor& ring, const at::Tensor& rows, const at::Tensor& bias, bool overlap,
                            const at::Tensor& norm_weight, double eps, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_norm(const at::Tensor& streams, const at::Tensor& fn,
                                                            const at::Tensor& base, const at::Tensor& scale,
                                                            double norm_eps, double hc_eps, int64_t sinkhorn_iters,
                                                            const at::Tensor& norm_weight);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre_norm(
    const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post, const at::Tensor& comb,
    const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale, double norm_eps, double hc_eps,
    int64_t sinkhorn_iters, const at::Tensor& norm_weight);
at::Tensor rms_norm_rope(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                         const at::Tensor& cos, const at::Tensor& sin);

}  // namespace deepinfer_cpu
