"""Lossless acceptance of draft tokens: speculative sampling's rule, so a request's tokens follow the
target model's distribution whatever the drafter proposed.

Greedy rows (temperature < 1e-5): accept while the draft equals the target's argmax, then
the target's token. Sampled rows: accept draft x with probability min(1, p_t(x) / p_d(x));
at the first rejection draw from normalize(max(p_t - p_d, 0)); after all accepted draw a
bonus token from p_t. Every random draw goes through the accelerator's counter-based
`sample` op keyed by (seed, position) -- a Bernoulli(a) is a two-way categorical
[log a, log(1 - a)] -- so with a seq_seed the result depends on neither batch composition
nor step boundaries. Salts keep the draft, coin and token draws of a position independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backends.base import Accelerator

GREEDY_BELOW = 1e-5
DRAFT_SALT = 0x2545F4914F6CDD1D  # xor-ed into the seed for the drafter's own draws
COIN_SALT = 0x5851F42D4C957F2D  # ... and for the accept/reject coins


def salted(seeds: torch.Tensor, salt: int) -> torch.Tensor:
    return seeds ^ (salt - (1 << 64) if salt >= 1 << 63 else salt)


def target_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """log of the distribution the sampler draws from: softmax(top-k/top-p filtered logits / T)
    (the `sample` op's documented semantics: top-k first, then the smallest prefix of mass >= top_p)."""
    scaled = logits.float() / temperature.clamp(min=GREEDY_BELOW).unsqueeze(1)
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (ranks > 0)
    filtered = torch.empty_like(scaled).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return filtered.log_softmax(dim=-1)


def draw(accel: Accelerator, logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row from exp(logprobs), counter-based on (seeds, positions)."""
    rows = logprobs.shape[0]
    ones = torch.ones(rows, dtype=torch.float32, device=logprobs.device)
    return accel.sample(logprobs, ones, torch.zeros(rows, dtype=torch.int64, device=logprobs.device), ones,
                        seeds, positions)


@dataclass(slots=True)
class Block:
    """One request's verification: target rows [L+1, V] (row i predicts position anchor_pos+1+i),
    drafts [L], the drafter's log-probs [L, V] (sampled requests only), and how to draw."""

    target: torch.Tensor
    drafts: list[int]
    draft_logprobs: torch.Tensor | None
    temperature: float
    top_k: int
    top_p: float
    seed: torch.Tensor  # int64 scalar
    anchor_pos: int


def accept(accel: Accelerator, blocks: list[Block]) -> list[list[int]]:
    """Per block: the accepted drafts followed by one target token (correction or bonus)."""
    out: list[list[int]] = [[] for _ in blocks]
    greedy = [i for i, b in enumerate(blocks) if b.temperature < GREEDY_BELOW]
    if greedy:
        best = torch.cat([blocks[i].target for i in greedy]).argmax(dim=-1).tolist()
        at = 0
        for i in greedy:
            b = blocks[i]
            n = len(b.drafts)
            target, at = best[at:at + n + 1], at + n + 1
            j = 0
            while j < n and b.drafts[j] == target[j]:
                j += 1
            out[i] = b.drafts[:j] + [target[j]]
    sampled = [i for i, b in enumerate(blocks) if b.temperature >= GREEDY_BELOW]
    if sampled:
        _accept_sampled(accel, [blocks[i] for i in sampled], sampled, out)
    return out


def _accept_sampled(accel: Accelerator, blocks: list[Block], where: list[int], out: list[list[int]]) -> None:
    dev = blocks[0].target.device
    sizes = [len(b.drafts) + 1 for b in blocks]
    rep = lambda values, dtype: torch.tensor([v for v, n in zip(values, sizes) for _ in range(n)],  # noqa: E731
                                             dtype=dtype, device=dev)
    logp_t = target_logprobs(torch.cat([b.target for b in blocks]), rep([b.temperature for b in blocks], torch.float32),
                             rep([b.top_k for b in blocks], torch.int64), rep([b.top_p for b in blocks], torch.float32))
    seeds = torch.stack([b.seed for b in blocks]).repeat_interleave(torch.tensor(sizes, device=dev))
    positions = torch.cat([torch.arange(b.anchor_pos + 1, b.anchor_pos + 1 + n, device=dev)
                           for b, n in zip(blocks, sizes)])
    # draft rows: every row but each block's last; the last row of a block is its bonus row
    ends = torch.cumsum(torch.tensor(sizes, device=dev), 0) - 1
    is_draft = torch.ones(len(positions), dtype=torch.bool, device=dev)
    is_draft[ends] = False
    logp_d = torch.full_like(logp_t, float("-inf"))
    drafts = torch.zeros(len(positions), dtype=torch.int64, device=dev)
    if bool(is_draft.any()):
        logp_d[is_draft] = torch.cat([b.draft_logprobs for b in blocks if b.drafts]).float()
        drafts[is_draft] = torch.tensor([t for b in blocks for t in b.drafts], dtype=torch.int64, device=dev)
    # coin: accept with min(1, p_t/p_d) at the draft's own position
    ratio = (logp_t.gather(1, drafts[:, None]) - logp_d.gather(1, drafts[:, None])).squeeze(1).clamp(max=0.0)
    two_way = torch.stack([ratio, torch.log(-torch.expm1(ratio))], dim=1)  # [log a, log(1-a)]
    accepted = draw(accel, two_way, salted(seeds, COIN_SALT), positions) == 0
    # a token per row: from the residual on draft rows (p_t itself where the residual mass is ~0,
    # and on bonus rows, whose p_d is 0)
    residual = (logp_t.exp() - logp_d.exp()).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual_logp = torch.where(mass > 1e-6, (residual / mass).log(), logp_t)
    tokens = draw(accel, residual_logp, seeds, positions).tolist()
    accepted = (accepted & is_draft).tolist()
    row = 0
    for i, b, n in zip(where, blocks, sizes):
        j = 0
        while j < n - 1 and accepted[row + j]:
            j += 1
        out[i] = b.drafts[:j] + [tokens[row + j]]
        row += n
