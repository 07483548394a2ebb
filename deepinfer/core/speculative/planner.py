"""How many drafts each request verifies: DSpark's confidence-scheduled verification length
(DEEPINFER_ENABLE_MTP_VARLEN), or a fixed one.

Fixed: every request verifies min(max_draft, its cap). Dynamic (DEEPINFER_ENABLE_MTP_VARLEN=1):
1. the total budget K of draft tokens maximises expected tokens per second,
   (R + sum of the K largest lagged survivals) / (forward(R + K) + drafter(R) if K else forward(R)),
   where the survivals are
   each request's prefix-survival probabilities a_j = prod_{i<=j} c_i from its previous draft
   step (a new request counts as 1.0), so the budget never waits for this step's drafter;
2. the K slots go to the K largest current survivals; survival is non-increasing along a block,
   so each request gets a prefix.
Upstream lags the budget by two steps because its drafter runs asynchronously; our drafting
steps are synchronous, so the freshest lagged value is the previous step's.

Both inputs are corrected online. The profiled costs miss what the profile cannot see (the engine's
planning and post-processing, caches colder than in a tight loop): measured decode steps scale the
plain and the drafting cost separately (`observe_step`). The drafter's confidences are calibrated on
its training text: the tokens actually accepted scale the survivals (`observe_acceptance`).
Both corrections are running means over recent steps (weight 0.1 each).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from pathlib import Path

import torch


def _interpolate(xs: list[int], ys: list[float], x: int) -> float:
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class StepCost:
    """Seconds of one target forward for a batch of `tokens` verify tokens, and of the drafter
    for `seqs` sequences, piecewise linear between profiled points."""

    def __init__(self, tokens: list[int], seconds: list[float], seqs: list[int] | None = None,
                 drafter_seconds: list[float] | None = None):
        self.tokens, self.seconds = tokens, seconds
        self.seqs, self.drafter_seconds = seqs or [1], drafter_seconds or [0.0]

    def __call__(self, tokens: int) -> float:
        return _interpolate(self.tokens, self.seconds, tokens)

    def drafter(self, seqs: int) -> float:
        return _interpolate(self.seqs, self.drafter_seconds, seqs)


def profile_grid(max_tokens: int) -> list[int]:
    grid, t = [], 1
    while t < max_tokens:
        grid.append(t)
        t = t * 2 if t < 8 else int(t * 1.5)
    return grid + [max_tokens]


def cached_step_cost(key: dict, measure, cache_dir: str) -> StepCost:
    """The profile for `key` from DEEPINFER_DECODE_PERF_CACHE_DIR, or `measure()` -> (tokens, seconds)
    written there. The key names everything the timing depends on (model config, backend, shape)."""
    root = Path(cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer", "decode_perf"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = root / f"step_cost_{digest}.json"
    fields = ("tokens", "seconds", "seqs", "drafter_seconds")
    try:
        data = json.loads(path.read_text())
        return StepCost(*(data[f] for f in fields))
    except (OSError, ValueError, KeyError):
        pass
    measured = measure()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, **dict(zip(fields, measured))}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache dir only costs a re-profile next start
    return StepCost(*measured)


def time_call(fn, repeats: int = 3) -> float:
    """Median wall time of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


_EMA = 0.1  # weight of the newest observation in the online corrections


def _running_mean(old: float, new: float, low: float, high: float) -> float:
    return min(max(old + _EMA * (new - old), low), high)


class VerifyLengthPlanner:
    def __init__(self, max_draft: int, cost: StepCost | None):
        self.max_draft = max_draft
        self.cost = cost  # None = fixed length
        self.lagged: dict[str, list[float]] = {}  # request id -> survivals of its previous draft step
        # measured / profiled seconds of plain and of drafting decode steps; accepted / predicted drafts
        self.plain_scale, self.draft_scale, self.acceptance_scale = 1.0, 1.0, 1.0

    def observe_step(self, drafted: bool, tokens: int, seqs: int, seconds: float) -> None:
        """A decode step's wall time: `tokens` target tokens for `seqs` sequences, with the drafter if `drafted`."""
        if self.cost is None or tokens <= 0:
            return
        if drafted:
            predicted = self.cost(tokens) + self.cost.drafter(seqs)
            self.draft_scale = _running_mean(self.draft_scale, seconds / predicted, 0.25, 8.0)
        else:
            self.plain_scale = _running_mean(self.plain_scale, seconds / self.cost(tokens), 0.25, 8.0)

    def observe_acceptance(self, predicted: float, accepted: int) -> None:
        """One verified draft: `predicted` = the sum of its survivals, `accepted` = drafts kept."""
        if self.cost is not None and predicted > 0:
            self.acceptance_scale = _running_mean(self.acceptance_scale, accepted / predicted, 0.05, 2.0)

    def budget(self, request_ids: list[str], caps: list[int]) -> int:
        """Draft tokens to verify this step, from the lagged survivals only: known before the
        drafter runs, so a step whose budget is 0 skips the drafter altogether."""
        caps = [min(c, self.max_draft) for c in caps]
        if self.cost is None:
            return sum(caps)
        lagged = [a for rid, cap in zip(request_ids, caps) for a in self.lagged.get(rid, [1.0] * cap)[:cap]]
        return self._budget(len(request_ids), sorted(lagged, reverse=True))

    def lengths(self, request_ids: list[str], survival: torch.Tensor, caps: list[int],
                budget: int | None = None) -> list[int]:
        """survival [B, >= max cap] (current), caps [B] (most drafts each request may verify)."""
        if budget is None:
            budget = self.budget(request_ids, caps)
        caps = [min(c, self.max_draft) for c in caps]
        if self.cost is None:
            return caps
        current = survival.tolist()
        for rid, row in zip(request_ids, current):
            self.lagged[rid] = row
        # top-`budget` of the current survivals; ties go to the earlier slot so each request keeps a prefix
        ranked = sorted(((-row[j], j, r) for r, (row, cap) in enumerate(zip(current, caps)) for j in range(cap)))
        out = [0] * len(caps)
        for _, _, r in ranked[:budget]:
            out[r] += 1
        return out

    def _budget(self, num_requests: int, survivals: list[float]) -> int:
        # no drafts = a plain decode step; any draft adds the drafter's cost for every request
        plain = self.cost(num_requests) * self.plain_scale
        best, best_rate, expected = 0, num_requests / plain, float(num_requests)
        drafter = self.cost.drafter(num_requests)
        for k, a in enumerate(survivals, start=1):
            expected += min(a * self.acceptance_scale, 1.0)
            rate = expected / ((self.cost(num_requests + k) + drafter) * self.draft_scale)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def forget(self, request_id: str) -> None:
        self.lagged.pop(request_id, None)
