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
    ps = [p.tolist() for p in prompts(hf.config.vocab_size, [150, 20], seed=8)]
    llm = LLM(tmp_path, max_num_seqs=4, max_num_batched_tokens=128, num_cache_pages=8)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, prompt_logprobs=1)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    with single_thread():
        for prompt, out in zip(ps, outs):
            ref = torch.log_softmax(full_logits(oracle, torch.tensor(prompt)), -1)
            gap = max(abs(out.prompt_logprobs[i][prompt[i]] - float(ref[i - 1, prompt[i]]))
                      for i in range(1, len(prompt)))
            assert gap < 1e-4, f"{layout}: prompt logprobs off by {gap:.2e}"
            assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 8)
