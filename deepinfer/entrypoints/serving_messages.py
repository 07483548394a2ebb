"""POST /v1/messages, Anthropic's Messages API (and /v1/messages/count_tokens): content blocks ->
chat messages -> the model's chat format (chat_turn.py); the reply -> content blocks: `thinking`
(the format's reasoning), `text`, `tool_use` per parsed tool call. Streamed, the documented events:
message_start, then per block content_block_start, content_block_delta (thinking_delta /
text_delta / input_json_delta), content_block_stop, then message_delta (stop_reason end_turn,
max_tokens, stop_sequence or tool_use; usage) and message_stop. A whole message is built by the
same writer, so the two agree block for block. Errors have Anthropic's shape (api_server.py).

Thinking follows Anthropic's default: off unless `thinking` is {"type": "enabled"} (or
"adaptive"), on a chat format that has a thinking mode; `budget_tokens` is not enforced (the
reasoning ends when the model ends it, within max_tokens). Thinking blocks carry an empty
signature, and one sent back is read as the turn's reasoning without checking any signature."""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints.chat import ChatDelta
from deepinfer.entrypoints.chat_images import data_uri_bytes
from deepinfer.entrypoints.chat_turn import ImagePart, TurnRequest, guarded_events, named_sse, parsed_deltas, \
    render_prompt, start_turn, takes_option, tool_call_input, whole_reply
from deepinfer.entrypoints.protocol_anthropic import CountTokensRequest, MessagesRequest, error_body
from deepinfer.entrypoints.serving import APIError, EventStream, ServerState, unless_disconnected


def _image(block: dict, where: str) -> ImagePart:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media = source.get("media_type")
        if not isinstance(media, str) or not media.startswith("image/"):
            raise APIError(400, f"{where}.source.media_type must be an image type (image/png, image/jpeg, ...), "
                                f"got {media!r}", f"{where}.source.media_type")
        try:
            return ImagePart(base64.b64decode(source.get("data") or "", validate=True), where)
        except (binascii.Error, ValueError, TypeError):
            raise APIError(400, f"{where}.source.data is not valid base64", f"{where}.source.data") from None
    if kind == "url" and isinstance(source.get("url"), str):
        return ImagePart(data_uri_bytes(source["url"], f"{where}.source.url"), where)
    raise APIError(400, f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                        "{\"type\": \"url\", \"url\": a data: URL} (files are not served)", f"{where}.source")


