"""The cpu backend's step program: DeepseekV4Model.forward as one C++ call.

A decode step of a small model spends about as long in Python around the kernels as in them:
~70 op calls, each through a wrapper and the dispatcher, and the slicing, copies and index
arithmetic between them (`python benchmarks/step_profile.py`). `step_program.cpp` runs the same
fused kernels in the same order from C++, as a CUDA graph replays a captured step on a GPU. The
Python graph in models/deepseek_v4/model.py stays the definition: the program is only used for a
step whose every op would take its fused kernel there, and tests/unit/test_step_program.py checks
that the two give bit-identical logits and cache state.

It holds the model's weights and the cache's pools, both fixed for an engine's life, and takes
the step's StepMeta tensors. Not covered (the model runs its Python graph): context or expert
parallelism, the DSpark drafter's feature capture, steps with more tokens than the kernels take
(prefill chunks go to MKL's GEMMs through the reference ops), ops replaced after the program was
built, and a cache or weights that are not float32. `DEEPINFER_CPU_STEP_PROGRAM=0` turns it off.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from deepinfer.backends.cpu import kernels

# ops the program runs as kernels (and the fused sequences it chains, kernels.FUSED); `embedding`
# is the one plain torch op with a backend entry
_KERNEL_OPS = ("hc_post", "hc_head", "rms_norm", "rope", "linear", "grouped_linear", "sparse_attention",
               "indexer_topk", "route_topk", "route_hash", "moe_experts", "swiglu_mlp")
# DeepSeek-V4's layer kinds (its cache pools' kinds) as the C++ program numbers them. This program is
# V4's forward written again in C++: the step-graph work replaces it with a replay of the recorded
# Python graph, for any model.
SLIDING, CSA = "sliding_attention", "compressed_sparse_attention"
_KIND = {SLIDING: 0, CSA: 1}  # any other compressed kind: HCA (2)
_NO_LIMIT = 1 << 62  # "every size" as a C++ int64 (batch-invariant mode lifts the kernels' limits)


def _limit(op, name: str, default: float) -> float:
    """The size limit an accelerator op applies before leaving its kernel for the reference."""
    return op.keywords.get(name, default) if isinstance(op, functools.partial) else default


class StepProgram:
    """DeepseekV4Model.forward for `cache` as one C++ call; build with `StepProgram.build`."""

    def __init__(self, model, cache, ops: dict):
        cfg, w = model.config, model.w
        self.model, self.cache, self.ops = model, cache, ops
        self.max_tokens = self._max_tokens(cfg, w, ops)
        linear_rows = _limit(ops["linear"], "max_tokens", kernels._LINEAR_MAX_TOKENS)
        params = {
            "hc_mult": cfg.hc_mult, "rms_norm_eps": cfg.rms_norm_eps, "hc_eps": cfg.hc_eps,
            "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "num_attention_heads": cfg.num_attention_heads,
            "head_dim": cfg.head_dim, "attn_scale": cfg.head_dim ** -0.5, "o_groups": cfg.o_groups,
            "index_n_heads": cfg.index_n_heads, "index_topk": cfg.index_topk,
            "index_scale": cfg.index_head_dim ** -0.5, "num_experts_per_tok": cfg.num_experts_per_tok,
            "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
            "linear_max_tokens": min(linear_rows, _NO_LIMIT), "ring_rows": cache.ring_rows,
            "entry_base": cache.entry_base(),
        }
        program = torch.classes.deepinfer_cpu.StepProgram(
            {"embed": w["model.embed_tokens.weight"], "lm_head": w["lm_head.weight"], "norm": w["model.norm.weight"],
             "hc_head_fn": w["model.hc_head.hc_fn"], "hc_head_base": w["model.hc_head.hc_base"],
             "hc_head_scale": w["model.hc_head.hc_scale"]},
            {k: float(v) for k, v in params.items()})
        # one layer of each compressed kind, in order: StepMeta.compressed(layer) is that kind's step info
        first_of_kind = {}
        for layer in cache.layers:
            if layer.rate:
                first_of_kind.setdefault((layer.kind, layer.rate), layer)
        self.info_layers = list(first_of_kind.values())
        self._info_index = {key: k for k, key in enumerate(first_of_kind)}
        for i, layer in enumerate(cache.layers):
            tensors, ints = self._layer(model, i, layer)
            program.add_layer(tensors, ints)
        self.program = program
        self._absent = torch.empty(0, dtype=torch.int64)
        # the planner's inputs that stay: the block table (a view: page assignments show through)
        self._block_table = torch.from_numpy(cache.block_table)
        self._geometry = [cache.max_seqs, cache.ring, cfg.sliding_window, cache.page_tokens]
        self._kinds = [v for layer in self.info_layers for v in (int(layer.kind == CSA), layer.rate,
                                                                 layer.comp_ring_size)]
        self._tables = None

    @classmethod
    def build(cls, model, cache, accel) -> "StepProgram | None":
        """The program for `model` on `cache`, or None where it does not apply (see the module doc)."""
        ops = {name: getattr(accel, name) for name in _KERNEL_OPS + ("embedding",)}
        kernel_ops = all(getattr(fn, "func", fn) is getattr(kernels, name) for name, fn in ops.items()
                         if name != "embedding") and all(accel.kernel(name) is fn for name, fn in kernels.FUSED.items())
        floats = [t for t in model.w.values() if t.is_floating_point()]
        if not kernel_ops or cache.dtype != torch.float32 or any(t.dtype != torch.float32 for t in floats):
            return None
        return cls(model, cache, ops)

    def plan(self, meta) -> bool:
        """StepMeta's planner: fill `meta`'s index arrays (the numpy ones of StepMeta._plan, same
        values) in one C++ call. False (meta plans in numpy) past the longest RoPE table."""
        tables = self._rope_tables(int(meta.ends.max()) if len(meta.ends) else 0)
        if tables is None:
            return False
        inp = meta.inp
        out = torch.ops.deepinfer_cpu.plan_step(inp.starts, inp.lens, inp.slots, self._block_table, tables,
                                                self._geometry, self._kinds, self.cache.entry_base())
        seq, positions, window_rows, window_src, window_dst, cos, sin, comp_cos, comp_sin = out[:9]
        meta.seq, meta.positions = seq.numpy(), positions.numpy()
        meta.window_rows, meta.window_commit = window_rows, (window_src, window_dst)
        meta.rope = {"main": (cos, sin), "compress": (comp_cos, comp_sin)}
        for k, layer in enumerate(self.info_layers):
            rows, out_rows, entry_cos, entry_sin, candidates, src, dst, attention = out[9 + 8 * k:17 + 8 * k]
            info = dict(tok_rows=rows, out_rows=out_rows, cos_sin=(entry_cos, entry_sin), candidates=candidates,
                        commit=(src, dst))
            if layer.kind != CSA:
                info["attention_rows"] = attention
            meta._by_rate[(layer.kind, layer.rate)] = info
        return True

    def _rope_tables(self, need: int) -> list[torch.Tensor] | None:
        """cos, sin of the main and the compress RoPE covering positions < need (RopeConfig.table's
        shared arrays), or None past the longest table kept."""
        cfg = self.model.config
        main, comp = cfg.rope_main.table(need), cfg.rope_compress.table(need)
        if main is None or comp is None:
            return None
        if self._tables is None or self._tables[0] is not main[0] or self._tables[2] is not comp[0]:
            self._tables = (*main, *comp)
            self._table_tensors = [torch.from_numpy(t) for t in self._tables]
        return self._table_tensors

    def runs(self, meta) -> bool:
        """Whether this step can run as the program (else the model runs its Python graph)."""
        return 0 < meta.num_tokens <= self.max_tokens and isinstance(meta.own, slice) and self.ops_unchanged()

    def ops_unchanged(self) -> bool:
        """The accelerator still has the ops the program was built from (a profiler or a test
        double may have replaced one since: the graph then runs, so the replacement is called)."""
        return all(getattr(self.model.accel, name) is fn for name, fn in self.ops.items())

    def decode(self, ids: list[int], slots: list[int], starts: list[int], steps: int) -> torch.Tensor | None:
        """`steps` greedy decode steps of a batch in one call (multi-step scheduling): sequence b
        feeds ids[b] at position starts[b], then each step its own argmax. Returns the sampled
        tokens [steps, B], or None where this cannot run (too many sequences for the kernels,
        positions past the RoPE tables, a replaced op). The caller grew the pages and checked
        that every row samples greedily."""
        tables = self._rope_tables(max(starts) + steps)
        if not 0 < len(ids) <= self.max_tokens or tables is None or not self.ops_unchanged():
            return None
        as_tensor = lambda xs: torch.from_numpy(np.array(xs, dtype=np.int64))  # noqa: E731
        with torch.inference_mode():
            return self.program.decode(as_tensor(ids), as_tensor(slots), as_tensor(starts), steps, self._block_table,
                                       tables, self._geometry, self._kinds)

    def __call__(self, meta, logit_rows: torch.Tensor) -> torch.Tensor:
        step = [meta.ids, meta.window_rows, *meta.window_commit, *meta.rope["main"], *meta.rope["compress"]]
        for layer in self.info_layers:
            info = meta.compressed(layer)
            step += [info["tok_rows"], info["out_rows"], *info["cos_sin"], info["candidates"], *info["commit"],
                     info.get("attention_rows", self._absent)]
        return self.program.forward(step, logit_rows)

    # ------------------------------------------------------------ construction
    @staticmethod
    def _max_tokens(cfg, w, ops) -> int:
        """Most tokens a step may have for every size-limited op to take its kernel (kernels.py's
        rules, per layer; in batch-invariant mode the limits are lifted)."""
        limits = [_NO_LIMIT]
        for i in range(cfg.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            gate_up, down = w[m + "experts.gate_up_proj"], w[m + "experts.down_proj"]
            per_token = cfg.num_experts_per_tok * (gate_up[0].numel() + down[0].numel())
            shared = w[m + "shared_experts.gate_up_proj.weight"].numel() + w[m + "shared_experts.down_proj.weight"].numel()
            router = "route_hash" if cfg.mlp_layer_types[i] == "hash_moe" else "route_topk"
            for op, key, budget, per in (
                    ("grouped_linear", "max_macs", kernels._GEMV_MAX_MACS, w[a + "o_a_proj.weight"].numel()),
                    ("swiglu_mlp", "max_macs", kernels._GEMV_MAX_MACS, shared),
                    (router, "max_macs", kernels._ROUTER_MAX_MACS, w[m + "gate.weight"].numel()),
                    ("moe_experts", "max_macs_per_expert", kernels._MOE_MAX_MACS_PER_EXPERT * gate_up.shape[0],
                     per_token)):
                limit = _limit(ops[op], key, budget)
                limits.append(_NO_LIMIT if limit == float("inf") else int(limit // per))
        return min(limits)

    def _layer(self, model, i: int, layer) -> tuple[dict, dict]:
        """Layer i's weights, cache pools and layout for StepProgram::add_layer."""
        cfg, w = model.config, model.w
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        t = {"attn_fn": w[p + "attn_hc.fn"], "attn_base": w[p + "attn_hc.base"], "attn_scale": w[p + "attn_hc.scale"],
             "attn_norm": w[p + "input_layernorm.weight"], "ffn_fn": w[p + "ffn_hc.fn"], "ffn_base": w[p + "ffn_hc.base"],
             "ffn_scale": w[p + "ffn_hc.scale"], "ffn_norm": w[p + "post_attention_layernorm.weight"],
             "input_proj": w[a + "input_proj.weight"], "q_a_norm": w[a + "q_a_norm.weight"],
             "q_b": w[a + "q_b_proj.weight"], "kv_norm": w[a + "kv_norm.weight"], "sinks": w[a + "sinks"],
             "o_a": w[a + "o_a_proj.weight"], "o_b": w[a + "o_b_proj.weight"], "gate": w[m + "gate.weight"],
             "experts_gate_up": w[m + "experts.gate_up_proj"], "experts_down": w[m + "experts.down_proj"],
             "shared_gate_up": w[m + "shared_experts.gate_up_proj.weight"],
             "shared_down": w[m + "shared_experts.down_proj.weight"], "kv": layer.kv}
        hash_moe = cfg.mlp_layer_types[i] == "hash_moe"
        if hash_moe:
            t["tid2eid"] = w[m + "gate.tid2eid"]
        else:
            t["gate_bias"] = w[m + "gate.e_score_correction_bias"]
        splits = model.input_proj_splits[i]
        ints = {"kind": _KIND.get(layer.kind, 2), "hash": int(hash_moe), "info": -1, "comp_scratch": 0}

        def cols(name: str, first: str, last: str | None = None) -> None:
            ints[name + "_lo"], ints[name + "_hi"] = splits[first][0], splits[last or first][1]

        cols("q_a", "q_a_proj")
        cols("kv", "kv_proj")
        if layer.rate:
            c = a + "compressor."
            t.update(comp_bias=w[c + "position_bias"], comp_norm=w[c + "kv_norm.weight"], comp_ring=layer.comp_ring)
            cols("comp", "compressor.kv_proj", "compressor.gate_proj")
            ints["comp_scratch"] = self.cache.max_seqs * layer.comp_ring_size
            ints["info"] = self._info_index[(layer.kind, layer.rate)]
        if layer.kind == CSA:
            x = a + "compressor.indexer."
            t.update(index_bias=w[x + "position_bias"], index_norm=w[x + "kv_norm.weight"],
                     index_q_b=w[x + "q_b_proj.weight"], index_ring=layer.index_ring, index_keys=layer.index_keys)
            cols("index", "compressor.indexer.kv_proj", "compressor.indexer.gate_proj")
            cols("index_weights", "compressor.indexer.scorer.weights_proj")
        return t, ints
