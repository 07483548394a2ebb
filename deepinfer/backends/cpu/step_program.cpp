// The DeepSeek-V4 forward of models/deepseek_v4/model.py as one C++ call, for the cpu backend
// (loaded with fused_ops.cpp into one library; step_program.py builds and calls it).
//
// A decode step of a small model spends as long in Python between the kernels as in them
// (benchmarks/step_profile.py: ~1 ms of a 2 ms step at batch 32): ~70 op calls, each with its
// wrapper, argument checks and dispatch, plus the slicing, copies and index arithmetic around them.
// This program runs the same kernels in the same order on the same arguments, straight from C++,
// the way a CUDA graph replays a captured step: the Python graph stays the definition, and
// tests/unit/test_step_program.py checks that the two give bit-identical logits and cache state.
//
// It holds the weights and the cache pools (both fixed for the engine's life); a step passes
// the StepMeta index tensors. The caller (step_program.py) only hands it steps whose every op
// would take its fused kernel in the Python graph; the one size-dependent choice left, a linear's
// GEMV kernel vs an MKL GEMM, is made here by the same rule.

#include "fused_ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

namespace deepinfer_cpu {
namespace {

enum Kind : int64_t { kSliding = 0, kCsa = 1, kHca = 2 };

// Per step, the StepMeta tensors in this order (step_program.py packs them) ...
enum StepSlot : int64_t { kIds, kWindowRows, kWindowSrc, kWindowDst, kCosMain, kSinMain, kCosComp, kSinComp, kGlobal };
// ... then, per compressed layer kind, its `StepMeta.compressed` info in this order.
enum InfoSlot : int64_t { kTokRows, kOutRows, kEntryCos, kEntrySin, kCandidates, kCommitSrc, kCommitDst, kAttnRows,
                          kInfo };

struct Layer {
  // block entries (mHC + norm) of the attention and the MoE block
  at::Tensor attn_fn, attn_base, attn_scale, attn_norm, ffn_fn, ffn_base, ffn_scale, ffn_norm;
  // attention
  at::Tensor input_proj, q_a_norm, q_b, kv_norm, sinks, o_a, o_b;
  at::Tensor comp_bias, comp_norm, index_bias, index_norm, index_q_b;
  // MoE
  at::Tensor gate, tid2eid, gate_bias, experts_gate_up, experts_down, shared_gate_up, shared_down;
  // cache pools
  at::Tensor kv, comp_ring, index_ring, index_keys;
  int64_t kind = kSliding, info = -1, hash = 0;
  // input_proj column ranges [lo, hi) of the fused projections
  int64_t q_a[2], kv_cols[2], comp[2], index[2], index_weights[2];
  int64_t comp_scratch = 0;  // first scratch row of the compressor rings (max_seqs * ring size)
};

at::Tensor tensor_or_undefined(const c10::Dict<std::string, at::Tensor>& d, const std::string& key) {
  auto it = d.find(key);
  return it == d.end() ? at::Tensor() : it->value();
}

}  // namespace

std::vector<at::Tensor> plan_step(const at::Tensor& starts_in, const at::Tensor& lens_in, const at::Tensor& slots_in,
                                  const at::Tensor& block_table_in, std::vector<at::Tensor> rope_tables,
                                  std::vector<int64_t> geometry, std::vector<int64_t> kinds, int64_t entry_base);

struct StepProgram : torch::CustomClassHolder {
  // globals: embed, lm_head, final norm, hc_head_{fn,base,scale}; params: see step_program.py
  StepProgram(c10::Dict<std::string, at::Tensor> globals, c10::Dict<std::string, double> params)
      : embed_(globals.at("embed")), lm_head_(globals.at("lm_head")), norm_(globals.at("norm")),
        head_fn_(globals.at("hc_head_fn")), head_base_(globals.at("hc_head_base")),
        head_scale_(globals.at("hc_head_scale")) {
    auto count = [&](const char* key) { return static_cast<int64_t>(params.at(key)); };
    hc_mult_ = count("hc_mult"), sinkhorn_iters_ = count("hc_sinkhorn_iters");
    heads_ = count("num_attention_heads"), head_dim_ = count("head_dim"), o_groups_ = count("o_groups");
    index_heads_ = count("index_n_heads"), index_topk_ = count("index_topk"), top_k_ = count("num_experts_per_tok");
    linear_max_tokens_ = count("linear_max_tokens"), kv_scratch_ = count("ring_rows");
    entry_base_ = count("entry_base");
    norm_eps_ = params.at("rms_norm_eps"), hc_eps_ = params.at("hc_eps"), attn_scale_ = params.at("attn_scale");
    index_scale_ = params.at("index_scale"), routed_scaling_ = params.at("routed_scaling_factor");
    swiglu_limit_ = params.at("swiglu_limit");
  }

