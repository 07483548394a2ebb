"""POST /v1/completions: prompts as text, a list of texts, token ids or lists of them; `n`
choices each (choice index = prompt index * n + i); streaming; echo; logprobs."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse

from deepinfer.core.tokenizer import Tokenizer
from deepinfer.entrypoints.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, \
    CompletionResponse, UsageInfo
from deepinfer.entrypoints.serving import REQUEST_ID, APIError, EventStream, ServerState, bootstrap_of, collect, \
    delta_error, event_stream, kv_transfer_answer, make_params, sse, sse_error, submit, unless_disconnected

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _prompts(prompt, tokenizer: Tokenizer) -> list[tuple[list[int], str]]:
    """(token ids, text) per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not p:
                raise APIError(400, f"prompt[{i}] is empty", "prompt")
            out.append((tokenizer.encode(p), p))
        else:
            out.append((list(p), tokenizer.decode(list(p))))
    return out


class LogprobWriter:
    """OpenAI's completion logprobs for a choice, built delta by delta (offsets run on)."""

    def __init__(self, tokenizer: Tokenizer, k: int):
        self.tokenizer, self.k, self.offset = tokenizer, k, 0

    def write(self, token_ids: list[int], entries: list, out: CompletionLogprobs | None = None) -> CompletionLogprobs:
        out = out or CompletionLogprobs()
        for token, entry in zip(token_ids, entries):
            text = self.tokenizer.decode([token])
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry[token])
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.k]
            out.top_logprobs.append({self.tokenizer.decode([t]): v for t, v in top})
        return out


async def create_completion(body: CompletionRequest, request: Request, state: ServerState):
    arrival = time.perf_counter()
    state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix", "unsupported_parameter")
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of must be left out or equal n", "best_of", "unsupported_parameter")
    tokenizer = state.engine.tokenizer
    prompts = _prompts(body.prompt, tokenizer)
    k = body.logprobs
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    # logprobs=0 still wants the sampled token's logprob: the engine records it with top_logprobs >= 1
    params = make_params(body, body.n, max_tokens=max_tokens, max_tokens_field="max_tokens",
                         top_logprobs=0 if k is None else max(k, 1),
                         prompt_logprobs=k if k is not None and body.echo else None, so_args=body.so_args)
    items = [(ids, p, text) for ids, text in prompts for p in params]
    room = bootstrap_of(body, len(items), state)
    group = await submit(state, items, "prompt", arrival, "max_tokens", "so_args", body.data_parallel_rank, room)
    rid = f"cmpl-{REQUEST_ID.get()}"
    writers = [LogprobWriter(tokenizer, k) if k is not None else None for _ in items]
    if body.stream:
        return EventStream(event_stream(state, group, _stream(body, state, group, rid, items, writers)))
    results = await unless_disconnected(request, collect(state, group))
    if results is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    choices = []
    for i, ((ids, _, text), res, writer) in enumerate(zip(items, results, writers)):
        logprobs = None
        if writer is not None:
            if body.echo:
                logprobs = writer.write(ids, res.prompt_logprobs or [None] * len(ids))
            logprobs = writer.write(res.token_ids, res.logprobs or [], logprobs)
        choices.append(CompletionChoice(index=i, text=(text if body.echo else "") + res.text, logprobs=logprobs,
                                        finish_reason=res.finish_reason, stop_reason=res.stop_reason))
    return CompletionResponse(id=rid, model=body.model, choices=choices, usage=_usage(prompts, body.n, results),
                              kv_transfer_params=kv_transfer_answer(body, state, room))


def _usage(prompts, n: int, results) -> UsageInfo:
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    completion = sum(len(r.token_ids) for r in results)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


async def _stream(body: CompletionRequest, state: ServerState, group, rid: str, items, writers):
    created = int(time.time())
    counts = [0] * len(items)
    echoed = [not body.echo] * len(items)

    def chunk(choice: CompletionChoice, usage=None) -> str:
        return sse(CompletionResponse(id=rid, created=created, model=body.model,
                                      choices=[choice] if choice else [], usage=usage))

    async for index, delta in group.deltas():
        if delta.error:  # its grammar did not compile in time, or its prefill worker failed
            yield sse_error(delta_error(delta, "so_args"))
        ids, _, prompt_text = items[index]
        text, logprobs, writer = delta.text, None, writers[index]
        if not echoed[index]:  # the prompt comes first, with the first delta (which has its logprobs)
            echoed[index] = True
            text = prompt_text + text
            if writer is not None:
                logprobs = writer.write(ids, delta.prompt_logprobs or [None] * len(ids))
        if writer is not None and delta.token_ids:
            logprobs = writer.write(delta.token_ids, delta.logprobs or [], logprobs)
        counts[index] += len(delta.token_ids)
        yield chunk(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                     finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
    if body.stream_options and body.stream_options.include_usage:
        prompt_tokens = sum(len(ids) for ids, _, _ in items[::body.n])
        yield chunk(None, UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=sum(counts),
                                    total_tokens=prompt_tokens + sum(counts)))
