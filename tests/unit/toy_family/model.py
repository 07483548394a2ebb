"""The toy family's model: its contract with the engine is models/base.py only."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.models.base import (CacheSpec, CausalLM, DecodeCache, PoolSpec, StepInput, TensorSpec, ViewCache,
                                   to_device)
from toy_family.config import ToyConfig


class StepMeta:
    """A step's index tensors, planned on the host: per token its sequence's state row and whether that
    state carries over (0 for a sequence starting at position 0: its slot may hold a finished one's),
    and the cumulative-sum rows that bound its sequence's tokens in the step; per sequence its last
    token and state row (written back). The forward reads the step only through these."""

    def __init__(self, inp: StepInput, cache: DecodeCache):
        lens, starts, slots = inp.lens.numpy(), inp.starts.numpy(), inp.slots.numpy()
        seq = np.repeat(np.arange(len(lens)), lens)
        first = np.cumsum(lens) - lens
        ring = cache.pools["sum"].spec.ring
        move = lambda a: to_device(a, cache.device)  # noqa: E731
        self.ids = move(inp.ids)
        self.state_rows = move(slots[seq] * ring)
        self.carry = move((starts[seq] > 0).astype(np.float32)[:, None])
        self.begin = move(first[seq])  # in the zero-padded cumulative sum: rows before the sequence
        self.end = move(np.arange(len(seq)) + 1)
        self.last = move(first + lens - 1)
        self.write_rows = move(slots * ring)


class ToyModel(CausalLM):
    multi_step_decode = False  # prepare plans one step at a time

    def __init__(self, config: ToyConfig, weights: dict[str, torch.Tensor], accel, parallel=None):
        self.config, self.accel = config, accel
        self.w = {name: accel.prepare_weight(t) for name, t in weights.items()}
        self.views = ViewCache(lambda cache, config: cache.pools["sum"].data, config)

    @classmethod
    def checkpoint_tensors(cls, config: ToyConfig) -> dict[str, TensorSpec]:
        shape = (config.vocab_size, config.hidden_size)
        return {"embed.weight": TensorSpec(shape), "head.weight": TensorSpec(shape, stored=True)}

    def cache_spec(self, margin: int) -> CacheSpec:
        return CacheSpec((PoolSpec("sum", self.config.hidden_size, ring=1),))

    def prepare(self, inp: StepInput, cache: DecodeCache, steps: int | None = None) -> StepMeta:
        return StepMeta(inp, cache)

    @torch.inference_mode()
    def forward(self, inp: StepInput, cache: DecodeCache, logit_rows: torch.Tensor, meta: StepMeta | None = None,
                features=None):
        meta = meta if meta is not None else self.prepare(inp, cache)
        state = self.views.get(cache)
        x = self.accel.embedding(meta.ids, self.w["embed.weight"])
        sums = torch.nn.functional.pad(x.cumsum(0), (0, 0, 1, 0))  # row r: the first r tokens of the step
        running = state[meta.state_rows] * meta.carry + sums[meta.end] - sums[meta.begin]
        state[meta.write_rows] = running[meta.last].to(state.dtype)
        return self.accel.linear(running[logit_rows.to(running.device)], self.w["head.weight"])
