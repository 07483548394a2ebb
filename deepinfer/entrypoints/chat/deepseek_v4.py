"""DeepSeek-V4's chat format (`model_type: deepseek_v4`), learned from DeepSeek's published V4
encoding; our own code. A conversation renders as

    <｜begin▁of▁sentence｜>{system}[\\n\\n{tools section}]
    <｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>            <- thinking mode: the reply starts with reasoning

(no newlines between the parts). In thinking mode a reply is `{reasoning}</think>{content}`;
earlier turns lose their reasoning (and their `<think>`) unless the request has tools. Tool
results are not a role of their own: a run of user and tool messages is one user turn whose
parts are joined by a blank line, a result written `<tool_result>{content}</tool_result>` in
the order of the calls. Tool calls are DSML (dsml.py) after the content.

Options (chat_template_kwargs): `thinking` / `enable_thinking` (default on, as vLLM serves V4),
`reasoning_effort` ("max" adds DeepSeek's maximum-effort preamble, "none" turns thinking off,
low/medium/high change nothing), `drop_thinking` (default true).
"""

from __future__ import annotations

from deepinfer.core.tokenizer import Tokenizer
from deepinfer.entrypoints.chat import dsml
from deepinfer.entrypoints.chat.base import ChatFormat, ChatFormatError, OutputParser, tool_call_arguments
from deepinfer.entrypoints.chat.deepseek_v4_parser import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, \
    DeepseekV4Parser

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
EFFORTS = (None, "none", "low", "medium", "high", "max")


class DeepseekV4ChatFormat(ChatFormat):
    name = "deepseek_v4"
    supports_tools = True
    options = ("thinking", "enable_thinking", "reasoning_effort", "drop_thinking")
    dialect = dsml.V4  # how tool lists and tool calls are spelled
    markers = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)  # single tokens in the family's vocabulary

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> "DeepseekV4ChatFormat | None":
        """The format, if the vocabulary has its markers as single tokens (a V4 checkpoint's
        tokenizer does; the shipped tiny model's does not: it was never trained to chat)."""
        for marker in cls.markers:
            if len(tokenizer.encode(marker, add_special_tokens=False)) != 1:
                return None
        return cls()

    def render(self, messages: list[dict], tools: list[dict] | None, options: dict) -> str:
        thinking, effort, drop = self._mode(options)
        turns = _merge_tool_results(_attach_tools(messages, tools))
        drop = drop and not any(t.get("tools") for t in turns)  # tool use keeps every turn's reasoning
        last_user = max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)
        if thinking and drop:  # reasoning of earlier turns goes, and so do earlier developer turns
            kept = [t for i, t in enumerate(turns) if i >= last_user or t["role"] != "developer"]
            last_user -= len(turns) - len(kept)
            turns = kept
        out = [BOS, EFFORT_MAX if thinking and effort == "max" else ""]
        for i, turn in enumerate(turns):
            role = turn["role"]
            if role == "system":
                out.append((turn.get("content") or "") + self._tools_section(turn))
            elif role in ("user", "developer"):
                if role == "developer" and not turn.get("content"):
                    raise ChatFormatError("a developer message needs content", f"messages[{turn['index']}].content")
                body = turn["content"] if role == "developer" else "\n\n".join(turn["parts"])
                out.append(USER + body + self._tools_section(turn))
                if i + 1 == len(turns) or turns[i + 1]["role"] == "assistant":
                    opens = thinking and (not drop or i >= last_user)
                    out.append(ASSISTANT + (THINK if opens else END_THINK))
            elif role == "assistant":
                out.append(self._assistant(turn, thinking and (not drop or i > last_user)))
            else:
                raise ChatFormatError(f"role {role!r} is not part of the DeepSeek-V4 chat format",
                                      f"messages[{turn['index']}].role")
        return "".join(out)

    def _assistant(self, turn: dict, reasoning: bool) -> str:
        """An assistant turn: `{reasoning}</think>` where its reasoning is kept, the content, the tool
        calls as a DSML block, the end of sentence."""
        head = (turn.get("reasoning_content") or "") + END_THINK if reasoning else ""
        calls = turn.get("tool_calls") or []
        block = self.dialect.encode_calls([
            (c["function"]["name"], tool_call_arguments(c, f"messages[{turn['index']}].tool_calls[{j}]"))
            for j, c in enumerate(calls)]) if calls else ""
        return head + (turn.get("content") or "") + block + EOS

    def _tools_section(self, turn: dict) -> str:
        tools = turn.get("tools")
        return "\n\n" + self.dialect.tools_prompt([t["function"] for t in tools]) if tools else ""

    def parser(self, prompt: str, tools: bool) -> OutputParser:
        return DeepseekV4Parser(reasoning=prompt.endswith(THINK), tools=tools, dialect=self.dialect)

    def force_tool_calls(self, tools: list[dict], name: str | None, prompt: str, tokenizer: Tokenizer) -> dict:
        """A DSML block that follows the tools' schemas, right after `</think>` when the reply
        starts by reasoning (its token is the grammar's trigger: the reasoning stays free)."""
        so_args = {"schema_type": "ebnf", "schema": self.dialect.calls_grammar([t["function"] for t in tools], name)}
        if prompt.endswith(THINK):
            so_args["trigger_token_ids"] = tokenizer.encode(END_THINK, add_special_tokens=False)
        return so_args

    def _thinking(self, options: dict) -> bool:
        """Whether thinking is asked for (the default), once the options are known and the switches booleans."""
        self.check_options(options)
        for key in ("thinking", "enable_thinking", "drop_thinking"):
            if key in options and not isinstance(options[key], bool):
                raise ChatFormatError(f"chat_template_kwargs.{key} must be true or false",
                                      f"chat_template_kwargs.{key}")
        return options.get("thinking", options.get("enable_thinking", True))

    def _mode(self, options: dict) -> tuple[bool, str | None, bool]:
        thinking = self._thinking(options)
        effort = options.get("reasoning_effort")
        if effort not in EFFORTS:
            raise ChatFormatError(f"reasoning_effort must be one of {list(EFFORTS[1:])}, got {effort!r}",
                                  "reasoning_effort")
        return thinking and effort != "none", effort, options.get("drop_thinking", True)