  void add_layer(c10::Dict<std::string, at::Tensor> t, c10::Dict<std::string, int64_t> n) {
    Layer l;
    l.attn_fn = t.at("attn_fn"), l.attn_base = t.at("attn_base"), l.attn_scale = t.at("attn_scale");
    l.attn_norm = t.at("attn_norm");
    l.ffn_fn = t.at("ffn_fn"), l.ffn_base = t.at("ffn_base"), l.ffn_scale = t.at("ffn_scale");
    l.ffn_norm = t.at("ffn_norm");
    l.input_proj = t.at("input_proj"), l.q_a_norm = t.at("q_a_norm"), l.q_b = t.at("q_b");
    l.kv_norm = t.at("kv_norm"), l.sinks = t.at("sinks"), l.o_a = t.at("o_a"), l.o_b = t.at("o_b");
    l.comp_bias = tensor_or_undefined(t, "comp_bias"), l.comp_norm = tensor_or_undefined(t, "comp_norm");
    l.index_bias = tensor_or_undefined(t, "index_bias"), l.index_norm = tensor_or_undefined(t, "index_norm");
    l.index_q_b = tensor_or_undefined(t, "index_q_b");
    l.gate = t.at("gate"), l.tid2eid = tensor_or_undefined(t, "tid2eid");
    l.gate_bias = tensor_or_undefined(t, "gate_bias");
    l.experts_gate_up = t.at("experts_gate_up"), l.experts_down = t.at("experts_down");
    l.shared_gate_up = t.at("shared_gate_up"), l.shared_down = t.at("shared_down");
    l.kv = t.at("kv"), l.comp_ring = tensor_or_undefined(t, "comp_ring");
    l.index_ring = tensor_or_undefined(t, "index_ring"), l.index_keys = tensor_or_undefined(t, "index_keys");
    l.kind = n.at("kind"), l.info = n.at("info"), l.hash = n.at("hash"), l.comp_scratch = n.at("comp_scratch");
    auto cols = [&](const char* name, int64_t* out) {
      out[0] = n.contains(std::string(name) + "_lo") ? n.at(std::string(name) + "_lo") : 0;
      out[1] = n.contains(std::string(name) + "_hi") ? n.at(std::string(name) + "_hi") : 0;
    };
    cols("q_a", l.q_a), cols("kv", l.kv_cols), cols("comp", l.comp), cols("index", l.index);
    cols("index_weights", l.index_weights);
    layers_.push_back(std::move(l));
  }

