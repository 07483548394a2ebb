"""The engine thread's side of prefill/decode disaggregation: what happens to a request whose prompt
and decode run on different workers (docs/disaggregation.md). The role objects (kv/disagg_prefill.py,
kv/disagg_decode.py) move the state between workers on their own threads; this module keeps the
requests, slots and pages of the engine, which only the engine thread touches.

- prefill: a request that finished its first token keeps its slot and pages (`held`) until decode
  has its state or never will (`release_held`).
- decode: a request whose prompt runs on the prefill worker waits for a slot and pages (`arriving`),
  then for its state (`receiving`), then decodes here as if its prompt had run here (`kv_arrived`)."""

from __future__ import annotations

import collections
import time
from typing import Callable

from deepinfer.core.request import KV_TRANSFER_FAILED, Request

NOT_DISAGGREGATED = ("bootstrap_room: this worker is not disaggregated; start it with --disaggregation-mode prefill or "
                     "decode (docs/disaggregation.md), or send the request without bootstrap_host, bootstrap_port and "
                     "bootstrap_room")


def check_disaggregated(disagg: DisaggregatedRequests | None, params, mm_items) -> None:
    """Raise a clear ValueError for a request this worker cannot serve across prefill and decode.
    Images are served: their positions' state moves like any other, and decode lays them out only
    to key its prefix cache (it never encodes them)."""
    if disagg is None:
        raise ValueError(NOT_DISAGGREGATED)
    if params.so_args is not None or params.adjusts_logits:
        raise ValueError("a disaggregated request takes plain sampling (temperature, top_p, top_k, seed, stop, "
                         "max_tokens): structured outputs, penalties, logit_bias and bad_words are not served "
                         "across prefill and decode yet; send it to a colocated worker")


class DisaggregatedRequests:
    """A disaggregated worker's requests. `role` is kv/disagg.py make_role's object; the engine
    lends its cache, scheduler and post-processor, `retire(req)` (free a finished request) and
    `publish()` (send the step's KV events)."""

    def __init__(self, role, cache, scheduler, post, retire: Callable[[Request], None], publish: Callable[[], None]):
        self.role, self.mode = role, role.mode
        self.cache, self.scheduler, self.post, self.retire, self.publish = cache, scheduler, post, retire, publish
        self.held: dict[str, Request] = {}  # prefill: finished requests whose slot and pages decode has not taken
        self.arriving: collections.deque[Request] = collections.deque()  # decode: waiting for a slot and pages
        self.receiving: dict[str, Request] = {}  # decode: slot and pages reserved, state on its way from prefill

    def add(self, req: Request) -> bool:
        """Take a new request; True when it is taken here (decode: its prompt runs on the prefill
        worker), False when the scheduler runs it."""
        if self.mode != "decode":
            return False
        self.arriving.append(req)
        self.admit_arriving()
        return True

    def abort(self, req: Request) -> bool:
        """Abort a request; True when it is done with (no scheduler state)."""
        if self.mode == "prefill":
            self.role.dropped(req)  # still prefilling: decode hears of it now, not at its timeout
            return False
        if req in self.arriving:  # nothing reserved yet
            self.arriving.remove(req)
        elif req.request_id in self.receiving:  # pages are freed once prefill can no longer write into them
            self.role.cancel(req)
        else:  # decoding here: a plain abort
            return False
        req.finish("abort")
        return True

    def hold(self, req: Request) -> bool:
        """Prefill: keep a finished request's slot and pages until decode has them (release_held);
        True when they are kept, False when the scheduler frees them now."""
        if self.mode != "prefill" or req.slot is None:
            return False
        self.scheduler.detach(req)
        self.held[req.request_id] = req
        self.role.hold(req)
        return True

    def release_held(self, request_id: str) -> None:
        """Prefill: decode has the request's state (or will never take it): free its slot and pages."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.scheduler.release(req)
            self.publish()

    def admit_arriving(self) -> None:
        """Decode: reserve a slot and pages for each arriving request while they fit, and ask its
        prefill worker for its state. Leading pages this cache already holds for the prompt are kept
        (not asked for): the prompt's paged state is a function of its tokens."""
        cache = self.cache
        while self.arriving and cache.num_free_slots:
            req = self.arriving[0]
            prompt = req.num_prompt_tokens
            cached = []
            if cache.prefix is not None:
                req.page_keys = cache.prefix.keys(req.page_keys, req.tokens(0, prompt), req.mm_spans())
                cached = cache.prefix.match(req.page_keys[:prompt // cache.page_tokens])
            if not cache.can_admit(cached, prompt):
                return
            self.arriving.popleft()
            req.slot = cache.allocate_slot(cached)
            cache.grow(req.slot, prompt)
            req.num_computed = len(cached) * cache.page_tokens  # what holds valid state (a release caches it)
            self.receiving[req.request_id] = req
            self.role.receive(req, list(cache.slot_pages[req.slot]), len(cached))

    def kv_arrived(self, request_id: str, result: dict | None, error: str | None) -> None:
        """Decode: prefill's answer for a receiving request (`result`: first token, logprobs, bytes), or
        why there is none. The request then decodes here, or fails with `error`."""
        req = self.receiving.pop(request_id, None)
        if req is None:
            return
        if req.is_finished or error is not None:
            self.scheduler.release(req)
            if not req.is_finished:
                req.finish("abort", KV_TRANSFER_FAILED, error=error)
            self.admit_arriving()
            return
        req.num_computed = req.num_prompt_tokens
        token = result["first_token"]
        req.output_token_ids.append(token)
        if req.output_logprobs is not None and result.get("logprobs"):
            req.output_logprobs.append({int(t): v for t, v in result["logprobs"].items()})
        req.metrics.first_token_time = req.metrics.first_scheduled_time = time.perf_counter()
        self.post.check_stop(req, token)
        if req.is_finished:
            self.retire(req)
        else:
            self.scheduler.resume(req)
        self.admit_arriving()

    def close(self) -> None:
        self.role.close()
