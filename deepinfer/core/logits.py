"""SamplingParams' logit adjustments (vLLM's meanings), applied on the device before `sample`:
allowed_token_ids (a bitmask), logit_bias + bad words + min_tokens' bans (one sparse bias),
repetition / frequency / presence penalties (per-request token counts on the device), min-p.
vLLM's order: the masks and the bias, then the penalties, then temperature's min-p.

A step whose requests ask for none of them builds and runs nothing here (`plan` returns None).
Penalized requests get a row of the `TokenCounts` pools for their life; the host only hands out
row numbers, and every tensor write happens in the step's device work, in step order, so a row
reused by a new request is reset after the old owner's last in-flight count."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from deepinfer.backends.base import Accelerator
from deepinfer.core.request import Request


class TokenCounts:
    """Device pools [C, V]: how often each token is in a request's output (int32) and whether it is
    in its prompt (bool), a row per penalized request. Host side: which request has which row."""

    def __init__(self, accel: Accelerator, vocab: int):
        self.accel, self.vocab = accel, vocab
        self.rows: dict[str, int] = {}
        self.free: list[int] = []
        self.capacity = 0  # rows handed out (host); the pools grow to it in the device work
        self.counts: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None

    def assign(self, req: Request, inits: list) -> int:
        """The request's row; a new row is queued in `inits` to be reset from its tokens."""
        row = self.rows.get(req.request_id)
        if row is None:
            row = self.free.pop() if self.free else self.capacity
            self.capacity = max(self.capacity, row + 1)
            self.rows[req.request_id] = row
            outputs = [t for t in req.output_token_ids if t >= 0]
            inits.append((row, torch.tensor(req.prompt_token_ids, dtype=torch.int64),
                          torch.tensor(outputs, dtype=torch.int64)))
        return row

    def release(self, req: Request) -> None:
        row = self.rows.pop(req.request_id, None)
        if row is not None:
            self.free.append(row)

    def prepare(self, capacity: int, inits: list) -> None:
        """Device work: grow the pools to `capacity` rows (keeping theirs), reset the new rows."""
        dev = self.accel.device
        have = 0 if self.counts is None else self.counts.shape[0]
        if capacity > have:
            size = max(capacity, 2 * have, 8)
            counts = torch.zeros(size, self.vocab, dtype=torch.int32, device=dev)
            prompt = torch.zeros(size, self.vocab, dtype=torch.bool, device=dev)
            if have:
                counts[:have], prompt[:have] = self.counts, self.prompt
            self.counts, self.prompt = counts, prompt
        for row, prompt_ids, output_ids in inits:
            self.counts[row].zero_()
            self.prompt[row].zero_()
            self.prompt[row, prompt_ids.to(dev)] = True
            if len(output_ids):
                self.accel.count_tokens(self.counts, torch.full_like(output_ids, row).to(dev), output_ids.to(dev))


@dataclasses.dataclass(slots=True)
class Adjustments:
    """What one step's sampled rows need, built on the host when the step is planned (None fields:
    no row asks for it)."""

    capacity: int = 0
    inits: list = dataclasses.field(default_factory=list)
    allowed: torch.Tensor | None = None  # [B, ceil(V/32)] int32 bitmask
    bias: tuple | None = None  # (token ids [B, K], values [B, K])
    penalty: tuple | None = None  # (pool rows [B], repetition, frequency, presence [B])
    min_p: tuple | None = None  # (min_p [B], temperature [B])

    def select(self, idx: torch.Tensor) -> "Adjustments":
        """The same for a subset of the rows (after `prepare` ran)."""
        take = lambda group: None if group is None else tuple(t[idx.to(t.device)] for t in group)  # noqa: E731
        return Adjustments(self.capacity, [], None if self.allowed is None else self.allowed[idx.to(self.allowed.device)],
                           take(self.bias), take(self.penalty), take(self.min_p))


def banned_after(history: list[int], bad_words: list[list[int]]) -> list[int]:
    """Tokens that would complete a bad word after `history` (vLLM: the output so far): the last token
    of each bad word whose other tokens end the history (every single-token bad word)."""
    out = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(history) >= len(prefix) and history[len(history) - len(prefix):] == prefix):
            out.append(word[-1])
    return out


