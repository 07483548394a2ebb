"""Drive deepinfer's model step by step for tests, without the engine."""

from __future__ import annotations

import torch

from deepinfer.backends import get_accelerator
from deepinfer.core.cache import StateCache
from deepinfer.models.base import CausalLM, StepInput
from deepinfer.models.registry import family_of


def build_model(hf_model, hf_config, accelerator: str = "cpu") -> CausalLM:
    """deepinfer's model of the family the registry finds for `hf_config`, on transformers' weights."""
    data = hf_config.to_dict()
    config_cls, model_cls = family_of(data).load()
    cfg = config_cls.from_dict(data)
    state = hf_model.state_dict()
    return model_cls(cfg, {k: state[k] for k in model_cls.checkpoint_tensors(cfg)}, get_accelerator(accelerator))


def new_cache(model, max_seqs: int = 8, max_step_tokens: int = 2048, max_model_len: int = 2048,
              num_pages: int = 256, margin: int = 0) -> StateCache:
    return StateCache(model.cache_spec(margin), max_seqs=max_seqs, num_pages=num_pages,
                      max_step_tokens=max_step_tokens, max_model_len=max_model_len, device=model.accel.device)


def run_schedule(model, cache: StateCache, prompts: list[torch.Tensor],
                 steps: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
    """Feed `prompts` to the model as `steps` prescribes: each step lists (sequence, n new tokens).
    Returns, per sequence, the logits of every fed position [len, V]."""
    slots = [cache.allocate_slot() for _ in prompts]
    fed = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in steps:
        ids, starts, lens, order = [], [], [], []
        for seq, n in step:
            cache.grow(slots[seq], fed[seq] + n)
            ids.append(prompts[seq][fed[seq]:fed[seq] + n])
            starts.append(fed[seq])
            lens.append(n)
            order.append(seq)
            fed[seq] += n
        inp = StepInput(torch.cat(ids), torch.tensor([slots[s] for s in order]), torch.tensor(starts),
                        torch.tensor(lens))
        out = model.forward(inp, cache, torch.arange(int(inp.lens.sum())))
        for seq, chunk in zip(order, out.split(lens)):
            logits[seq].append(chunk)
    for slot in slots:
        cache.release(slot)
    return [torch.cat(chunks) if chunks else None for chunks in logits]