def _attach_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Request-level tools go into the leading system (or developer) message, or a new empty
    system message when there is none: where the model saw them in training."""
    turns = [dict(m, index=i) for i, m in enumerate(messages)]
    if tools:
        if turns and turns[0]["role"] in ("system", "developer"):
            turns[0]["tools"] = tools
        else:
            turns.insert(0, {"role": "system", "content": "", "tools": tools, "index": 0})
    return turns


def _merge_tool_results(turns: list[dict]) -> list[dict]:
    """A run of user and tool messages becomes one user turn of parts; tool results in the
    order of the preceding assistant's calls (clients may send them in any order)."""
    merged: list[dict] = []
    order: dict[str, int] = {}
    for turn in turns:
        role = turn["role"]
        if role == "assistant" and turn.get("tool_calls"):
            order = {c.get("id"): j for j, c in enumerate(turn["tool_calls"]) if c.get("id")}
        if role not in ("user", "tool"):
            merged.append(turn)
            continue
        if not merged or merged[-1]["role"] != "user":
            merged.append({"role": "user", "parts": [], "results": [], "index": turn["index"]})
        user = merged[-1]
        if role == "user":
            user["parts"].append(turn.get("content") or "")
        else:
            user["results"].append((order.get(turn.get("tool_call_id"), 0), len(user["parts"])))
            user["parts"].append(f"<tool_result>{turn.get('content') or ''}</tool_result>")
    for user in merged:
        if user.get("results"):  # results sorted among the slots results occupy; text parts stay put
            slots = [slot for _, slot in user["results"]]
            texts = [user["parts"][slot] for _, slot in sorted(user["results"], key=lambda r: r[0])]
            for slot, text in zip(slots, texts):
                user["parts"][slot] = text
    return merged
