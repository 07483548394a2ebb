"""POST /v1/responses, OpenAI's Responses API, stateless: input items -> chat messages -> the
model's chat format (chat_turn.py); the reply -> output items: a `reasoning` item (its text in
`content` as `reasoning_text`), a `message` with `output_text`, a `function_call` per parsed tool
call. Streamed, the documented events: response.created, response.in_progress, then per item
response.output_item.added, (content_part.added, output_text.delta / reasoning_text.delta ...,
output_text.done / reasoning_text.done, content_part.done | function_call_arguments.delta, .done),
response.output_item.done, and last response.completed, or response.incomplete when
max_output_tokens ran out (status "incomplete", incomplete_details.reason "max_output_tokens").
A whole response is built by the same writer, so the two agree item for item."""

from __future__ import annotations

import copy
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints.chat import ChatDelta
from deepinfer.entrypoints.chat_images import data_uri_bytes
from deepinfer.entrypoints.chat_turn import ImagePart, TurnRequest, guarded_events, named_sse, parsed_deltas, \
    start_turn, takes_option, whole_reply
from deepinfer.entrypoints.protocol_responses import ResponsesRequest
from deepinfer.entrypoints.serving import APIError, EventStream, ServerState, unless_disconnected

STATELESS = ("this server is stateless: it stores no responses or conversations, so it cannot continue one by "
             "id; send the whole conversation in `input` (earlier output items included)")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def refuse_stateful(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise APIError(400, f"previous_response_id: {STATELESS}", "previous_response_id",
                       "previous_response_not_found")
    if body.conversation is not None:
        raise APIError(400, f"conversation: {STATELESS}", "conversation", "unsupported_parameter")
    if body.prompt is not None:
        raise APIError(400, "prompt: stored prompt templates are not served; send instructions and input",
                       "prompt", "unsupported_parameter")
    if body.background:
        raise APIError(400, f"background: responses run while the request is open ({STATELESS})", "background",
                       "unsupported_parameter")
    if body.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported: a conversation longer than the context is a 400 "
                       "(use 'disabled')", "truncation", "unsupported_parameter")
    if body.top_logprobs or "message.output_text.logprobs" in (body.include or ()):
        param = "top_logprobs" if body.top_logprobs else "include"
        raise APIError(400, f"{param}: logprobs are not returned on /v1/responses (use /v1/chat/completions)",
                       param, "unsupported_parameter")


# ------------------------------------------------------------------ input items -> chat messages
def _text_of(parts, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a list of text parts (reasoning content, tool output)."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts or []):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}] must be a text part ({' or '.join(kinds)})", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _content(content, where: str) -> str | list:
    """A message's content: a str, or text and image parts (images as data: URLs only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        param = f"{where}[{j}]"
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise APIError(400, f"{param}.image_url must be a data: URL (file_id images are not served)",
                               f"{param}.image_url")
            out.append(ImagePart(data_uri_bytes(url, f"{param}.image_url"), param))
        else:
            raise APIError(400, f"{param}: content parts are input_text, output_text, refusal or input_image (a "
                                f"data: URL), got type {kind!r}", param)
    return "\n".join(out) if all(isinstance(p, str) for p in out) else out


def input_messages(body: ResponsesRequest) -> tuple[list[dict], list[str]]:
    """Chat messages of the request, and the field each came from. A reasoning item, an assistant
    message and function calls that follow one another are one assistant turn, as the model wrote them."""
    messages, sources = [], []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
        sources.append("instructions")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    where_input = "input" if isinstance(body.input, str) else None
    turn = None  # the assistant turn items are still joining
    for i, item in enumerate(items):
        where = where_input or f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               f"{where}.role")
            content = _content(item.get("content"), f"{where}.content")
            if role == "assistant" and turn is not None and turn.get("content") is None and not turn.get("tool_calls"):
                turn["content"] = content  # the message after its reasoning item
                continue
            messages.append({"role": role, "content": content})
            sources.append(where)
            turn = messages[-1] if role == "assistant" else None
        elif kind == "reasoning":
            text = _text_of(item.get("content"), f"{where}.content", ("reasoning_text",))
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
            sources.append(where)
            turn = messages[-1]
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"{where}.{key} must be a string", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turn is None:
                messages.append(turn := {"role": "assistant", "content": None})
                sources.append(where)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}.call_id must be a string", f"{where}.call_id")
            output = _text_of(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            sources.append(where)
            turn = None
        elif kind == "item_reference":
            raise APIError(400, f"{where}: item references need stored items; {STATELESS}", f"{where}.type")
        else:
            raise APIError(400, f"{where}.type {kind!r} is not served: input items are messages, reasoning, "
                                "function_call and function_call_output", f"{where}.type")
    if not messages:
        raise APIError(400, "input is empty", "input")
    return messages, sources


def _tools(body: ResponsesRequest) -> tuple[list[dict] | None, bool, str | None]:
    """(chat tools, a call forced, of which function) from `tools` and `tool_choice`."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are served, got type {tool.get('type')!r} (a "
                                "hosted tool this server does not run)", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                       if tool.get(k) is not None}})
    choice = body.tool_choice
    if choice in (None, "auto", "none", "required"):
        if choice not in (None, "auto", "none") and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice")
        return (tools or None) if choice != "none" else None, choice == "required" and bool(tools), None
    name = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": "
                            "...}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return tools, True, name


def _so_args(body: ResponsesRequest) -> tuple[dict | None, str]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return body.so_args, "so_args"
    if body.so_args is not None:
        raise APIError(400, "give text.format or so_args, not both", "so_args")
    if fmt.get("type") == "json_object":
        return {"schema_type": "json", "schema": {"type": "object"}}, "text.format"
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"schema_type": "json", "schema": fmt["schema"]}, "text.format"
    raise APIError(400, "text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                        "\"json_schema\", \"name\": ..., \"schema\": {...}}", "text.format")