  // One step: logits [len(logit_rows), vocab] for the flat token rows `logit_rows`; the cache
  // pools are updated in place, as by DeepseekV4Model.forward.
  at::Tensor forward(std::vector<at::Tensor> step, at::Tensor logit_rows) {
    TORCH_CHECK(static_cast<int64_t>(step.size()) >= kGlobal, "step program: ", step.size(), " step tensors");
    const at::Tensor& ids = step[kIds];
    at::Tensor streams = at::embedding(embed_, ids).unsqueeze(1).expand({-1, hc_mult_, -1}).contiguous();
    at::Tensor h, post, comb, out;
    const int64_t blocks = 2 * static_cast<int64_t>(layers_.size());
    const Entry first = entry(0);
    std::tie(h, post, comb) = hc_pre_norm(streams, first.fn, first.base, first.scale, norm_eps_, hc_eps_,
                                          sinkhorn_iters_, first.norm);
    for (int64_t b = 0; b < blocks; ++b) {
      const Layer& l = layers_[b / 2];
      out = b % 2 == 0 ? attention(l, h, step) : moe(l, h, ids);
      if (b + 1 < blocks) {
        const Entry next = entry(b + 1);
        std::tie(streams, h, post, comb) = hc_post_pre_norm(out, streams, post, comb, next.fn, next.base, next.scale,
                                                            norm_eps_, hc_eps_, sinkhorn_iters_, next.norm);
      } else {
        streams = hc_post(out, streams, post, comb);
      }
    }
    streams = streams.index_select(0, logit_rows);
    h = hc_head(streams, head_fn_, head_base_, head_scale_, norm_eps_, hc_eps_);
    h = rms_norm(h, norm_, norm_eps_);
    return project(h, lm_head_);
  }

  // `steps` greedy decode steps in a row (multi-step scheduling): each sequence feeds `ids` at
  // position `starts`, then its own argmax, steps times; planned by plan_step, sampled as
  // ops.sample does for a greedy row (argmax of the logits). Returns the tokens [steps, B]. The
  // caller grew every sequence's pages for the steps and checked that all its rows are greedy.
  at::Tensor decode(at::Tensor ids, at::Tensor slots, at::Tensor starts, int64_t steps, at::Tensor block_table,
                    std::vector<at::Tensor> rope_tables, std::vector<int64_t> geometry, std::vector<int64_t> kinds) {
    const int64_t B = ids.size(0);
    at::Tensor tokens = at::empty({steps, B}, ids.options());
    const at::Tensor lens = at::ones({B}, starts.options()), rows = at::arange(B, starts.options());
    for (int64_t s = 0; s < steps; ++s) {
      std::vector<at::Tensor> plan =
          plan_step(starts + s, lens, slots, block_table, rope_tables, geometry, kinds, entry_base_);
      std::vector<at::Tensor> step = {ids};  // forward's layout: plan_step's minus seq and positions
      step.insert(step.end(), plan.begin() + 2, plan.end());
      ids = forward(step, rows).argmax(-1);
      tokens[s].copy_(ids);
    }
    return tokens;
  }

 private:
  struct Entry {
    const at::Tensor &fn, &base, &scale, &norm;
  };

  // hc_pre_norm's weights for block b (2i: layer i's attention, 2i+1: its MoE)
  Entry entry(int64_t b) const {
    const Layer& l = layers_[b / 2];
    return b % 2 == 0 ? Entry{l.attn_fn, l.attn_base, l.attn_scale, l.attn_norm}
                      : Entry{l.ffn_fn, l.ffn_base, l.ffn_scale, l.ffn_norm};
  }

  // kernels.linear's rule: the GEMV kernel for a row or two, MKL's GEMM (ops.linear) above
  at::Tensor project(const at::Tensor& x, const at::Tensor& w) const {
    return x.size(0) <= linear_max_tokens_ ? deepinfer_cpu::linear(x, w) : at::linear(x, w);
  }

  static at::Tensor cols(const at::Tensor& fused, const int64_t* range) {
    return fused.narrow(1, range[0], range[1] - range[0]);
  }

