"""Memory planning (gpu_memory_utilization, core/memory.py), LLM.memory_report() and the compute dtype."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.backends.cpu import CpuAccelerator
from deepinfer.core import memory
from deepinfer.core.engine import EngineConfig
from deepinfer.llm import TINY_DSV4_DIR, TINY_DSV41_DIR
from benchmark_modules import benchmarks_importable

GiB = 1 << 30
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=128)


@pytest.mark.parametrize("value", [0, -0.5, 1.5, "0.9"])
def test_gpu_memory_utilization_is_validated(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value).validate()


def test_plan_arithmetic_and_its_errors():
    plan = memory.plan_pages(utilization=0.5, free_after_weights=10 * GiB, weight_bytes=2 * GiB, headroom=GiB,
                             fixed=GiB // 2, per_page=GiB // 4, max_pages=1000, cache_bytes=None, device="cpu",
                             what="4 sequence slots")
    # 0.5 x (10 + 2) - 2 - 1 = 3 GiB; minus 0.5 fixed -> 10 pages of a quarter GiB
    assert (plan.budget, plan.pages, plan.capped) == (3 * GiB, 10, False)
    assert "0.5 x (10.000 GiB free + 2.000 GiB weights)" in plan.describe()
    capped = memory.plan_pages(utilization=0.5, free_after_weights=10 * GiB, weight_bytes=2 * GiB, headroom=GiB,
                               fixed=0, per_page=GiB // 4, max_pages=3, cache_bytes=None, device="cpu", what="")
    assert capped.pages == 3 and capped.capped
    with pytest.raises(memory.DoesNotFit, match=re.escape("the cache does not fit: it needs 0.750 GiB")):
        memory.plan_pages(utilization=0.2, free_after_weights=4 * GiB, weight_bytes=GiB, headroom=0,
                          fixed=GiB // 2, per_page=GiB // 4, max_pages=10, cache_bytes=None, device="cpu",
                          what="4 sequence slots")


def test_a_checkpoint_larger_than_memory_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(CpuAccelerator, "memory_info", lambda self: (1 << 20, 8 * GiB))  # 1 MiB available
    with pytest.raises(memory.DoesNotFit, match=r"holds 0\.0\d\d GiB of weights .* the cpu has 0\.001 GiB free"):
        LLM(**SMALL)


def test_a_cache_that_cannot_fit_names_every_size(monkeypatch):
    from deepinfer.llm import default_model

    need = memory.checkpoint_bytes(default_model())
    # enough for the weights; once they are loaded, 1 MiB is left: not enough for the activation
    # headroom and one page beside the slots
    free = iter([int(1.2 * need)] + [1 << 20] * 10)
    monkeypatch.setattr(CpuAccelerator, "memory_info", lambda self: (next(free), 8 * GiB))
    with pytest.raises(memory.DoesNotFit, match=r"the cache does not fit: it needs .*\(4 sequence slots .* activation headroom"):
        LLM(**SMALL)


def test_memory_report_accounts_for_weights_and_cache():
    llm = LLM(TINY_DSV4_DIR, **SMALL, max_model_len=512)
    report = llm.memory_report()
    engine = llm.engine
    # tiny-dsv4 is stored in bf16: its weights stay bf16 (a few float32 norms, int64 tables)
    assert max(report.weights, key=report.weights.get) == "bfloat16"
    assert report.weight_bytes <= 1.05 * report.checkpoint_bytes
    pools = sum(p.data.numel() * p.data.element_size() for p in engine.cache.pools.values())
    assert report.cache["total"] == pools and report.cache["pages"] == engine.cache.num_pages
    assert engine.cache.num_pages == 4 * (512 // 128)  # every slot at max_model_len fits: capped
    text = str(report)
    for part in ("weights", "bfloat16", "cache", "sequence slots", "sized by 0.9 x", "headroom"):
        assert part in text
    assert report.as_dict()["weight_bytes"] == report.weight_bytes
    llm.close()


def test_explicit_sizes_override_the_rule():
    llm = LLM(**SMALL, num_cache_pages=7)
    assert llm.engine.cache.num_pages == 7 and "num_cache_pages given" in str(llm.memory_report())
    llm.close()


def test_dtype_resolution():
    cpu = CpuAccelerator()
    assert EngineConfig().compute_dtype(cpu) == torch.float32
    assert EngineConfig(dtype="bfloat16").compute_dtype(cpu) == torch.bfloat16
    from deepinfer.backends.base import Accelerator

    class Device(CpuAccelerator):
        preferred_dtype = torch.bfloat16

    assert EngineConfig().compute_dtype(Device()) == torch.bfloat16
    assert EngineConfig(dtype="float32").compute_dtype(Device()) == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16").validate()
    with pytest.raises(ValueError, match="compute dtype"):
        Accelerator.set_compute_dtype(cpu, torch.float16)


def test_bf16_compute_on_cpu_runs_and_rounds_gemm_inputs():
    """dtype="bfloat16" on cpu: the decode state in bf16, every weight op's input rounded to bf16
    (the reference ops take it: slower, see docs/memory.md), weights still as stored."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[0, 5, 17, 300, 42, 7, 99]]
    out = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(TINY_DSV4_DIR, **SMALL, dtype=dtype, num_cache_pages=8)
        assert llm.engine.cache.dtype == getattr(torch, dtype) and llm.accel.compute_dtype == getattr(torch, dtype)
        assert llm.engine.model.w["lm_head.weight"].dtype == torch.bfloat16  # stored dtype either way
        res = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[0]
        out[dtype] = res.outputs[0].token_ids
        # the last step's logits for the prompt: compare the two compute dtypes
        llm.close()
    assert len(out["bfloat16"]) == 6
    # tiny-dsv4 is confident enough that the first tokens survive bf16 GEMM inputs
    assert out["bfloat16"][:2] == out["float32"][:2]


