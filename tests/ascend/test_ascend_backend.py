"""Selection, errors and engine-level behaviour of the ascend backend, through the torch_npu shim."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the ascend backend's Triton kernels cannot run")

from deepinfer.backends import AcceleratorUnavailable, cuda_usable, get_accelerator  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers builds the tiny model")
    from tiny_models import make_hf_model

    hf, _ = make_hf_model("csa_hc2", seed=3)
    path = tmp_path_factory.mktemp("tiny_v4_ascend")
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf.config.vocab_size


def test_shim_is_what_imports(torch_npu_shim):
    import torch_npu

    assert torch_npu is torch_npu_shim and torch_npu.DEEPINFER_REFERENCE_SHIM
    assert torch.npu.is_available()


def test_auto_picks_ascend_when_torch_npu_sees_an_npu(monkeypatch, torch_npu_shim):
    if cuda_usable():
        pytest.skip("a CUDA GPU is present: auto-selection legitimately prefers nvidia")
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    assert get_accelerator().name == "ascend"
    monkeypatch.setattr(torch_npu_shim.npu, "available", False)
    assert get_accelerator().name == "cpu"


def test_real_torch_npu_without_device_is_a_clear_error(monkeypatch, torch_npu_shim):
    """Outside the shim the backend needs a visible NPU and says so."""
    monkeypatch.setattr(torch_npu_shim, "DEEPINFER_REFERENCE_SHIM", False)
    monkeypatch.setattr(torch_npu_shim.npu, "available", False)
    with pytest.raises(AcceleratorUnavailable, match="sees no NPU.*DEEPINFER_ACCELERATOR=cpu"):
        get_accelerator("ascend")


def test_shim_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AcceleratorUnavailable, match="TRITON_INTERPRET=1"):
        get_accelerator("ascend")


def test_batch_invariant_mode_is_refused_on_ascend(monkeypatch, model_dir):
    from deepinfer import LLM

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT=1 but the ascend backend"):
        LLM(model_dir[0], accelerator="ascend")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")  # the same through the environment
    with pytest.raises(ValueError, match="NVIDIA-only"):
        LLM(model_dir[0])


def test_seq_seed_on_ascend_warns_that_reruns_may_differ(monkeypatch, model_dir, caplog):
    import logging

    from deepinfer import LLM, SamplingParams

    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    llm = LLM(model_dir[0], accelerator="ascend", max_num_seqs=2, max_num_batched_tokens=64, num_cache_pages=4)
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=1, seq_seed=1),
                     use_tqdm=False)
    msgs = [r.getMessage() for r in caplog.records if r.name == "deepinfer"]
    assert len(msgs) == 1 and "the ascend backend does not" in msgs[0] and "BATCH_INVARIANT" not in msgs[0]


def test_llm_generates_on_ascend_like_cpu(monkeypatch, model_dir):
    """The engine path (device, memory query, sampler) on ascend: greedy tokens equal the cpu backend's."""
    from deepinfer import LLM, SamplingParams

    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    path, vocab = model_dir
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (9, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = {}
    for acc in ("cpu", "ascend"):
        # float32 compute on both (ascend's auto is bf16): the same numerics, so the same tokens
        llm = LLM(path, accelerator=acc, max_num_seqs=4, max_num_batched_tokens=64, num_cache_pages=16,
                  dtype="float32")
        out[acc] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                 use_tqdm=False)]
    assert out["ascend"] == out["cpu"] and all(len(t) == 4 for t in out["cpu"])


@pytest.mark.slow
def test_shipped_model_drafts_on_ascend_like_cpu(monkeypatch):
    """ascend drafts by default: tiny-dsv4's DSpark drafter (its experts in the layout
    npu_grouped_matmul takes) generates the same greedy tokens as cpu without drafting."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.llm import TINY_DSV4_DIR

    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")  # fixed length: no start-up profile under the interpreter
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["def fib(n):"]
    asc = LLM(TINY_DSV4_DIR, accelerator="ascend", max_num_seqs=2, max_num_batched_tokens=128, num_cache_pages=4, dtype="float32")
    assert asc.engine.spec is not None  # the backend's default: draft
    drafted = [o.outputs[0].token_ids for o in asc.generate(prompts, params, use_tqdm=False)]
    assert asc.engine.spec.stats["verified"] > 0
    cpu = LLM(TINY_DSV4_DIR, accelerator="cpu", max_num_seqs=2, max_num_batched_tokens=128, num_cache_pages=4)
    assert cpu.engine.spec is None
    assert drafted == [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