  at::Tensor attention(const Layer& l, const at::Tensor& h, const std::vector<at::Tensor>& step) {
    const int64_t T = h.size(0);
    const bool sliding = l.kind == kSliding;
    const at::Tensor& cos = step[sliding ? kCosMain : kCosComp];
    const at::Tensor& sin = step[sliding ? kSinMain : kSinComp];
    at::Tensor fused = project(h, l.input_proj);
    at::Tensor q_lora = rms_norm(cols(fused, l.q_a), l.q_a_norm, norm_eps_);
    at::Tensor q = project(q_lora, l.q_b).view({T, heads_, head_dim_});
    q = rms_norm_rope(q, c10::nullopt, norm_eps_, cos, sin);
    at::Tensor kv = rms_norm_rope(cols(fused, l.kv_cols), l.kv_norm, norm_eps_, cos, sin);
    l.kv.narrow(0, kv_scratch_, T).copy_(kv);

    at::Tensor indices = step[kWindowRows];
    if (!sliding) {
      const at::Tensor* info = &step[kGlobal + kInfo * l.info];
      at::Tensor entries = l.kv.narrow(0, entry_base_, l.kv.size(0) - entry_base_);
      compress(l, cols(fused, l.comp), info, l.comp_bias, l.comp_norm, entries, l.comp_ring);
      if (l.kind == kHca) {
        indices = info[kAttnRows];
      } else {
        compress(l, cols(fused, l.index), info, l.index_bias, l.index_norm, l.index_keys, l.index_ring);
        at::Tensor q_idx = project(q_lora, l.index_q_b).view({T, index_heads_, -1});
        q_idx = rope(q_idx, step[kCosComp], step[kSinComp], false);
        at::Tensor picked = indexer_topk(q_idx, cols(fused, l.index_weights), l.index_keys, info[kCandidates],
                                         index_topk_, index_scale_);
        picked = at::where(picked >= 0, picked + entry_base_, picked);
        indices = at::cat({indices, picked}, 1);
      }
    }
    at::Tensor out = sparse_attention(q, l.kv, indices, l.sinks, attn_scale_);
    out = rope(out, cos, sin, true);
    l.kv.index_copy_(0, step[kWindowDst], l.kv.index_select(0, step[kWindowSrc]));
    out = grouped_linear(out.reshape({T, o_groups_, -1}), l.o_a);
    return project(out.flatten(1), l.o_b);
  }

  // DeepseekV4Model._compress: stage [kv | gate], turn finished windows into entries, commit the ring
  void compress(const Layer& l, const at::Tensor& kv_gate, const at::Tensor* info, const at::Tensor& bias,
                const at::Tensor& norm, const at::Tensor& entries_out, const at::Tensor& ring) {
    ring.narrow(0, l.comp_scratch, kv_gate.size(0)).copy_(kv_gate);
    const at::Tensor& rows = info[kTokRows];
    if (rows.size(0)) {
      at::Tensor entry = compress_entries(ring, rows, bias, l.kind == kCsa, norm, norm_eps_, info[kEntryCos],
                                          info[kEntrySin]);
      entries_out.index_copy_(0, info[kOutRows], entry);
    }
    ring.index_copy_(0, info[kCommitDst], ring.index_select(0, info[kCommitSrc]));
  }

  at::Tensor moe(const Layer& l, const at::Tensor& h, const at::Tensor& ids) {
    at::Tensor weights, expert_ids;
    if (l.hash) {
      expert_ids = l.tid2eid.index_select(0, ids);
      weights = route_hash(h, l.gate, expert_ids, routed_scaling_);
    } else {
      std::tie(weights, expert_ids) = route_topk(h, l.gate, l.gate_bias, top_k_, routed_scaling_);
    }
    at::Tensor routed = moe_experts(h, weights, expert_ids, l.experts_gate_up, l.experts_down, swiglu_limit_);
    return routed + swiglu_mlp(h, l.shared_gate_up, l.shared_down, swiglu_limit_);
  }

