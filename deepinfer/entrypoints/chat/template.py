"""A model directory's own Jinja chat template (`chat_template` in tokenizer_config.json, or a
chat_template.jinja file), rendered the way transformers' `apply_chat_template` renders it:
sandboxed, `add_generation_prompt=True`, bos/eos strings, tools, and the request's
chat_template_kwargs as template variables. The output is parsed by the model family's
parser when it has one, else kept as plain content."""

from __future__ import annotations

import json
import os
from datetime import datetime

from deepinfer.entrypoints.chat.base import ChatFormat, ChatFormatError, OutputParser, tool_call_arguments


def _special(config: dict, key: str) -> str:
    value = config.get(key)
    return (value.get("content", "") if isinstance(value, dict) else value) or ""


def read_template(model_dir: str) -> tuple[str | None, dict]:
    """(the template or None, tokenizer_config.json)."""
    config = {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if not template and os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            template = f.read()
    return template or None, config


class TemplateChatFormat(ChatFormat):
    name = "template"
    supports_tools = True  # what the template does with them is its business

    def __init__(self, template: str, tokenizer_config: dict, parse_like: ChatFormat):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = env.from_string(template)
        except TemplateError as exc:
            raise ValueError(f"the model's chat_template does not compile: {exc}") from None
        self.specials = {"bos_token": _special(tokenizer_config, "bos_token"),
                         "eos_token": _special(tokenizer_config, "eos_token")}
        self.parse_like = parse_like

    def check_options(self, options: dict) -> None:
        pass  # any chat_template_kwargs are the template's variables

    def render(self, messages: list[dict], tools: list[dict] | None, options: dict) -> str:
        from jinja2 import TemplateError

        msgs = []
        for i, m in enumerate(messages):
            m = dict(m)
            if m.get("tool_calls"):  # templates index into the arguments: give them the object
                m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=tool_call_arguments(
                    c, f"messages[{i}].tool_calls[{j}]"))) for j, c in enumerate(m["tool_calls"])]
            msgs.append(m)
        try:
            return self.template.render(messages=msgs, tools=tools or None, add_generation_prompt=True,
                                        **self.specials, **options)
        except TemplateError as exc:
            raise ChatFormatError(f"the model's chat template rejected the conversation: {exc}", "messages")

    def parser(self, prompt: str, tools: bool) -> OutputParser:
        return self.parse_like.parser(prompt, tools)

    def force_tool_calls(self, tools, name, prompt, tokenizer) -> dict:
        return self.parse_like.force_tool_calls(tools, name, prompt, tokenizer)
