"""A request and its sequence state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import itertools
import time

from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams

_ids = itertools.count()

# the stop_reason of a request aborted because its decode state never came from its prefill worker
# (prefill/decode disaggregation): an upstream failure, not a fault of the request
KV_TRANSFER_FAILED = "kv_transfer_failed"


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
        # after a prefix-cache hit (core/prefix_replay.py): window keys below window_floor are missing,
        # and the compressed state of the first num_restored positions came from the cache
        self.window_floor = 0
        self.num_restored = 0
        self.page_keys: list[bytes] = []  # prefix-cache keys of its full pages, memoized
        self.store_looked_up = False  # its prefix was looked up in the KV store's page store (kv/tiered.py)
        self.pending = 0  # trailing output entries that are placeholders for tokens still being sampled
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.detok = None  # incremental detokenizer state, owned by the engine
        self.grammar = None  # structured-output state (core/structured.py RequestGrammar), owned by the engine
        self.bad_words_ids: list[list[int]] = []  # params.bad_words as token sequences (the engine tokenizes them)
        # prefill/decode disaggregation (kv/disagg.py Bootstrap): the prefill worker's bootstrap server and
        # this request's room there; None: the request runs here from its prompt
        self.disagg = None

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


def validate_request(prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                     cache, placeholders: dict[str, int], has_tokenizer: bool, what: str = "prompt",
                     mm_items=()) -> None:
    """Raise a clear ValueError for a request an engine with this model and `cache` could never serve."""
    if not prompt_token_ids:
        raise ValueError(f"{what} is empty: give at least one token (or non-empty text)")
    vocab = vocab_size
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} has token ids outside [0, vocab_size={vocab}): {bad[:5]}")
    marks = set(placeholders.values())
    if marks and not mm_items and not marks.isdisjoint(prompt_token_ids):  # a span with nothing to fill it
        raise ValueError(f"{what} holds the model's multimodal placeholder token(s) "
                         f"{sorted(marks.intersection(prompt_token_ids))} but no multi_modal_data: give one image "
                         "per placeholder in multi_modal_data, or remove the placeholders")
    if len(prompt_token_ids) >= max_model_len:
        of_which, fewer = "", ""
        if mm_items:  # an image's span is fixed by the model's token budget: fewer images, or a longer context
            of_which = f" ({sum(i.length for i in mm_items)} of them for its {len(mm_items)} multimodal item(s))"
            fewer = ", send fewer images"
        raise ValueError(f"{what} has {len(prompt_token_ids)} tokens{of_which}; max_model_len={max_model_len} "
                         f"leaves no room to generate: shorten the prompt{fewer} or raise max_model_len")
    longest = min(len(prompt_token_ids) + params.max_tokens, max_model_len)
    if cache.pages_for(longest) > cache.num_pages:
        raise ValueError(f"a request of {longest} tokens needs {cache.pages_for(longest)} cache pages, "
                         f"the cache has {cache.num_pages}: raise cache_bytes or lower max_tokens")
    for name, ids in params.token_ids_to_check().items():
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ValueError(f"{name} has token ids outside [0, vocab_size={vocab}): {bad[:5]}")
    if params.bad_words and not has_tokenizer:
        raise ValueError("bad_words needs the model's tokenizer (this model directory has none): pass "
                         "tokenizer=..., or ban token ids with logit_bias {id: -100}")
