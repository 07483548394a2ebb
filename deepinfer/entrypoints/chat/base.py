"""What a chat format is: messages -> prompt text, and the model's output text -> content,
reasoning and tool calls, incrementally so streaming and non-streaming share one code path.

Messages reach a format as plain dicts in OpenAI's shape, already checked by the protocol
models: {"role", "content": str | None, "reasoning_content"?, "tool_calls"?, "tool_call_id"?}; an
image content part is already the model's placeholder text in `content` (serving_chat.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from deepinfer.core.tokenizer import Tokenizer


class ChatFormatError(ValueError):
    """A conversation the format cannot render; `param` names the request field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(slots=True)
class ChatDelta:
    """What a piece of output text added to the assistant message."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)

    def extend(self, other: "ChatDelta") -> "ChatDelta":
        self.content += other.content
        self.reasoning_content += other.reasoning_content
        self.tool_calls.extend(other.tool_calls)
        return self


class OutputParser:
    """Turns the model's text into message fields as it grows. `feed` may hold text back (a
    marker that might be starting); `finish` returns whatever is left."""

    def feed(self, text: str) -> ChatDelta:
        return ChatDelta(content=text)

    def finish(self) -> ChatDelta:
        return ChatDelta()

    def parse(self, text: str) -> ChatDelta:
        """The whole output at once: the same parser fed once, so it equals a joined stream."""
        return self.feed(text).extend(self.finish())


class ChatFormat:
    name = "base"
    supports_tools = False
    # chat_template_kwargs (and the request's reasoning_effort) the format understands
    options: tuple[str, ...] = ()

    def render(self, messages: list[dict], tools: list[dict] | None, options: dict) -> str:
        raise NotImplementedError

    def tokenize(self, tokenizer: Tokenizer, prompt: str, placeholders: dict[str, int] | None = None) -> list[int]:
        """Prompt ids. Formats write their special tokens (BOS included) into the text. `placeholders`:
        the model's multimodal placeholder texts, each tokenized as its one id (Tokenizer.encode)."""
        return tokenizer.encode(prompt, add_special_tokens=False, placeholders=placeholders)

    def parser(self, prompt: str, tools: bool) -> OutputParser:
        """A parser for one choice; `prompt` tells the format's starting state (e.g. an open
        reasoning block), `tools` whether tool calls are parsed."""
        return OutputParser()

    def force_tool_calls(self, tools: list[dict], name: str | None, prompt: str, tokenizer: Tokenizer) -> dict:
        """so_args that make the reply a tool call (tool_choice "required": one or more of any
        tool; a named function: one call of it)."""
        raise ChatFormatError(f"chat format {self.name!r} cannot force tool calls (tool_choice 'required' or a "
                              "named function); use 'auto'", "tool_choice")

    def check_options(self, options: dict) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            allowed = ", ".join(self.options) or "none"
            raise ChatFormatError(f"chat format {self.name!r} does not take {unknown} (it takes: {allowed})",
                                  f"chat_template_kwargs.{unknown[0]}")


class PlainChatFormat(ChatFormat):
    """For models that were never trained to chat (the shipped tiny model writes Python): the
    prompt is each message's content followed by a newline, with no role markers, tokenized
    like a /v1/completions prompt (so the tokenizer adds BOS as it does there). The reply is
    plain content: no reasoning, no tool calls."""

    name = "plain"

    def render(self, messages: list[dict], tools: list[dict] | None, options: dict) -> str:
        self.check_options(options)
        if tools:
            raise ChatFormatError("this model's chat format ('plain': not a chat-trained model) has no tool calling",
                                  "tools")
        return "".join(f"{m.get('content') or ''}\n" for m in messages)

    def tokenize(self, tokenizer: Tokenizer, prompt: str, placeholders: dict[str, int] | None = None) -> list[int]:
        return tokenizer.encode(prompt, placeholders=placeholders)


def tool_call_arguments(call: dict, where: str) -> dict:
    """The arguments object of an OpenAI tool call from a request's history."""
    raw = call["function"].get("arguments") or "{}"
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        raise ChatFormatError(f"{where}.function.arguments is not valid JSON: {exc}", f"{where}.function.arguments")
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return args
