"""Adding a model family takes its package and a registry entry, nothing in deepinfer/core
(docs/architecture.md): the toy family (tests/unit/toy_family/, a bag-of-words model) registered here
loads through LLM and generates what its definition computes, chunked prefill and step graphs
included."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deepinfer import LLM, SamplingParams
from deepinfer.models import registry
from deepinfer.models.base import Family

VOCAB, HIDDEN = 48, 16


def _toy():
    from toy_family import ToyConfig, ToyModel

    return ToyConfig, ToyModel


TOY = Family("toy", ("ToyForCausalLM",), ("toy",), _toy)  # the registry line


@pytest.fixture
def toy_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "FAMILIES", registry.FAMILIES + (TOY,))
    g = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(VOCAB, HIDDEN, generator=g),
               "head.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["ToyForCausalLM"], "model_type": "toy", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1}))
    return tmp_path, weights


def _reference(weights, prompt: list[int], n: int) -> list[int]:
    """The family's definition, token by token in float64: state = sum of fed embeddings."""
    embed, head = weights["embed.weight"].double(), weights["head.weight"].double()
    state, out = embed[prompt].sum(0), []
    for _ in range(n):
        out.append(int((head @ state).argmax()))
        state = state + embed[out[-1]]
    return out


@pytest.mark.parametrize("eager", ["1", "0"])
def test_a_family_outside_core_generates_its_definition(toy_dir, monkeypatch, eager):
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", eager)
    path, weights = toy_dir
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=16)  # 16: longer prompts prefill in chunks
    assert type(llm.engine.model).__name__ == "ToyModel"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 21, 9, 40, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for _ in range(2):  # the second round reuses slots a finished sequence left
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [_reference(weights, p, 12) for p in prompts]
    graphs = llm.engine.runner.graphs
    assert (graphs is None) == (eager == "1")
    if graphs is not None:  # decode steps of the toy model are replayed like any family's
        assert graphs.stats["replayed"] > 0, graphs.stats
