"""The whole tiny DeepSeek-V4 and DeepSeek-V3 graphs on the ascend backend (torch_npu shim + Triton interpreter) against
the cpu backend: greedy tokens (argmax of the logits) at every fed position must agree, and the logits
stay within 1e-4 x max|logit| (the oracle tests' tolerance against transformers)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the ascend backend's Triton kernels cannot run")
pytest.importorskip("transformers", reason="transformers builds the tiny models")

from model_runner import build_model, new_cache, run_schedule  # noqa: E402
import tiny_models  # noqa: E402
import tiny_models_v3  # noqa: E402

TOL = 1e-4


# V4: all three layer types, hash + top-k MoE; V3: q LoRA, YaRN, group-limited routing, absorbed MLA
MODELS = {"v4/mixed_hc4_yarn": tiny_models.make_hf_model, "v3/v3_yarn_groups": tiny_models_v3.make_hf_model}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_match_cpu(name):
    hf, cfg = MODELS[name](name.split("/")[1], seed=5)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen) for n in (70, 6, 25)]
    # a mixed batch: prefill chunks beside decodes, crossing compressor windows (rate 4 and 64)
    steps = [[(0, 41), (1, 4)], [(0, 28), (1, 1), (2, 25)], [(0, 1), (1, 1)]]
    outs = {}
    for acc in ("cpu", "ascend"):
        model = build_model(hf, cfg, accelerator=acc)
        outs[acc] = run_schedule(model, new_cache(model), prompts, steps)
    for seq, (cpu, asc) in enumerate(zip(outs["cpu"], outs["ascend"])):
        asc = asc.cpu()
        err = float((asc - cpu).abs().max() / cpu.abs().max())
        print(f"seq {seq} len {len(cpu)}: max rel logit err {err:.2e}")
        assert err <= TOL
        assert torch.equal(asc.argmax(-1), cpu.argmax(-1)), f"seq {seq}: greedy tokens differ"