def row_bias(req: Request, num_output: int, history: list[int], eos_ids) -> dict[int, float]:
    """One sampled row's sparse bias: logit_bias, bad words' and min_tokens' bans (-inf)."""
    p = req.params
    bias = dict(p.logit_bias or {})
    bans = banned_after(history, req.bad_words_ids) if req.bad_words_ids else []
    if num_output < p.min_tokens:  # nothing may end the output yet
        bans += list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(eos_ids))
    for t in bans:
        bias[t] = float("-inf")
    return bias


def allowed_bitmask(allowed: list[int] | None, words: int) -> np.ndarray:
    """xgrammar's layout: bit v of word v // 32 set where token v may be sampled (all set: no limit)."""
    if allowed is None:
        return np.full(words, -1, dtype=np.int32)
    ids = np.asarray(sorted(set(allowed)), dtype=np.int64)
    mask = np.zeros(words, dtype=np.uint32)
    np.bitwise_or.at(mask, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return mask.view(np.int32)


def plan(rows: list[tuple[Request, int, list[int]]], counts: TokenCounts | None, vocab: int, eos_ids,
         device: torch.device) -> Adjustments | None:
    """Adjustments of sampled rows (request, output tokens before the row's token, the row's output
    history: resolved tokens and drafts before it), or None when no row asks for any. `counts` None:
    the rows' penalties read per-row pools the caller builds (DSpark's draft positions)."""
    if not any(req.params.adjusts_logits for req, _, _ in rows):
        return None
    adj = Adjustments()
    params = [req.params for req, _, _ in rows]
    if any(p.allowed_token_ids is not None for p in params):
        words = (vocab + 31) // 32
        adj.allowed = torch.from_numpy(np.stack([allowed_bitmask(p.allowed_token_ids, words) for p in params])).to(device)
    biases = [row_bias(req, n_out, history, eos_ids) for req, n_out, history in rows]
    width = max(len(b) for b in biases)
    if width:
        ids = np.full((len(rows), width), -1, dtype=np.int64)
        values = np.zeros((len(rows), width), dtype=np.float32)
        for r, b in enumerate(biases):
            ids[r, :len(b)] = list(b)
            values[r, :len(b)] = list(b.values())
        adj.bias = (torch.from_numpy(ids).to(device), torch.from_numpy(values).to(device))
    if any(p.has_penalties for p in params):
        if counts is not None:
            pool_rows = [counts.assign(req, adj.inits) if req.params.has_penalties else -1 for req, _, _ in rows]
            adj.capacity = counts.capacity
        else:
            pool_rows = [r if p.has_penalties else -1 for r, p in enumerate(params)]
        adj.penalty = (torch.tensor(pool_rows, dtype=torch.int64, device=device),
                       *(torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
                         for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")))
    if any(p.min_p > 0 for p in params):
        adj.min_p = (torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
                     torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device))
    return adj


def apply(accel: Accelerator, logits: torch.Tensor, adj: Adjustments, counts: torch.Tensor | None,
          prompt: torch.Tensor | None) -> torch.Tensor:
    """The adjusted logits [B, V] (a new tensor; `logits` is not written)."""
    logits = logits.float()
    if adj.allowed is not None:
        logits = logits.clone()
        accel.apply_token_bitmask(logits, adj.allowed)
    if adj.bias is not None:
        logits = accel.apply_logit_bias(logits, *adj.bias)
    if adj.penalty is not None:
        logits = accel.apply_penalties(logits, counts, prompt, *adj.penalty)
    if adj.min_p is not None:
        logits = accel.apply_min_p(logits, *adj.min_p)
    return logits


def draft_pools(base_counts: torch.Tensor, base_prompt: torch.Tensor, drafts: list[int], accel: Accelerator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per verified position j (0..len(drafts)): the request's counts as if drafts[:j] were accepted,
    [L+1, V] pools whose row j penalizes target row j (the distribution a plain step would sample)."""
    n = len(drafts) + 1
    counts = base_counts.unsqueeze(0).repeat(n, 1).contiguous()
    pairs = [(j, drafts[i]) for j in range(1, n) for i in range(j)]
    if pairs:
        dev = counts.device
        accel.count_tokens(counts, torch.tensor([j for j, _ in pairs], dtype=torch.int64, device=dev),
                           torch.tensor([t for _, t in pairs], dtype=torch.int64, device=dev))
    return counts, base_prompt.unsqueeze(0).expand(n, -1).contiguous()