def _tool_result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError(400, f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image":
                parts.append(_image(part, f"{where}.content[{k}]"))
            else:
                raise APIError(400, f"{where}.content[{k}] must be a text or image block", f"{where}.content[{k}]")
        content = "\n".join(parts) if all(isinstance(p, str) for p in parts) else parts
    elif not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of blocks", f"{where}.content")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _user(content, where: str) -> list[dict]:
    """A user message: its tool results (one tool message each, first, as Anthropic puts them),
    then its text and images as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, parts = [], []
    for j, block in enumerate(content):
        kind, at = block.get("type") if isinstance(block, dict) else None, f"{where}[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            results.append(_tool_result(block, at))
        else:
            raise APIError(400, f"{at}: a user message's blocks are text, image and tool_result, got type {kind!r}",
                           f"{at}.type")
    if parts:
        results.append({"role": "user", "content": "\n".join(parts) if all(isinstance(p, str) for p in parts)
                        else parts})
    return results


def _assistant(content, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: dict = {"role": "assistant", "content": None}
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(content):
        kind, at = block.get("type") if isinstance(block, dict) else None, f"{where}[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by another service: nothing this model can read
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
                    not isinstance(block.get("input"), dict):
                raise APIError(400, f"{at}: a tool_use block needs id, name and input (an object)", at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            raise APIError(400, f"{at}: an assistant message's blocks are text, thinking and tool_use, got type "
                                f"{kind!r}", f"{at}.type")
    if texts:
        message["content"] = "".join(texts)
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def conversation(body) -> tuple[list[dict], list[str]]:
    """Chat messages of the request (system first), and the field each came from."""
    messages, sources = [], []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(
            b.get("text", "") for b in body.system if isinstance(b, dict) and b.get("type") == "text")
        messages.append({"role": "system", "content": system})
        sources.append("system")
    for i, message in enumerate(body.messages):
        where, role, content = f"messages[{i}]", message.get("role"), message.get("content")
        if not isinstance(content, (str, list)):
            raise APIError(400, f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        if role == "user":
            turn = _user(content, f"{where}.content")
        elif role == "assistant":
            turn = [_assistant(content, f"{where}.content")]
        else:
            raise APIError(400, f"{where}.role must be user or assistant (the system prompt is `system`), got "
                                f"{role!r}", f"{where}.role")
        messages += turn
        sources += [where] * len(turn)
    if body.messages[-1].get("role") == "assistant":
        raise APIError(400, f"messages[{len(body.messages) - 1}]: a final assistant message (a prefill the reply "
                            "continues) is not supported: the chat format ends every assistant turn",
                       f"messages[{len(body.messages) - 1}].role")
    return messages, sources


def _tools(body) -> tuple[list[dict] | None, bool, str | None]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: only client tools (name, description, input_schema) are served, got "
                                f"type {tool.get('type')!r} (a server tool this server does not run)",
                           f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        if not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function = {"name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    if kind == "none" or not tools:
        if kind not in ("none", "auto"):
            raise APIError(400, f"tool_choice {kind!r} needs tools", "tool_choice")
        return None, False, None
    if kind == "auto":
        return tools, False, None
    if kind == "any":
        return tools, True, None
    if kind == "tool":
        name = choice.get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice.name")
        return tools, True, name
    raise APIError(400, "tool_choice.type must be auto, any, tool or none", "tool_choice.type")


def _options(body, state: ServerState) -> dict:
    """The chat format's options: thinking as Anthropic has it (off unless enabled)."""
    options = dict(body.chat_template_kwargs or {})
    thinking = body.thinking or {"type": "disabled"}
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError(400, "thinking.type must be enabled, adaptive or disabled", "thinking.type")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise APIError(400, "thinking.budget_tokens must be an integer >= 1", "thinking.budget_tokens")
    effort = (body.output_config or {}).get("effort")
    if not takes_option(state, "thinking"):
        if kind != "disabled" or effort is not None:
            param = "thinking" if kind != "disabled" else "output_config.effort"
            raise APIError(400, f"{param}: this model's chat format ({state.chat_format.name!r}) has no thinking "
                                "mode; leave it out", param)
        return options
    if body.thinking is not None or not {"thinking", "enable_thinking"} & set(options):
        options["thinking"] = kind != "disabled"
    if effort is not None:
        options["reasoning_effort"] = effort
    return options


def _so_args(body: MessagesRequest) -> tuple[dict | None, str]:
    """so_args and the field they came from: output_config.format (json_schema), or deepinfer's so_args."""
    fmt = (body.output_config or {}).get("format")
    if fmt is None:
        return body.so_args, "so_args"
    if body.so_args is not None:
        raise APIError(400, "give output_config.format or so_args, not both", "so_args")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                       "output_config.format")
    return {"schema_type": "json", "schema": fmt["schema"]}, "output_config.format"


def turn_request(body, state: ServerState) -> TurnRequest:
    messages, sources = conversation(body)
    tools, forced, name = _tools(body)
    return TurnRequest(messages, sources, "messages", tools=tools, forced=forced, forced_name=name,
                       options=_options(body, state), data_parallel_rank=body.data_parallel_rank,
                       fields={"seq_seed": "seed", "thinking": "thinking", "reasoning_effort": "output_config.effort",
                               "chat_template_kwargs": "chat_template_kwargs"})