  at::Tensor embed_, lm_head_, norm_, head_fn_, head_base_, head_scale_;
  std::vector<Layer> layers_;
  int64_t hc_mult_, sinkhorn_iters_, heads_, head_dim_, o_groups_, index_heads_, index_topk_, top_k_;
  int64_t linear_max_tokens_, kv_scratch_, entry_base_;
  double norm_eps_, hc_eps_, attn_scale_, index_scale_, routed_scaling_, swiglu_limit_;
};


// ---------------------------------------------------------------- planning
// StepMeta's index arithmetic (models/deepseek_v4/step.py, the definition) for a step without a
// prefix-cache replay: the same arrays, computed in one pass instead of ~60 numpy calls (which
// cost a decode step ~0.2 ms). tests/unit/test_step_program.py compares the two on every step.
//
// geometry: max_seqs, window ring rows, sliding window, page_tokens; kinds: (is_csa, rate, ring
// rows) per compressed layer kind; rope_tables: cos, sin of the main and the compress RoPE, each
// [positions, R] and covering every position of the step. Returns seq, positions, window_rows,
// window commit (src, dst), main cos, sin, compress cos, sin, then per kind tok_rows, out_rows,
// entry cos, sin, candidates, commit (src, dst) and attention_rows (empty for CSA).
std::vector<at::Tensor> plan_step(const at::Tensor& starts_in, const at::Tensor& lens_in, const at::Tensor& slots_in,
                                  const at::Tensor& block_table_in, std::vector<at::Tensor> rope_tables,
                                  std::vector<int64_t> geometry, std::vector<int64_t> kinds, int64_t entry_base) {
  TORCH_CHECK(geometry.size() == 4 && kinds.size() % 3 == 0 && rope_tables.size() == 4, "plan_step: bad layout");
  const at::Tensor starts = starts_in.contiguous(), lens = lens_in.contiguous(), slots = slots_in.contiguous();
  const at::Tensor block_table = block_table_in.contiguous();
  for (const at::Tensor* t : {&starts, &lens, &slots, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kLong, "plan_step: index tensors must be int64");
  const int64_t max_seqs = geometry[0], ring = geometry[1], window = geometry[2], page_tokens = geometry[3];
  const int64_t B = starts.size(0), pages_per_seq = block_table.size(1);
  const int64_t *S = starts.data_ptr<int64_t>(), *L = lens.data_ptr<int64_t>(), *SL = slots.data_ptr<int64_t>();
  const int64_t* BT = block_table.data_ptr<int64_t>();
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  auto floor_mod = [](int64_t a, int64_t m) { return ((a % m) + m) % m; };

  std::vector<int64_t> first(B), ends(B);
  int64_t T = 0;
  for (int64_t b = 0; b < B; ++b) first[b] = T, ends[b] = S[b] + L[b], T += L[b];
  at::Tensor seq_t = at::empty({T}, i64), pos_t = at::empty({T}, i64);
  int64_t *seq = seq_t.data_ptr<int64_t>(), *pos = pos_t.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < L[b]; ++j) seq[first[b] + j] = b, pos[first[b] + j] = S[b] + j;

  // StepMeta.rows: the step's own tokens from the scratch after `ring_of` ring rows, older ones
  // from the sequence's ring, negative positions absent
  auto row_of = [&](int64_t p, int64_t b, int64_t ring_of) -> int64_t {
    if (p < 0) return -1;
    if (p >= S[b]) return max_seqs * ring_of + first[b] + (p - S[b]);
    return SL[b] * ring_of + floor_mod(p, ring_of);
  };
  auto commit = [&](int64_t ring_of) -> std::pair<at::Tensor, at::Tensor> {  // StepMeta._commit
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) n += pos[t] >= ends[seq[t]] - ring_of;
    at::Tensor src = at::empty({n}, i64), dst = at::empty({n}, i64);
    int64_t *s = src.data_ptr<int64_t>(), *d = dst.data_ptr<int64_t>(), k = 0;
    for (int64_t t = 0; t < T; ++t)
      if (pos[t] >= ends[seq[t]] - ring_of) s[k] = max_seqs * ring_of + t, d[k++] = SL[seq[t]] * ring_of + floor_mod(pos[t], ring_of);
    return {src, dst};
  };
  auto gather = [](const at::Tensor& table, const at::Tensor& rows) {
    TORCH_CHECK(rows.numel() == 0 || rows.max().item<int64_t>() < table.size(0), "plan_step: RoPE table too short");
    return table.index_select(0, rows);
  };