def turn_request(body: ResponsesRequest, state: ServerState) -> TurnRequest:
    messages, sources = input_messages(body)
    tools, forced, name = _tools(body)
    options = dict(body.chat_template_kwargs or {})
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        if takes_option(state, "reasoning_effort"):
            options["reasoning_effort"] = effort
        elif effort != "none":
            raise APIError(400, f"reasoning.effort: this model's chat format ({state.chat_format.name!r}) has no "
                                "reasoning; leave it out or give 'none'", "reasoning.effort", "unsupported_parameter")
    so_args, so_field = _so_args(body)
    sampling = {"temperature": 1.0 if body.temperature is None else body.temperature,
                "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": body.top_k, "seq_seed": body.seed}
    return TurnRequest(messages, sources, "input", tools=tools, forced=forced, forced_name=name, options=options,
                       sampling=sampling, max_tokens=body.max_output_tokens, so_args=so_args,
                       data_parallel_rank=body.data_parallel_rank,
                       fields={"messages": "input", "max_tokens": "max_output_tokens", "seq_seed": "seed",
                               "so_args": so_field, "reasoning_effort": "reasoning.effort"})


# ------------------------------------------------------------------ reply -> output items and events
class ResponseWriter:
    """The output items of one response, built from the parser's deltas in the order the model
    wrote them, and the events a stream sends as they are built."""

    def __init__(self, body: ResponsesRequest, prompt_tokens: int):
        self.body, self.prompt_tokens = body, prompt_tokens
        self.id, self.created = item_id("resp"), int(time.time())
        self.output: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item text is going into
        self.seq = 0

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **copy.deepcopy(fields)}

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None,
                 error: dict | None = None) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": body.model, "output": self.output, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
                "store": False, "metadata": body.metadata or {}, "user": body.user, "usage": usage}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, parsed: ChatDelta) -> list[dict]:
        events = []
        if parsed.reasoning_content:
            events += self._text("reasoning", parsed.reasoning_content)
        if parsed.content:
            events += self._text("message", parsed.content)
        for call in parsed.tool_calls:
            events += self._close("completed")
            item = {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
            index = len(self.output)
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=call.arguments))
            item.update(arguments=call.arguments, status="completed")
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=call.name, arguments=call.arguments))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed") + self._open(kind)
        index, part = len(self.output) - 1, self.open["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=self.open["id"], output_index=index, content_index=0, delta=text,
                                 **extra))
        return events

    def _open(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": item_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self.output)
        self.output.append(item)
        self.open = item
        events = [self.event("response.output_item.added", output_index=index, item=item),
                  self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part=part)]
        item["content"].append(part)
        return events

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, part = self.output.index(item), item["content"][0]
        name = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        item["status"] = status
        return [self.event(name, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def finish(self, finish_reason: str | None, output_tokens: int, reasoning_tokens: int) -> list[dict]:
        """The last events: the open item closed, then the response as it ended."""
        if not self.output:  # an empty reply is still a message
            events = self._open("message")
        else:
            events = []
        incomplete = finish_reason == "length"
        events += self._close("incomplete" if incomplete else "completed")
        usage = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                 "total_tokens": self.prompt_tokens + output_tokens}
        if finish_reason == "abort":
            error = {"code": "server_error", "message": "the server stopped this response (it is shutting down)"}
            return events + [self.event("response.failed", response=self.response("failed", usage, error=error))]
        if incomplete:
            return events + [self.event("response.incomplete",
                                        response=self.response("incomplete", usage, "max_output_tokens"))]
        return events + [self.event("response.completed", response=self.response("completed", usage))]


def _reasoning_tokens(state: ServerState, writer: ResponseWriter) -> int:
    text = "".join(i["content"][0]["text"] for i in writer.output if i["type"] == "reasoning")
    return len(state.engine.tokenizer.encode(text, add_special_tokens=False)) if text else 0


async def create_response(body: ResponsesRequest, request: Request, state: ServerState):
    arrival = time.perf_counter()
    state.check_model(body.model)
    refuse_stateful(body)
    turn = await start_turn(state, turn_request(body, state), arrival)
    writer = ResponseWriter(body, turn.prompt_tokens)
    if body.stream:
        return EventStream(guarded_events(state, turn, _stream(state, turn, writer), lambda exc: _error_event(
            writer, exc)))
    result = await unless_disconnected(request, whole_reply(state, turn))
    if result is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    reply, last = result
    writer.feed(reply)
    final = writer.finish(last.finish_reason, len(last.token_ids), _reasoning_tokens(state, writer))[-1]
    return JSONResponse(final["response"])


async def _stream(state: ServerState, turn, writer: ResponseWriter):
    for event in writer.start():
        yield named_sse(event)
    count, reason = 0, None
    async for parsed, delta in parsed_deltas(turn):
        count += len(delta.token_ids)
        reason = delta.finish_reason if delta.finished else reason
        for event in writer.feed(parsed):
            yield named_sse(event)
    for event in writer.finish(reason, count, _reasoning_tokens(state, writer)):
        yield named_sse(event)


def _error_event(writer: ResponseWriter, exc: APIError) -> str:
    """OpenAI's `error` stream event, then response.failed (a stream always ends with the response)."""
    error = writer.event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
    failed = writer.event("response.failed", response=writer.response(
        "failed", error={"code": "server_error" if exc.status >= 500 else "invalid_prompt", "message": exc.message}))
    return named_sse(error) + named_sse(failed)
