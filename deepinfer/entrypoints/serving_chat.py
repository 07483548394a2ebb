"""POST /v1/chat/completions: messages -> prompt through the model's chat format; its output
-> content, reasoning_content and tool_calls through the format's parser, the same parser for
streamed and whole responses (so joined deltas equal the whole message). Image parts (data: URIs)
go to a model with a vision encoder (chat_images.py)."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse

from deepinfer.core.tokenizer import Tokenizer
from deepinfer.entrypoints.chat import ChatDelta, ChatFormatError
from deepinfer.entrypoints.chat_images import lay_out_images, place_images
from deepinfer.entrypoints.protocol import AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, \
    ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, DeltaMessage, FunctionCall, TokenLogprob, \
    ToolCallDelta, ToolCallOut, TopLogprob, UsageInfo
from deepinfer.entrypoints.serving import REQUEST_ID, APIError, EventStream, ServerState, bootstrap_of, collect, \
    delta_error, event_stream, kv_transfer_answer, make_params, sse, sse_error, submit, unless_disconnected


def _so_args(body: ChatCompletionRequest) -> tuple[dict | None, str]:
    """so_args and the field it came from: `response_format`, or deepinfer's own `so_args`."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return body.so_args, "so_args"
    if body.so_args is not None:
        raise APIError(400, "give response_format or so_args, not both", "so_args")
    if fmt.type == "json_object":
        return {"schema_type": "json", "schema": {"type": "object"}}, "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format.json_schema")
    return {"schema_type": "json", "schema": fmt.json_schema.schema_}, "response_format"


def _tools(body: ChatCompletionRequest) -> tuple[list[dict] | None, bool, str | None]:
    """(the tools the prompt offers and the parser looks for, whether a call is forced, the
    function it must be): none under tool_choice "none"; "required" or a named function force one."""
    choice = body.tool_choice
    if choice == "none" or not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None, False, None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice in (None, "auto"):
        return tools, False, None
    if choice == "required":
        return tools, True, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not name:
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return tools, True, name


def _logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list, k: int) -> list[TokenLogprob]:
    def entry(token: int, value: float) -> TopLogprob:
        text = tokenizer.decode([token])
        return TopLogprob(token=text, logprob=value, bytes=list(text.encode()))

    out = []
    for token, lp in zip(token_ids, entries):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        out.append(TokenLogprob(**entry(token, lp[token]).model_dump(), top_logprobs=[entry(t, v) for t, v in top]))
    return out


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


