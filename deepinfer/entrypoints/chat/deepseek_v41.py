"""DeepSeek-V4.1's chat format (`model_type: deepseek_v41`), learned from DeepSeek's V4.1 encoder as
published with vLLM (deepseek_v41_encoding.py) and reference/DEEPSEEK_V41.md; our own code. A
conversation renders as

    <｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 50 (range 1-100, ...)\\n\\n{system}[\\n\\n{tools}]
    <｜User｜>{user}<｜Assistant｜><think>          <- thinking (the default): reasoning comes first
    <｜User｜>{user}<｜Assistant｜></think>         <- chat mode: the reply is content

(no newlines between the parts). What differs from V4 (deepseek_v4.py, whose format this extends:
tool-result merging, assistant turns, the output parser): a `<｜System｜>` marker opens the
conversation when it starts with a system message or carries the reasoning effort (thinking mode only: `Reasoning Effort: N (range 1-100, the higher
the value, the more thorough the reasoning)`, N an integer in [1, 100] or low 25 / high 50 (the
default) / xhigh 75 / max 100; "none" turns thinking off); a system message later in the
conversation is `<｜System｜>{content}` and, like a user turn, is followed by the assistant header;
DSML names its block `<｜DSML｜ calls>` and its tags with a leading space (dsml.V41).

Options (chat_template_kwargs): `thinking` / `enable_thinking` (default on), `reasoning_effort`,
`drop_thinking` (default true: earlier turns lose their reasoning, and earlier developer turns go,
unless the conversation has tools).
"""

from __future__ import annotations

from deepinfer.entrypoints.chat import dsml
from deepinfer.entrypoints.chat.base import ChatFormatError
from deepinfer.entrypoints.chat.deepseek_v4 import DeepseekV4ChatFormat, _merge_tool_results
from deepinfer.entrypoints.chat.deepseek_v4_parser import ASSISTANT, BOS, END_THINK, THINK, USER

SYSTEM = "<｜System｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
EFFORT_TEMPLATE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


class DeepseekV41ChatFormat(DeepseekV4ChatFormat):
    name = "deepseek_v41"
    dialect = dsml.V41
    markers = DeepseekV4ChatFormat.markers + (SYSTEM, dsml.DSML)  # V4.1's tokenizer has them as single tokens

    def render(self, messages: list[dict], tools: list[dict] | None, options: dict) -> str:
        thinking, effort, drop = self._mode(options)
        turns = _merge_tool_results(_attach_tools(messages, tools))
        drop = drop and not any(t.get("tools") for t in turns)  # tool use keeps every turn's reasoning
        if thinking and drop:
            turns = _drop_thinking(turns)
        last_user = _last_user(turns)
        out = [BOS]
        for i, turn in enumerate(turns):
            role = turn["role"]
            head = EFFORT_TEMPLATE.format(effort) if i == 0 and thinking else ""
            if i == 0 and (head or role == "system"):
                out.append(SYSTEM + head)
            if role == "system":
                out.append((SYSTEM if i > 0 else "") + (turn.get("content") or "") + self._tools_section(turn))
            elif role == "developer":
                if not turn.get("content"):
                    raise ChatFormatError("a developer message needs content", f"messages[{turn['index']}].content")
                out.append(USER + turn["content"] + self._tools_section(turn))
            elif role == "user":
                out.append(USER + "\n\n".join(turn["parts"]))
            elif role == "assistant":
                out.append(self._assistant(turn, thinking and (not drop or i > last_user)))
            else:
                raise ChatFormatError(f"role {role!r} is not part of the DeepSeek-V4.1 chat format",
                                      f"messages[{turn['index']}].role")
            last = i + 1 == len(turns)
            if not last and turns[i + 1]["role"] != "assistant":
                continue
            answered = role in ("user", "developer") or (role == "system" and i > 0)
            if answered or (last and role in ("system", "assistant")):
                out.append(ASSISTANT + (THINK if thinking and (not drop or i >= last_user) else END_THINK))
        return "".join(out)

    def _mode(self, options: dict) -> tuple[bool, int, bool]:
        thinking = self._thinking(options)
        effort = options.get("reasoning_effort")
        if effort == "none":
            thinking, effort = False, None
        effort = DEFAULT_EFFORT if effort is None else effort
        if isinstance(effort, str) and effort.isdigit():
            effort = int(effort)
        if isinstance(effort, bool) or not (effort in EFFORTS or (isinstance(effort, int) and 1 <= effort <= 100)):
            raise ChatFormatError(f"reasoning_effort for DeepSeek-V4.1 must be one of {list(EFFORTS)}, 'none' or an "
                                  f"integer in [1, 100], got {effort!r}", "reasoning_effort")
        return thinking, EFFORTS.get(effort, effort), options.get("drop_thinking", True)


def _attach_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Request-level tools go into the first system message, or a new empty one at the start."""
    turns = [dict(m, index=i) for i, m in enumerate(messages)]
    if tools:
        system = next((t for t in turns if t["role"] == "system"), None)
        if system is None:
            turns.insert(0, system := {"role": "system", "content": "", "index": 0})
        system["tools"] = tools
    return turns


def _last_user(turns: list[dict]) -> int:
    """The last user or developer turn, or system turn after the first: the assistant header after
    it opens the reply's reasoning."""
    return max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer") or
                (t["role"] == "system" and i > 0)), default=-1)


def _drop_thinking(turns: list[dict]) -> list[dict]:
    """Thinking mode: before the last user turn, assistants lose their reasoning and developer turns go."""
    last = _last_user(turns)
    out = []
    for i, turn in enumerate(turns):
        if turn["role"] in ("user", "system") or i >= last:
            out.append(turn)
        elif turn["role"] == "assistant":
            out.append({k: v for k, v in turn.items() if k != "reasoning_content"})
    return out