def _tensor_bytes(value, seen: set) -> int:
    if isinstance(value, torch.Tensor):
        key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return key[1]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(_tensor_bytes(v, seen) for v in items)


def test_the_drafter_holds_nothing_that_grows_with_max_model_len(monkeypatch):
    """DSpark's device memory outside the memory plan (stage weights, context rings) is the same at any
    max_model_len: its RoPE is computed per step from positions, not looked up in a table of every
    position (which at DeepSeek-V4.1-Flash's 1M context would be 256 MiB nobody planned for)."""
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    held = []
    for max_model_len in (256, 4096):  # tiny-dsv41's max_position_embeddings: 4096
        llm = LLM(model=TINY_DSV41_DIR, max_model_len=max_model_len, **SMALL)
        drafter = llm.engine.spec.drafter
        held.append(_tensor_bytes([v for k, v in vars(drafter).items() if k != "model"], set()))
    assert held[0] == held[1] > 0


# A fresh process loads the checkpoint given as argv[1] and prints its resident memory (VmRSS)
# before and after, with what memory_report() counts. The cpu kernels and the engine's modules are
# loaded before the first reading: they are not weights.
_LOAD_AND_MEASURE = """
import json, sys
from deepinfer import LLM
from deepinfer.backends.cpu import kernels
import deepinfer.models.deepseek_v3.model, deepinfer.models.deepseek_v4.model

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

kernels.load()
before = rss()
llm = LLM(sys.argv[1], max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256, num_cache_pages=4)
after = rss()
report = llm.memory_report()
print(json.dumps({"rss_growth": after - before, "cache": report.cache["total"],
                  "weight_bytes": report.weight_bytes, "checkpoint_bytes": report.checkpoint_bytes}))
llm.close()
"""