async def render_chat(body: ChatCompletionRequest, state: ServerState) -> tuple[str, list[int], list | None]:
    """The conversation through the chat format: (prompt text, token ids, multimodal items)."""
    fmt, engine = state.chat_format, state.engine.engine
    tools, _, _ = _tools(body)
    options = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        options["reasoning_effort"] = body.reasoning_effort
    placeholders = engine.multimodal_placeholders
    messages, images = place_images([m.as_dict() for m in body.messages], next(iter(placeholders), None))
    try:
        prompt = fmt.render(messages, tools, options)
    except ChatFormatError as exc:
        raise APIError(400, str(exc), exc.param) from None
    ids = fmt.tokenize(state.engine.tokenizer, prompt, placeholders if images else None)
    mm_items = None
    if images:
        ids, mm_items = await lay_out_images(state, ids, images, "messages")
    return prompt, ids, mm_items


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState):
    arrival = time.perf_counter()
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    fmt, tokenizer = state.chat_format, state.engine.tokenizer
    tools, forced, forced_name = _tools(body)
    engine = state.engine.engine
    prompt, ids, mm_items = await render_chat(body, state)
    so_args, so_field = _so_args(body)
    if forced:  # the reply must be a tool call: the format's grammar of its calls
        if so_args is not None:
            raise APIError(400, f"tool_choice {body.tool_choice!r} cannot be combined with {so_field}", so_field)
        try:
            so_args, so_field = fmt.force_tool_calls(tools, forced_name, prompt, tokenizer), "tool_choice"
        except ChatFormatError as exc:
            raise APIError(400, str(exc), exc.param) from None
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as much as the context leaves (the engine refuses a prompt that fills it)
        max_tokens = max(engine.max_model_len - len(ids), 1)
    k = body.top_logprobs or 0
    params = make_params(body, body.n, max_tokens=max_tokens, max_tokens_field=max_field,
                         top_logprobs=max(k, 1) if body.logprobs else 0, so_args=so_args, so_field=so_field,
                         logprobs_field="top_logprobs")
    room = bootstrap_of(body, len(params), state)
    group = await submit(state, [(ids, p, None, mm_items) for p in params], "messages", arrival, max_field, so_field,
                         body.data_parallel_rank, room)
    parsers = [fmt.parser(prompt, tools is not None) for _ in params]
    rid = f"chatcmpl-{REQUEST_ID.get()}"
    if body.stream:
        return EventStream(event_stream(state, group, _stream(body, state, group, rid, parsers, len(ids), k, so_field)))
    results = await unless_disconnected(request, collect(state, group, so_field))
    if results is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    choices = []
    for i, (res, parser) in enumerate(zip(results, parsers)):
        msg = parser.parse(res.text)
        calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in msg.tool_calls]
        logprobs = ChatLogprobs(content=_logprobs(tokenizer, res.token_ids, res.logprobs or [], k)) \
            if body.logprobs else None
        choices.append(ChatChoice(
            index=i, message=AssistantMessage(content=msg.content if msg.content or not calls else None,
                                              reasoning_content=msg.reasoning_content or None, tool_calls=calls),
            logprobs=logprobs, finish_reason=_finish_reason(res.finish_reason, bool(calls)),
            stop_reason=res.stop_reason))
    completion = sum(len(r.token_ids) for r in results)
    return ChatCompletionResponse(id=rid, model=body.model, choices=choices, usage=UsageInfo(
        prompt_tokens=len(ids), completion_tokens=completion, total_tokens=len(ids) + completion),
        kv_transfer_params=kv_transfer_answer(body, state, room))


async def _stream(body: ChatCompletionRequest, state: ServerState, group, rid: str, parsers, num_prompt: int, k: int,
                  so_field: str):
    created = int(time.time())
    tokenizer = state.engine.tokenizer
    counts = [0] * len(parsers)
    calls = [0] * len(parsers)

    def chunk(choices, usage=None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=body.model, choices=choices, usage=usage))

    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(len(parsers))])
    async for index, delta in group.deltas():
        if delta.error:  # its grammar did not compile in time, or its prefill worker failed
            yield sse_error(delta_error(delta, so_field))
        parsed: ChatDelta = parsers[index].feed(delta.text)
        if delta.finished:
            parsed.extend(parsers[index].finish())
        out = DeltaMessage(content=parsed.content or None, reasoning_content=parsed.reasoning_content or None)
        if parsed.tool_calls:
            out.tool_calls = [ToolCallDelta(index=calls[index] + j, id=c.id,
                                            function=FunctionCall(name=c.name, arguments=c.arguments))
                              for j, c in enumerate(parsed.tool_calls)]
            calls[index] += len(parsed.tool_calls)
        counts[index] += len(delta.token_ids)
        logprobs = ChatLogprobs(content=_logprobs(tokenizer, delta.token_ids, delta.logprobs or [], k)) \
            if body.logprobs and delta.token_ids else None
        reason = _finish_reason(delta.finish_reason, calls[index] > 0) if delta.finished else None
        if parsed or logprobs or reason:
            yield chunk([ChatChunkChoice(index=index, delta=out, logprobs=logprobs, finish_reason=reason)])
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], UsageInfo(prompt_tokens=num_prompt, completion_tokens=sum(counts),
                                  total_tokens=num_prompt + sum(counts)))