# ------------------------------------------------------------------ reply -> content blocks and events
class MessageWriter:
    """The content blocks of one message, built from the parser's deltas in the order the model
    wrote them, and the events a stream sends as they are built."""

    def __init__(self, model: str, prompt_tokens: int):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.content: list[dict] = []
        self.open: dict | None = None  # the thinking or text block text is going into

    def message(self, stop_reason: str | None = None, stop_sequence: str | None = None,
                output_tokens: int = 0) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": dict(self.message(), content=[])}]

    def feed(self, parsed: ChatDelta) -> list[dict]:
        events = []
        if parsed.reasoning_content:
            events += self._text("thinking", parsed.reasoning_content)
        if parsed.content:
            events += self._text("text", parsed.content)
        for call in parsed.tool_calls:
            events += self._close()
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": {}}
            index = len(self.content)
            events.append({"type": "content_block_start", "index": index, "content_block": dict(block)})
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
            events.append({"type": "content_block_stop", "index": index})
            self.content.append(dict(block, input=tool_call_input(call.arguments)))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self.content.append(self.open)
            events.append({"type": "content_block_start", "index": len(self.content) - 1,
                           "content_block": dict(self.open)})
        self.open[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        events.append({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})
        return events

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def finish(self, finish_reason: str | None, stop_reason, output_tokens: int) -> list[dict]:
        """The last events: the open block closed, message_delta with why it stopped, message_stop."""
        if finish_reason == "abort":
            raise APIError(503, "the server stopped this message (it is shutting down)", None, "unavailable",
                           "server_error")
        events = [] if self.content else self._text("text", "")[:1]  # an empty reply is still a text block
        events += self._close()
        stop_sequence = stop_reason if finish_reason == "stop" and isinstance(stop_reason, str) else None
        if finish_reason == "length":
            reason = "max_tokens"
        elif stop_sequence is not None:
            reason = "stop_sequence"
        else:
            reason = "tool_use" if any(b["type"] == "tool_use" for b in self.content) else "end_turn"
        self.final = self.message(reason, stop_sequence, output_tokens)
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                          "usage": {"output_tokens": output_tokens}}, {"type": "message_stop"}]


def _sampling(body: MessagesRequest) -> dict:
    return {"temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": -1 if body.top_k is None else body.top_k,
            "stop": body.stop_sequences or None, "seq_seed": body.seed}


async def create_message(body: MessagesRequest, request: Request, state: ServerState):
    arrival = time.perf_counter()
    state.check_model(body.model)
    req = turn_request(body, state)
    req.sampling, req.max_tokens = _sampling(body), body.max_tokens
    req.so_args, so_field = _so_args(body)
    req.fields.update(stop="stop_sequences", so_args=so_field)
    turn = await start_turn(state, req, arrival)
    writer = MessageWriter(body.model, turn.prompt_tokens)
    if body.stream:
        return EventStream(guarded_events(state, turn, _stream(turn, writer), _error_event))
    result = await unless_disconnected(request, whole_reply(state, turn))
    if result is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    reply, last = result
    writer.feed(reply)
    writer.finish(last.finish_reason, last.stop_reason, len(last.token_ids))
    return JSONResponse(writer.final)


async def _stream(turn, writer: MessageWriter):
    for event in writer.start():
        yield named_sse(event)
    count = 0
    async for parsed, delta in parsed_deltas(turn):
        count += len(delta.token_ids)
        events = writer.feed(parsed)
        if delta.finished:
            events += writer.finish(delta.finish_reason, delta.stop_reason, count)
        for event in events:
            yield named_sse(event)


def _error_event(exc: APIError) -> str:
    return named_sse(error_body(exc.status, exc.message, exc.param))


async def count_tokens(body: CountTokensRequest, state: ServerState) -> dict:
    state.check_model(body.model)
    prompt = await render_prompt(state, turn_request(body, state))
    return {"input_tokens": len(prompt.ids)}