def _v4_upstream_fp4(path) -> None:
    """benchmarks/real_shapes.py's V4-Flash writer at small widths: per-expert FP4 w1 / w3 / w2
    (ue8m0 scales per 32) in the file of their layer's FP8 and bf16 tensors."""
    pytest.importorskip("transformers", reason="the writer takes V4's config from transformers")
    with benchmarks_importable():
        import real_shapes
    real_shapes.write_checkpoint(path, real_shapes.Shapes(
        hidden=512, heads=8, head_dim=128, q_rank=256, o_groups=2, o_rank=256, experts=128, inter=1024, vocab=4096,
        index_heads=16, index_dim=128, experts_per_shard=0))


def _v3_hub_fp8(path) -> None:
    """DeepSeek-V3's hub layout (tests/tiny_models_v3.py) at small widths, random values: per-expert
    gate_proj / up_proj / down_proj and the dense projections FP8 e4m3 with float32 128x128
    weight_scale_inv, embedding, head and router bf16, norms float32; one file, as a hub shard
    mixes a layer's tensors."""
    from safetensors.torch import save_file
    from tiny_models_v3 import FP8_SUFFIXES, QUANTIZATION_CONFIG

    from deepinfer.models.deepseek_v3 import weights
    from deepinfer.models.deepseek_v3.config import DeepseekV3Config

    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 4096,
              "hidden_size": 1024, "intermediate_size": 1024, "moe_intermediate_size": 512, "num_hidden_layers": 2,
              "first_k_dense_replace": 0, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256,
              "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
              "n_routed_experts": 64, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1,
              "topk_group": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_theta": 10000.0,
              "rope_scaling": None, "max_position_embeddings": 4096, "quantization_config": QUANTIZATION_CONFIG}
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    out = {}

    def fp8(name: str, n: int, k: int) -> None:
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        out[name] = codes.view(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = torch.full((-(-n // 128), -(-k // 128)), 2.0 ** -8)

    for name, spec in weights.checkpoint_tensors(DeepseekV3Config.from_dict(config)).items():
        if spec.experts:
            e, n, k = spec.shape
            halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
            for j in range(e):
                for half in halves:
                    fp8(weights.checkpoint_source(name, (j, half)), n // len(halves), k)
        elif name.endswith(FP8_SUFFIXES):
            fp8(name, *spec.shape)
        elif len(spec.shape) == 2:
            out[name] = (torch.randn(spec.shape, generator=gen) * 0.02).bfloat16()
        else:
            out[name] = torch.ones(spec.shape)
    save_file(out, str(path / "model.safetensors"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc (Linux)")
@pytest.mark.parametrize("layout", [_v4_upstream_fp4, _v3_hub_fp8], ids=["v4_upstream_fp4", "v3_hub_fp8"])
def test_resident_memory_after_loading_per_expert_tensors_is_about_the_files(tmp_path, layout):
    """A checkpoint whose routed experts are stored per expert, in the same file as tensors the model
    uses in place from the file's mapping. After loading, the process holds about the files' bytes:
    VmRSS growth in a fresh process (less the cache pool; no tokenizer here) within 1.1x of the
    files, not only in memory_report()'s accounting. Copying the expert slices out of the mapping
    left their pages resident beside the stacks for as long as the file stayed mapped (measured:
    1.9x on both layouts)."""
    layout(tmp_path)
    files = memory.checkpoint_bytes(tmp_path)
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert _expert_bytes(tmp_path) > 0.8 * files  # the routed experts are most of it, as in the released checkpoints
    resident = (m["rss_growth"] - m["cache"]) / files
    print(f"\nfiles {files / 1e6:.0f} MB: memory_report weights {m['weight_bytes'] / files:.3f}x, "
          f"RSS after load less the cache {resident:.3f}x", end="")
    assert m["checkpoint_bytes"] == files and m["weight_bytes"] <= 1.05 * files
    assert resident <= 1.1, f"RSS grew {m['rss_growth'] / 1e6:.0f} MB loading {files / 1e6:.0f} MB of files"


def _expert_bytes(path) -> int:
    """Bytes of the per-expert tensors (and their scales) in the checkpoint's files."""
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            total += sum(st.get_tensor(n).nbytes for n in st.keys() if ".experts." in n)
    return total
