"""DeepSeek-V3 checkpoints as users have them, loaded through LLM: the hub's layout with FP8
128x128 weights (`weight_scale_inv`), bf16 tensors, a float32 routing bias and the
multi-token-prediction layer after the last one (skipped), and DeepSeek's own inference layout
(convert.py's names, `.scale`, a ModelArgs config.json that names no architecture). Each must give
the prompt logprobs and greedy tokens of transformers on what its files dequantize to (the oracle
model the writer returns)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.backends.quant import FP8, QuantizedWeight
from tiny_models import hf_greedy
from tiny_models_v3 import make_hf_model, save_hf_layout, save_upstream_layout
from v3_oracle import full_logits, prompts, single_thread

# dims over one 128x128 FP8 tile and not multiples of it: several and partial tiles per weight
WIDE = dict(hidden_size=160, q_lora_rank=136, kv_lora_rank=144, intermediate_size=200, moe_intermediate_size=136)
LAYOUTS = {
    "hub fp8 + mtp": lambda hf, path: save_hf_layout(hf, path, fp8=True, plain_dtype=torch.bfloat16, mtp=True),
    "hub bf16": lambda hf, path: save_hf_layout(hf, path, plain_dtype=torch.bfloat16),
    "upstream fp8": lambda hf, path: save_upstream_layout(hf, path, fp8=True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["v3_yarn_groups", "lite_no_qlora"])
def test_checkpoint_layouts_give_transformers_outputs(name, layout, tmp_path):
    hf, _ = make_hf_model(name, seed=7, **WIDE, **({"norm_topk_prob": True} if layout.startswith("upstream") else {}))
    oracle = LAYOUTS[layout](hf, tmp_path)
    _assert_transformers_outputs(LLM(tmp_path, max_num_seqs=4, max_num_batched_tokens=128, num_cache_pages=8),
                                 oracle, layout)


def _assert_transformers_outputs(llm, oracle, what: str) -> None:
    ps = [p.tolist() for p in prompts(oracle.config.vocab_size, [150, 20], seed=8)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, prompt_logprobs=1)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    with single_thread():
        for prompt, out in zip(ps, outs):
            ref = torch.log_softmax(full_logits(oracle, torch.tensor(prompt)), -1)
            gap = max(abs(out.prompt_logprobs[i][prompt[i]] - float(ref[i - 1, prompt[i]]))
                      for i in range(1, len(prompt)))
            assert gap < 1e-4, f"{what}: prompt logprobs off by {gap:.2e}"
            assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 8)


@pytest.mark.parametrize("name", ["v3_yarn_groups", "v2_yarn_rotate_half"])
def test_fp8_checkpoint_stays_stored(name, tmp_path):
    """The hub's FP8 layout is held as stored: every FP8 Linear weight a QuantizedWeight with its
    float32 128x128 scales (q_a / q_proj and kv_a fused into one, a rotate_half checkpoint's rope
    rows reordered without widening), the routed, shared and dense MLP weights too, bf16 tensors
    bf16; only kv_b_proj's absorbed forms are float32. Its outputs are still transformers' on what
    the files dequantize to (here also with rotate_half rope)."""
    hf, _ = make_hf_model(name, seed=7, **WIDE)
    oracle = save_hf_layout(hf, tmp_path, fp8=True, plain_dtype=torch.bfloat16, mtp=True)
    llm = LLM(tmp_path, max_num_seqs=4, max_num_batched_tokens=128, num_cache_pages=8)
    w, cfg = llm.engine.model.w, llm.engine.model.config
    moe, a = cfg.first_k_dense_replace, "model.layers.0.self_attn."
    fp8 = [a + "input_proj.weight", a + "o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
           "model.layers.0.mlp.down_proj.weight", f"model.layers.{moe}.mlp.experts.gate_up_proj",
           f"model.layers.{moe}.mlp.experts.down_proj", f"model.layers.{moe}.mlp.shared_experts.gate_up_proj.weight"]
    if cfg.q_lora_rank:
        fp8.append(a + "q_b_proj.weight")
    for key in fp8:
        assert isinstance(w[key], QuantizedWeight) and w[key].format == FP8 and w[key].scale.dtype == torch.float32, key
    for key in ("model.embed_tokens.weight", "lm_head.weight", f"model.layers.{moe}.mlp.gate.weight"):
        assert w[key].dtype == torch.bfloat16, key
    assert w[a + "w_uk_t"].dtype == torch.float32 and w[a + "w_uv"].dtype == torch.float32
    _assert_transformers_outputs(llm, oracle, name)
