"""One assistant turn through the model's chat format, for the agent APIs (/v1/responses in
serving_responses.py, /v1/messages in serving_messages.py). Each route maps its request onto the
chat-completions shape every chat format takes (messages with `content`, `reasoning_content`,
`tool_calls`, `tool_call_id`; tools as `{"type": "function", "function": {...}}`), and reads the
reply back through the format's own parser: reasoning, content and tool calls come out exactly
as /v1/chat/completions would give them, streamed or whole.

What the route names a field differs from the chat names the formats report errors under, so a
turn carries the map back: `sources` (the request field each message came from) and `fields`
(chat field name -> the route's)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from deepinfer.entrypoints.async_llm import EngineDead
from deepinfer.entrypoints.chat import ChatDelta, ChatFormatError, OutputParser
from deepinfer.entrypoints.chat_images import lay_out_images
from deepinfer.entrypoints.serving import APIError, ServerState, delta_error, submit
from deepinfer.entrypoints.streams import Delta, RequestGroup
from deepinfer.sampling_params import SamplingParams


@dataclass(slots=True)
class ImagePart:
    """An image of a message, already decoded; `param` names where the request had it."""

    data: bytes
    param: str


@dataclass
class TurnRequest:
    messages: list[dict]  # chat messages; `content` a str, or a list of str and ImagePart
    sources: list[str]  # per message, the request field it came from (e.g. "input[2]")
    prompt_field: str  # the request field of the conversation as a whole ("input", "messages")
    fields: dict[str, str] = field(default_factory=dict)  # chat field name -> this route's name
    tools: list[dict] | None = None
    forced: bool = False  # the reply must be a tool call (of `forced_name`, when given)
    forced_name: str | None = None
    options: dict = field(default_factory=dict)  # the chat format's options
    sampling: dict = field(default_factory=dict)  # SamplingParams fields: temperature, top_p, top_k, stop, ...
    max_tokens: int | None = None  # None: what the context leaves
    so_args: dict | None = None
    data_parallel_rank: int | None = None  # the rank to run on (smg --dp-aware adds it); none: the instance chooses

    def name(self, chat_name: str) -> str:
        return self.fields.get(chat_name, chat_name)

    def rename(self, text: str) -> str:
        """A chat format's message or param with the route's field names (messages[i] -> sources[i])."""
        text = re.sub(r"messages\[(\d+)\]", lambda m: self.sources[int(m.group(1))]
                      if int(m.group(1)) < len(self.sources) else m.group(0), text)
        head = re.match(r"[A-Za-z_]+", text)
        return self.name(head.group(0)) + text[head.end():] if head and head.group(0) in self.fields else text


@dataclass
class Turn:
    group: RequestGroup
    parser: OutputParser
    prompt_tokens: int
    so_field: str  # the request field a grammar failure is reported under


def takes_option(state: ServerState, name: str) -> bool:
    """Whether the model's chat format has option `name` (e.g. thinking, reasoning_effort)."""
    try:
        state.chat_format.check_options({name: None})
        return True
    except ChatFormatError:
        return False


def _place_images(req: TurnRequest, placeholder: str | None) -> tuple[list[dict], list[bytes]]:
    """Messages with each image replaced by the model's placeholder text (parts joined by newlines,
    as /v1/chat/completions joins them), and the images in order."""
    images, out = [], []
    for message in req.messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, ImagePart):
                    if placeholder is None:
                        raise APIError(400, f"{part.param} is an image, but this model takes text only (it has no "
                                            "vision encoder)", part.param)
                    images.append(part.data)
                    part = placeholder
                texts.append(part)
            message = dict(message, content="\n".join(texts))
        out.append(message)
    return out, images


def _params(req: TurnRequest, max_tokens: int, so_args: dict | None, so_field: str) -> SamplingParams:
    try:
        return SamplingParams(**req.sampling, max_tokens=max_tokens, so_args=so_args)
    except (ValueError, TypeError) as exc:
        name = str(exc).split(" ", 1)[0]
        param = so_field if name == "so_args" else req.name(name)
        raise APIError(400, str(exc) if param == name else f"{param}: {exc}", param) from None


