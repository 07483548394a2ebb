"""tools/train_tiny_v41.py trains DeepSeek-V4.1 as DeepSeek's reference defines it and writes what
deepinfer loads: its differentiable training forward, given a golden checkpoint's weights, lands
within the reference's own noise bounds (e2e_tolerance; it computes in float32, like the reference's
fp32 probe: measured mean / max |d logprob| ced10 0.120 / 1.58, mini6 0.074 / 0.72), and a model it
writes has the released layout tensor for tensor (the golden checkpoints' names, dtypes and shapes)
with the same dequantized values."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.backends.quant import widen
from deepinfer.core.loader import load_checkpoint
from deepinfer.models.deepseek_v41.engram import token_classes
from deepinfer.models.registry import load_config
from v41_goldens import CONFIGS, checkpoint_dir, e2e_tolerance, load

TOOL = Path(__file__).resolve().parents[2] / "tools" / "train_tiny_v41.py"


@pytest.fixture(scope="module")
def trainer():
    import sys

    saved = list(sys.path)  # the tool puts tools/ on sys.path (for train_tiny): not for other tests
    spec = importlib.util.spec_from_file_location("train_tiny_v41", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.path[:] = saved
    return module


def engram_table(weights: dict, name: str) -> torch.Tensor:
    return weights[name].float() * weights[name.replace("weight", "scale")].float().repeat_interleave(32, -1)


def golden_net(trainer, config: str):
    """The trainer's module holding a golden checkpoint's weights (as deepinfer's loader reads them)."""
    src = checkpoint_dir(config)
    cfg, cls = load_config(src)
    weights, extra = load_checkpoint(src, cls.checkpoint_tensors(cfg), cls, keep_prefixes=cls.extra_prefixes)
    net = trainer.TinyV41(cfg, torch.from_numpy(token_classes(src / "tokenizer.json")), quantized=True, seed=0)
    experts: dict[str, list] = {}
    with torch.no_grad():
        for name, t in {**weights, **extra}.items():
            if name.endswith("engram.embed.scale"):
                continue
            if name.endswith("engram.embed.weight"):
                t = engram_table(weights, name)
            t = widen(t)  # the loader keeps experts and drafter weights as stored
            if m := re.fullmatch(r"(mtp\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight", name):
                experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
                continue
            net.p(name).copy_(t)
        for stack, parts in experts.items():
            n = 1 + max(e for e, _ in parts)
            gate_up = [torch.cat([parts[(e, "w1")], parts[(e, "w3")]]) for e in range(n)]
            net.p(stack + ".gate_up").copy_(torch.stack(gate_up))
            net.p(stack + ".down").copy_(torch.stack([parts[(e, "w2")] for e in range(n)]))
    return net, cfg, cls, weights, extra


@pytest.mark.parametrize("config", CONFIGS)
def test_training_forward_is_v41_within_the_references_noise(trainer, config):
    torch.set_num_threads(1)
    net, *_ = golden_net(trainer, config)
    g = load(f"e2e_{config}")
    diffs = []
    with torch.no_grad():
        for j in range(5):
            ids = g[f"p{j}.ids"]
            lp = net(ids[None])[0][0].double().log_softmax(-1)[:-1].gather(1, ids[1:, None]).squeeze(1)
            diffs.append((lp - g[f"p{j}.prefill.logprobs"]).abs())
    d, tol = torch.cat(diffs), e2e_tolerance(config)
    assert float(d.mean()) <= tol["mean"] and float(d.max()) <= tol["max"], (float(d.mean()), float(d.max()), tol)


@pytest.mark.parametrize("config", CONFIGS)
def test_the_written_checkpoint_has_the_released_layout(trainer, config, tmp_path):
    net, cfg, cls, weights, extra = golden_net(trainer, config)
    src = checkpoint_dir(config)
    written = net.export()
    with safe_open(src / "model.safetensors", "pt") as f:
        assert set(written) == set(f.keys())
        for name in f.keys():
            t = f.get_tensor(name)
            assert (written[name].dtype, tuple(written[name].shape)) == (t.dtype, tuple(t.shape)), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    save_file({k: v.contiguous() for k, v in written.items()}, str(tmp_path / "model.safetensors"))
    again, again_extra = load_checkpoint(tmp_path, cls.checkpoint_tensors(cfg), cls, keep_prefixes=cls.extra_prefixes)
    for name, t in weights.items():
        if name.endswith("engram.embed.weight"):
            assert torch.equal(engram_table(again, name), engram_table(weights, name)), name
        elif not name.endswith("engram.embed.scale"):
            assert torch.equal(widen(again[name]), widen(t)), name
    assert all(torch.equal(widen(again_extra[n]), widen(t)) for n, t in extra.items())
