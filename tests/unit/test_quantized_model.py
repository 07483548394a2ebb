"""DeepSeek-V4 with its weights stored as V4-Flash stores them (FP4 experts, FP8 dense projections,
bf16 router / compressor / embedding / head) against the same model with those weights dequantized
to float32, on the cpu backend.

The cpu backend computes weight-only (float32 activations, weights widened in registers), so the
two differ only by float32 rounding order: logits within 1e-4 x max|logit| at every fed position,
and greedy tokens equal wherever the top-2 gap exceeds twice that bound (on these configs: every
position). End to end: an upstream-named quantized checkpoint through the loader and LLM.generate
gives the dequantized checkpoint's greedy tokens, and holds about its own bytes in memory."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.backends import get_accelerator
from deepinfer.backends.quant import QuantizedWeight
from deepinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from deepinfer.models.deepseek_v4.weights import checkpoint_source
from model_runner import new_cache, run_schedule
from quant_checks import dequantized, flash_layout, save_upstream

pytest.importorskip("transformers", reason="transformers builds the tiny models")
from tiny_models import CONFIGS, make_hf_model  # noqa: E402

TOL = 1e-4


def _stored(name: str, seed: int = 5):
    hf, hfc = make_hf_model(name, seed=seed)
    cfg = DeepseekV4Config.from_dict(hfc.to_dict())
    specs = DeepseekV4Model.checkpoint_tensors(cfg)
    return cfg, hfc, flash_layout(hf.state_dict(), specs), {k: hf.state_dict()[k] for k in specs}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantized_model_matches_its_dequantized_copy(name):
    cfg, _, stored, original = _stored(name)
    accel = get_accelerator("cpu")
    quantized = DeepseekV4Model(cfg, dict(stored), accel)
    # nothing was widened: experts FP4, dense projections FP8, embedding / head bf16
    w = quantized.w
    assert isinstance(w["model.layers.0.mlp.experts.gate_up_proj"], QuantizedWeight)
    assert isinstance(w["model.layers.0.self_attn.q_b_proj.weight"], QuantizedWeight)
    assert w["model.embed_tokens.weight"].dtype == torch.bfloat16 and w["lm_head.weight"].dtype == torch.bfloat16
    reference = DeepseekV4Model(cfg, dequantized(stored), accel)
    unquantized = DeepseekV4Model(cfg, dict(original), accel)

    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen) for n in (70, 6, 25)]
    # prefill chunks beside decodes, crossing compressor windows
    steps = [[(0, 41), (1, 4)], [(0, 28), (1, 1), (2, 25)], [(0, 1), (1, 1)], [(0, 0), (1, 0), (2, 0)]]
    steps = [[s for s in step if s[1]] for step in steps if any(n for _, n in step)]
    outs = {label: run_schedule(m, new_cache(m), prompts, steps)
            for label, m in (("quantized", quantized), ("reference", reference), ("unquantized", unquantized))}
    for seq, (q, r, u) in enumerate(zip(outs["quantized"], outs["reference"], outs["unquantized"])):
        scale = float(r.abs().max())
        err = float((q - r).abs().max())
        print(f"\n{name} seq {seq}: max |quantized - dequantized| {err / scale:.2e} x max|logit|; "
              f"quantization itself moved logits by {float((r - u).abs().max()) / scale:.2e}", end="")
        assert err <= TOL * scale
        top2 = r.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * TOL * scale
        assert torch.equal(q.argmax(-1)[clear], r.argmax(-1)[clear]), f"seq {seq}: greedy tokens differ"
        assert bool(clear.float().mean() > 0.9)  # the check covers nearly every position
        assert float((r - u).abs().max()) > 100 * TOL * scale  # the weights really were quantized


def test_llm_serves_an_upstream_quantized_checkpoint(tmp_path):
    """The loader path: DeepSeek's names, `.scale` tensors, per-expert FP4 w1/w3/w2 -> the same greedy
    tokens as the float32 checkpoint of the dequantized weights, resident weights ~ checkpoint bytes."""
    from safetensors.torch import save_file

    from deepinfer import LLM, SamplingParams

    cfg, hfc, stored, _ = _stored("mixed_hc4_yarn", seed=7)
    qdir, fdir = tmp_path / "fp8_fp4", tmp_path / "float32"
    for d in (qdir, fdir):
        d.mkdir()
        hfc.save_pretrained(d)
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128]}
    (qdir / "config.json").write_text(json.dumps(config))
    save_upstream(stored, qdir, checkpoint_source)
    save_file({k: v.contiguous() for k, v in dequantized(stored).items()}, str(fdir / "model.safetensors"))

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (30, 5, 90)]
    tokens = {}
    for label, path in (("quantized", qdir), ("float32", fdir)):
        llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=256, num_cache_pages=16)
        out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        tokens[label] = [o.outputs[0].token_ids for o in out]
        report = llm.memory_report()
        if label == "quantized":
            kinds = " ".join(report.weights)
            assert "fp4_e2m1 1x32 (ue8m0 scales)" in kinds and "fp8_e4m3 128x128" in kinds and "bfloat16" in kinds
            assert report.weight_bytes <= 1.15 * report.checkpoint_bytes, str(report)
        llm.close()
    assert tokens["quantized"] == tokens["float32"]
