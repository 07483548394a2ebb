"""Continuous batching: chunked prefill under a token budget mixed with decodes,
admission by free slots and pages, preemption by recompute, oldest first.
A request starts after the longest prefix the cache holds (core/prefix_replay.py); a preempted one
leaves its full pages in that cache, so it usually comes back by a bounded replay."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from deepinfer.core.cache import StateCache
from deepinfer.core.prefix_replay import OFF, BoundedReplay
from deepinfer.core.request import Request, Status


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # positions fed this step, from request.num_computed

    @property
    def completes(self) -> bool:
        """The chunk reaches the newest token: the step samples the request's next token."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, cache: StateCache, max_num_seqs: int, max_num_batched_tokens: int,
                 replay: BoundedReplay | None = None, kv_store=None):
        self.cache = cache
        self.kv_store = kv_store  # kv/tiered.py's TieredKVStore: extends hits from host memory and a page store
        self.replay = replay if replay is not None else BoundedReplay(OFF, 0, cache)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: the oldest is served first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.pending and (len(req.output_token_ids) >= req.params.max_tokens or
                                req.num_tokens >= self.cache.max_model_len):
                i += 1  # its in-flight token is its last: it finishes by length when that resolves
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self.cache.can_grow(req.slot, req.num_computed + n):
                self._preempt(self.running[-1])  # the newest request gives way
                if req.status is not Status.RUNNING:
                    break
            if req.status is not Status.RUNNING:
                break
            self.cache.grow(req.slot, req.num_computed + n)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
            i += 1
        fetching = []  # requests whose next pages are being read from the KV store: they wait, others go
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.cache.num_free_slots:
            req = self.waiting[0]
            if self.kv_store is not None and not self.kv_store.ready(req):
                fetching.append(self.waiting.popleft())
                continue
            resume = self.replay.plan(req)
            n = min(req.num_tokens - resume.start, budget)
            if not self.cache.can_admit(resume.pages, resume.start + n):
                break
            self.waiting.popleft()
            req.slot = self.cache.allocate_slot(resume.pages)
            self.replay.admit(req, resume)
            req.status = Status.RUNNING
            self.cache.grow(req.slot, req.num_computed + n)
            bisect.insort(self.running, req, key=lambda r: r.metrics.arrival_time)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        self.waiting.extendleft(reversed(fetching))
        return chunks

    def _preempt(self, req: Request) -> None:
        """Drop the request's slot; its full pages stay in the prefix cache while no one needs
        them, and it recomputes from where that cache's prefix ends when readmitted."""
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.cache.release(req.slot, self.replay.computed_page_keys(req), req)
            req.slot = None

    def detach(self, req: Request) -> None:
        """Take a finished request out of the batch but keep its slot and pages (a prefill worker holds
        them until decode has them: kv/disagg_prefill.py); `release` frees them later."""
        self.running.remove(req)

    def resume(self, req: Request) -> None:
        """Run a request whose slot, pages and state were filled elsewhere (a decode worker's transfer)."""
        req.status = Status.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.metrics.arrival_time)

    def release(self, req: Request) -> None:
        """Free the slot and pages of a request the scheduler no longer runs."""
        self._release(req)

    def finish(self, req: Request) -> None:
        """Free a finished or aborted request's slot and pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            if self.kv_store is not None:
                self.kv_store.forget(req)
        self._release(req)
