"""What the engine thread hands the event loop: per-request deltas, gathered per HTTP request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True)
class Delta:
    """What one engine request produced since its previous delta."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per token: sampled token first, then the top ones
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_logprobs: list | None = None  # with the first delta, when asked for (prefill is done by then)

    def merge(self, later: "Delta") -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.finished:
            self.finished, self.finish_reason, self.stop_reason = True, later.finish_reason, later.stop_reason
            self.error = later.error


def next_delta(live, req, now: float) -> Delta | None:
    """What engine request `req` produced since `live` (anything with sent_tokens, sent_text,
    holdback and first_token_time) last sent, advancing `live`; None when nothing changed. Text is
    the engine's incrementally detokenized text; with stop strings the last `holdback` characters
    wait until they cannot turn into a stop. The first delta carries the prompt logprobs; `now`
    (perf_counter seconds) becomes `live.first_token_time` once a token is out."""
    resolved = len(req.output_token_ids) - req.pending
    done = req.is_finished
    if resolved == live.sent_tokens and not done:
        return None
    end = len(req.text) if done else max(live.sent_text, len(req.text) - live.holdback)
    delta = Delta(text=req.text[live.sent_text:end], token_ids=req.output_token_ids[live.sent_tokens:resolved])
    if req.output_logprobs is not None:
        delta.logprobs = req.output_logprobs[live.sent_tokens:resolved]
    if live.first_token_time is None:
        delta.prompt_logprobs = req.prompt_logprobs
        if resolved:
            live.first_token_time = now
    live.sent_tokens, live.sent_text = resolved, end
    if done:
        delta.finished, delta.finish_reason, delta.stop_reason = True, req.finish_reason, req.stop_reason
        delta.error = req.error
    return delta


class RequestGroup:
    """The engine requests of one HTTP request (n choices, or several prompts), whose deltas
    arrive, tagged with their index, on one queue owned by the event loop."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = [False] * len(request_ids)

    @property
    def finished(self) -> bool:
        return all(self.done)

    async def deltas(self):
        """(index, delta) until every request finished; deltas that queued up while the
        consumer was busy come merged, one per index."""
        while not self.finished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            merged: dict[int, Delta] = {}
            for item in batch:
                if isinstance(item, BaseException):
                    raise item
                index, delta = item
                if index in merged:
                    merged[index].merge(delta)
                else:
                    merged[index] = delta
                self.done[index] = self.done[index] or delta.finished
            for index in sorted(merged):
                yield index, merged[index]
