"""Bounded replay: where a sequence starts computing when the prefix cache holds its first H
positions (a hit at H, or a preempted sequence coming back).

The cache restores the model's paged state of [0, H) (pages are whole, so H is a multiple of
the page size and of every pool's stride). A model whose paged state is its whole decode state
(replay_window 0, e.g. an MLA latent cache) is restored exactly: it starts computing at H. What a
prefix cache does not hold is per-slot state: for DeepSeek-V4 each layer's sliding-window ring and
the compressors' raw projections of the last tokens (the CSA overlap reads the `rate` tokens before
H for the first entry after H). Replay rebuilds it, per DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE:

- compact: recompute only the last KEEP positions before H, then the rest of the prompt as
  usual. Replayed tokens attend to the restored entries but to no window key before H-KEEP
  (they were never computed), so early replayed tokens miss part of their window in every
  layer: approximate by design. Paged state before H is never rewritten: the pages are shared.
- mask: the same approximation, computed as a full recompute from position 0 in which the
  tokens from H-KEEP on are masked from every window key before H-KEEP (and entries before H
  are still the restored ones). Slow; it exists to check that compact computes what it claims.
- off: exact. A hit is looked up and counted but restores nothing: the sequence recomputes
  from position 0 into pages of its own, so outputs equal a cold run.

KEEP >= the model's window + DEEPINFER_MAX_BACKTRACKING_TOKENS, so replay refills every row of a
window ring (which keeps the window plus the rollback margin).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer import envs
from deepinfer.core.cache import StateCache
from deepinfer.core.request import Request

OFF, COMPACT = "off", "compact"  # and "mask"
EXACT = "exact"  # a model whose paged state is its whole decode state: a hit restores everything


@dataclass(slots=True)
class Resume:
    """Where an admitted request starts: cached pages it takes over and its first computed position."""

    pages: list[int] = field(default_factory=list)
    start: int = 0  # first position computed
    window_floor: int = 0  # window keys below it are not in the rings (tokens from it on must not read them)
    num_restored: int = 0  # positions whose compressed state the pages hold
    found: int = 0  # positions the cache held (also in mode off, which does not use them)


class BoundedReplay:
    def __init__(self, mode: str, keep: int, cache: StateCache):
        self.mode, self.keep, self.cache = mode, keep, cache

    @classmethod
    def from_env(cls, window: int, cache: StateCache) -> "BoundedReplay":
        """Read and check the replay settings at start-up. `window`: positions of per-sequence state
        the prefix cache does not hold (the model's replay_window); 0: hits are exact, nothing is
        replayed, and the settings do not apply."""
        if window == 0:
            return cls(EXACT, 0, cache)
        mode = envs.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
        keep = envs.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")
        need = window + envs.max_backtracking_tokens()
        if mode != OFF and keep < need:
            raise envs.EnvError(
                f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS={keep} is below sliding window ({window}) + "
                f"max backtracking tokens ({envs.max_backtracking_tokens()}) = {need}: replay after a prefix-cache "
                f"hit would leave part of the window rings unbuilt. Set DEEPINFER_YOCO_PREFILL_KEEP_TOKENS>={need} "
                "(default 140), lower DEEPINFER_MAX_BACKTRACKING_TOKENS, or set "
                "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=off")
        return cls(mode, keep, cache)

    def plan(self, req: Request) -> Resume:
        """Look `req`'s prefix up (it keeps at least its last token to compute, for its logits)."""
        prefix = self.cache.prefix
        if prefix is None:
            return Resume()
        req.page_keys = prefix.keys(req.page_keys, req.tokens(0, req.num_tokens - 1), req.mm_spans())
        return self._resume(prefix.match(req.page_keys))

    def probe(self, prompt_token_ids: list[int], spans: list[tuple[int, int, bytes]]) -> int:
        """The first position a new prompt would compute were it admitted now (`plan` without a
        request): a read-only look-up, safe from any thread (the cache's reads are dict look-ups);
        the cache may change before the prompt is admitted."""
        prefix = self.cache.prefix
        if prefix is None:
            return 0
        return self._resume(prefix.match(prefix.keys([], prompt_token_ids[:-1], spans))).start

    def _resume(self, pages: list[int]) -> Resume:
        hit = len(pages) * self.cache.prefix.page_tokens
        if not pages or self.mode == OFF:
            return Resume(found=hit)
        if self.mode == EXACT:
            return Resume(pages, hit, 0, hit, hit)
        floor = max(hit - self.keep, 0)
        start = floor if self.mode == COMPACT else 0  # mask: a full recompute under the same floor
        return Resume(pages, start, floor, hit, hit)

    def computed_page_keys(self, req: Request) -> list[bytes]:
        """Keys of `req`'s full pages whose state is computed: what its release leaves cached."""
        prefix = self.cache.prefix
        if prefix is None:
            return []
        computed = min(req.num_computed, req.num_tokens)  # an abort may drop fed placeholders
        req.page_keys = prefix.keys(req.page_keys, req.tokens(0, computed), req.mm_spans())
        return req.page_keys[:computed // prefix.page_tokens]

    def admit(self, req: Request, resume: Resume) -> None:
        """`req` was admitted as `resume` says: set its sequence state and count the lookup."""
        req.num_computed, req.window_floor, req.num_restored = resume.start, resume.window_floor, resume.num_restored
        stats = self.cache.prefix.stats if self.cache.prefix is not None else None
        if stats is not None:
            stats.queries += 1
            stats.hits += resume.found > 0
            stats.query_tokens += req.num_tokens
            stats.hit_tokens += resume.found
            stats.replayed_tokens += max(resume.num_restored - resume.start, 0)
