"""Chat formats: how /v1/chat/completions turns messages into a prompt and the output back into
content, reasoning_content and tool_calls.

Which one a model gets (`--chat-format auto`):
1. a Jinja `chat_template` in its tokenizer_config.json (or chat_template.jinja) renders the
   prompt; its output is parsed by the family's parser if the family applies, else kept plain;
2. else its family's format (the model registry's family of the checkpoint, models/registry.py),
   looked up in FAMILY_FORMATS, if the
   tokenizer has that format's markers (a model family adds its format here, e.g. V4.1's);
3. else the plain format (base.PlainChatFormat): what the shipped tiny model, which was never
   trained to chat, gets.
"""

from __future__ import annotations

from typing import Callable

from deepinfer.core.tokenizer import Tokenizer
from deepinfer.entrypoints.chat.base import ChatDelta, ChatFormat, ChatFormatError, OutputParser, \
    PlainChatFormat, ToolCall
from deepinfer.entrypoints.chat.deepseek_v4 import DeepseekV4ChatFormat
from deepinfer.entrypoints.chat.deepseek_v41 import DeepseekV41ChatFormat
from deepinfer.entrypoints.chat.template import TemplateChatFormat, read_template

# model family -> its format for a tokenizer, or None when the tokenizer lacks its markers
FAMILY_FORMATS: dict[str, Callable[[Tokenizer], ChatFormat | None]] = {
    "deepseek_v4": DeepseekV4ChatFormat.for_tokenizer,
    "deepseek_v41": DeepseekV41ChatFormat.for_tokenizer,
}
CHOICES = ("auto", "template", "plain", *FAMILY_FORMATS)

__all__ = ["ChatDelta", "ChatFormat", "ChatFormatError", "OutputParser", "ToolCall", "CHOICES",
           "FAMILY_FORMATS", "load_chat_format"]


def family_name(model_dir: str) -> str | None:
    """The checkpoint's model family, as the engine's registry sees it (None: not a supported model)."""
    from deepinfer.models.base import ConfigError
    from deepinfer.models.registry import family_of, read_config

    try:
        data, path = read_config(model_dir)
        return family_of(data, path).name
    except ConfigError:
        return None


def load_chat_format(model_dir: str, tokenizer: Tokenizer, choice: str = "auto") -> ChatFormat:
    if choice not in CHOICES:
        raise ValueError(f"chat format must be one of {list(CHOICES)}, got {choice!r}")
    family = FAMILY_FORMATS.get(choice if choice in FAMILY_FORMATS else family_name(model_dir))
    native = family(tokenizer) if family is not None else None
    if choice in FAMILY_FORMATS and native is None:
        raise ValueError(f"chat format {choice!r} needs its marker tokens, which this tokenizer does not have")
    if choice == "plain":
        return PlainChatFormat()
    template, config = read_template(model_dir)
    if choice == "template" and template is None:
        raise ValueError(f"--chat-format template: {model_dir} has no chat_template in tokenizer_config.json "
                         "and no chat_template.jinja")
    if template is not None and choice in ("auto", "template"):
        return TemplateChatFormat(template, config, native or PlainChatFormat())
    return native or PlainChatFormat()