@dataclass
class Prompt:
    text: str
    ids: list[int]
    mm_items: list | None


async def render_prompt(state: ServerState, req: TurnRequest) -> Prompt:
    """The conversation through the chat format, tokenized (images laid out by the model's family)."""
    fmt, engine = state.chat_format, state.engine.engine
    placeholders = engine.multimodal_placeholders
    messages, images = _place_images(req, next(iter(placeholders), None))
    try:
        text = fmt.render(messages, req.tools, req.options)
    except ChatFormatError as exc:
        raise APIError(400, req.rename(str(exc)), req.rename(exc.param) if exc.param else None) from None
    ids = fmt.tokenize(state.engine.tokenizer, text, placeholders if images else None)
    mm_items = None
    if images:
        ids, mm_items = await lay_out_images(state, ids, images, req.prompt_field)
    return Prompt(text, ids, mm_items)


async def start_turn(state: ServerState, req: TurnRequest, arrival: float) -> Turn:
    """Render the conversation and queue it."""
    fmt = state.chat_format
    prompt = await render_prompt(state, req)
    so_args, so_field = req.so_args, req.name("so_args")
    if req.forced:  # the reply must be a tool call: the format's grammar of its calls
        if so_args is not None:
            raise APIError(400, f"{req.name('tool_choice')} forcing a tool call cannot be combined with {so_field}",
                           so_field)
        try:
            so_args = fmt.force_tool_calls(req.tools, req.forced_name, prompt.text, state.engine.tokenizer)
        except ChatFormatError as exc:
            raise APIError(400, req.rename(str(exc)), req.name("tool_choice")) from None
        so_field = req.name("tool_choice")
    max_tokens = req.max_tokens if req.max_tokens is not None else \
        max(state.engine.engine.max_model_len - len(prompt.ids), 1)
    params = _params(req, max_tokens, so_args, so_field)
    group = await submit(state, [(prompt.ids, params, None, prompt.mm_items)], req.prompt_field, arrival,
                         req.name("max_tokens"), so_field, req.data_parallel_rank)
    return Turn(group, fmt.parser(prompt.text, req.tools is not None), len(prompt.ids), so_field)


async def parsed_deltas(turn: Turn):
    """(what the reply added, the engine's delta) as it streams; the parser's held-back rest comes
    with the last one. A grammar that failed to compile is a 400 under the field it came from."""
    async for _, delta in turn.group.deltas():
        if delta.error:
            raise delta_error(delta, turn.so_field)
        parsed: ChatDelta = turn.parser.feed(delta.text)
        if delta.finished:
            parsed.extend(turn.parser.finish())
        yield parsed, delta


async def whole_reply(state: ServerState, turn: Turn) -> tuple[ChatDelta, Delta]:
    """The reply at once (non-streaming), through the same parser a stream goes through."""
    reply, last = ChatDelta(), Delta()
    try:
        async for parsed, delta in parsed_deltas(turn):
            reply.extend(parsed)
            last.merge(delta)
    except EngineDead as exc:
        raise APIError(503, str(exc), None, "unavailable", "server_error") from None
    finally:  # also when the client went away (unless_disconnected cancels this)
        if not turn.group.finished:
            state.engine.abort(turn.group.request_ids)
    return reply, last


def named_sse(event: dict) -> str:
    """A server-sent event named by its payload's `type`, as both agent APIs send them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def guarded_events(state: ServerState, turn: Turn, events, error_event):
    """A route's events (`events`, an async generator of SSE strings) until it ends; an APIError
    raised under it, or the engine stopping, becomes the route's error event (`error_event(APIError)`,
    an SSE string); the engine request is aborted however the stream ends (the client gone included)."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield error_event(exc)
    except EngineDead as exc:
        yield error_event(APIError(503, str(exc), None, "unavailable", "server_error"))
    finally:
        await events.aclose()
        if not turn.group.finished:
            state.engine.abort(turn.group.request_ids)


def tool_call_input(arguments: str) -> dict:
    """A parsed call's arguments as an object (the parsers write a JSON object)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