  at::Tensor window_rows = at::empty({T, window}, i64);
  int64_t* WR = window_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < window; ++j) WR[t * window + j] = row_of(pos[t] - (window - 1) + j, seq[t], ring);
  auto [win_src, win_dst] = commit(ring);
  std::vector<at::Tensor> out = {seq_t, pos_t, window_rows, win_src, win_dst, gather(rope_tables[0], pos_t),
                                 gather(rope_tables[1], pos_t), gather(rope_tables[2], pos_t),
                                 gather(rope_tables[3], pos_t)};

  for (size_t k = 0; k < kinds.size(); k += 3) {  // StepMeta.compressed
    const bool csa = kinds[k];
    const int64_t rate = kinds[k + 1], ring_of = kinds[k + 2], span = csa ? 2 * rate : rate;
    const int64_t per_page = page_tokens / rate;
    auto entry_row = [&](int64_t slot, int64_t e) {
      const int64_t page = e / per_page;
      TORCH_CHECK(page < pages_per_seq, "plan_step: entry ", e, " past the block table");
      return BT[slot * pages_per_seq + page] * per_page + e % per_page;
    };
    int64_t windows = 0;
    for (int64_t b = 0; b < B; ++b) windows += std::max<int64_t>(ends[b] / rate - S[b] / rate, 0);
    at::Tensor tok_rows = at::empty({windows, span}, i64), out_rows = at::empty({windows}, i64);
    at::Tensor entry_pos = at::empty({windows}, i64);
    int64_t *TR = tok_rows.data_ptr<int64_t>(), *OR = out_rows.data_ptr<int64_t>(), *EP = entry_pos.data_ptr<int64_t>();
    int64_t w_at = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t w = S[b] / rate; w < ends[b] / rate; ++w, ++w_at) {
        for (int64_t j = 0; j < span; ++j) TR[w_at * span + j] = row_of((w + 1) * rate - span + j, b, ring_of);
        OR[w_at] = entry_row(SL[b], w);
        EP[w_at] = w * rate;
      }
    int64_t width = 0;
    for (int64_t t = 0; t < T; ++t) width = std::max(width, (pos[t] + 1) / rate);
    at::Tensor cand = at::empty({T, width}, i64);
    int64_t* C = cand.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t visible = (pos[t] + 1) / rate, slot = SL[seq[t]];
      for (int64_t e = 0; e < width; ++e) C[t * width + e] = e < visible ? entry_row(slot, e) : -1;
    }
    auto [src, dst] = commit(ring_of);
    at::Tensor attention_rows = at::empty({0}, i64);
    if (!csa) {  // HCA: window keys + every visible entry
      attention_rows = at::empty({T, window + width}, i64);
      int64_t* A = attention_rows.data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t) {
        std::copy(WR + t * window, WR + (t + 1) * window, A + t * (window + width));
        for (int64_t e = 0; e < width; ++e) {
          const int64_t c = C[t * width + e];
          A[t * (window + width) + window + e] = c >= 0 ? c + entry_base : -1;
        }
      }
    }
    out.insert(out.end(), {tok_rows, out_rows, gather(rope_tables[2], entry_pos), gather(rope_tables[3], entry_pos),
                           cand, src, dst, attention_rows});
  }
  return out;
}

}  // namespace deepinfer_cpu

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.class_<deepinfer_cpu::StepProgram>("StepProgram")
      .def(torch::init<c10::Dict<std::string, at::Tensor>, c10::Dict<std::string, double>>())
      .def("add_layer", &deepinfer_cpu::StepProgram::add_layer)
      .def("forward", &deepinfer_cpu::StepProgram::forward)
      .def("decode", &deepinfer_cpu::StepProgram::decode);
  m.def("plan_step(Tensor starts, Tensor lens, Tensor slots, Tensor block_table, Tensor[] rope_tables, "
        "int[] geometry, int[] kinds, int entry_base) -> Tensor[]", &deepinfer_cpu::plan_step);
}
