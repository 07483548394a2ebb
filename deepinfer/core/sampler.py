"""Sampling policy on top of the accelerator's `sample` op: per-row parameters, counter-based
noise keyed by (seq_seed, position), and the logprobs users asked for."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.backends.base import Accelerator
from deepinfer.core.request import Request

_UINT63 = 1 << 63


def _as_int64(seed: int) -> int:
    """The uint64 seed's bit pattern as a signed int64 (what a torch.int64 tensor holds)."""
    return seed - (1 << 64) if seed >= _UINT63 else seed


class Sampler:
    def __init__(self, accel: Accelerator):
        self.accel = accel

    def inputs(self, requests: list[Request], positions: list[int]) -> tuple[torch.Tensor, ...]:
        """Per-row sampling parameters, built on the CPU when the step is planned:
        row r samples request r's token at `positions[r]`."""
        dev = self.accel.device
        params = [r.params for r in requests]
        columns = (np.array([p.temperature for p in params], dtype=np.float32),
                   np.array([p.top_k for p in params], dtype=np.int64),
                   np.array([p.top_p for p in params], dtype=np.float32),
                   np.array([_as_int64(r.seed) for r in requests], dtype=np.int64),
                   np.array(positions, dtype=np.int64))
        # via numpy: torch.tensor(list) costs ~5 us a call, five of them per step
        return tuple(torch.from_numpy(c).to(dev) for c in columns)

    def sample(self, logits: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.accel.sample(logits, *inputs)


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Per row: {chosen token: logprob} plus the k most likely tokens, from the model's
    unmodified distribution."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, chosen.view(-1, 1).to(logprobs.device)).squeeze(1).tolist()
    out = [{int(t): float(lp)} for t, lp in zip(chosen.tolist(), picked)]
    if k > 0:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        for row, (vs, ts) in enumerate(zip(values.tolist(), ids.tolist())):
            for v, t in zip(vs, ts):
                out[row].setdefault(t, v)
    return out
