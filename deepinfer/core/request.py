"""A request and its sequence state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import itertools
import time

from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                 request_id: str | None = None, mm_items: list | None = None):
        self.request_id = request_id if request_id is not None else str(next(_ids))
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        # multimodal spans of the prompt (models/base.py MultimodalItem, in prompt order); each keeps its
        # encoder output once computed, for the request's life
        self.mm_items = list(mm_items or ())
        self.params = params
        self.seed = params.resolved_seed()
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] | None = [] if params.top_logprobs else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.status = Status.WAITING
        self.slot: int | None = None
        self.num_computed = 0  # positions whose decode state is in the cache
        # after a prefix-cache hit (core/replay.py): window keys below window_floor are missing,
        # and the compressed state of the first num_restored positions came from the cache
        self.window_floor = 0
        self.num_restored = 0
        self.page_keys: list[bytes] = []  # prefix-cache keys of its full pages, memoized
        self.pending = 0  # trailing output entries that are placeholders for tokens still being sampled
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.detok = None  # incremental detokenizer state, owned by the engine
        self.grammar = None  # structured-output state (core/structured.py RequestGrammar), owned by the engine
        self.bad_words_ids: list[list[int]] = []  # params.bad_words as token sequences (the engine tokenizes them)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if start >= n:  # decode: no copy of the whole history per step
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(end - n, 0)]

    def mm_spans(self) -> list[tuple[int, int, bytes]]:
        """(first position, end, digest) of each multimodal span: what the prefix cache keys besides tokens."""
        return [(item.offset, item.end, item.digest) for item in self.mm_items]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def finish(self, reason: str, stop_reason: str | int | None = None, error: str | None = None) -> None:
        if self.pending:  # tokens of steps still in flight are discarded with the request
            del self.output_token_ids[-self.pending:]
            self.pending = 0
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.metrics.finished_time = time.perf_counter()

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.text, list(self.output_token_ids), self.output_logprobs,
                                      self.finish_reason, self.stop_reason, self.error)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
                             [completion], self.is_finished, self.metrics)
