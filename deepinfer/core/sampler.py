"""Sampling policy on top of the accelerator's `sample` op: per-row parameters, counter-based
noise keyed by (seq_seed, position), and the logprobs users asked for."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.backends.base import Accelerator
from deepinfer.core import logits as adjust
from deepinfer.core.request import Request

_UINT63 = 1 << 63


def _as_int64(seed: int) -> int:
    """The uint64 seed's bit pattern as a signed int64 (what a torch.int64 tensor holds)."""
    return seed - (1 << 64) if seed >= _UINT63 else seed


class Sampler:
    def __init__(self, accel: Accelerator, vocab: int = 0, eos_token_ids=()):
        self.accel = accel
        self.vocab, self.eos_token_ids = vocab, tuple(eos_token_ids)
        self.counts = adjust.TokenCounts(accel, vocab)  # pools allocated on the first penalized request

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

    def adjustments(self, requests: list[Request], positions: list[int]) -> adjust.Adjustments | None:
        """SamplingParams' logit adjustments of a step's sampled rows (None: no request has any),
        built with `inputs`; the history of a row is its output so far (resolved tokens)."""
        rows = [(r, pos - r.num_prompt_tokens, r.output_token_ids[:pos - r.num_prompt_tokens] if r.bad_words_ids else [])
                for r, pos in zip(requests, positions)]
        return adjust.plan(rows, self.counts, self.vocab, self.eos_token_ids, self.accel.device)

    def prepare(self, adj: adjust.Adjustments | None) -> None:
        """Device work a step does before its adjustments apply (pool growth, new rows), once."""
        if adj is not None and (adj.inits or adj.capacity):
            self.counts.prepare(adj.capacity, adj.inits)
            adj.inits = []

    def adjust(self, logits: torch.Tensor, adj: adjust.Adjustments | None) -> torch.Tensor:
        if adj is None:
            return logits
        self.prepare(adj)
        return adjust.apply(self.accel, logits, adj, self.counts.counts, self.counts.prompt)

    def count(self, adj: adjust.Adjustments | None, tokens: torch.Tensor) -> None:
        """Add the sampled tokens to their penalized requests' counts (on the device)."""
        if adj is not None and adj.penalty is not None:
            self.accel.count_tokens(self.counts.counts, adj.penalty[0], tokens.to(adj.penalty[0].device))

    def sample(self, logits: torch.Tensor, inputs: tuple[torch.Tensor, ...],
               adj: adjust.Adjustments | None = None) -> torch.Tensor:
        tokens = self.accel.sample(self.adjust(logits, adj), *inputs)
        self.count(adj, tokens)
        return tokens

    def release(self, req: Request) -> None:
        self.counts.release(req)


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
