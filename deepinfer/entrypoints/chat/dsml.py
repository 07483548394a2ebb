"""DSML, the markup DeepSeek-V4 and V4.1 models write tool calls in, and the tools section of their
system prompt. The texts below are the models' format, so they must match their training data
byte for byte (they follow DeepSeek's published V4 and V4.1 encodings); the code is ours.

A block of calls, after the assistant's content (V4's tag names; V4.1 writes `<｜DSML｜ calls>`,
`<｜DSML｜ invoke ...>`, `<｜DSML｜ parameter ...>`: a space, and "calls"; `Dialect`):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String values are written as they are (string="true"); every other JSON value as JSON.
"""

from __future__ import annotations

import json
import re

from deepinfer.entrypoints.chat.base import ToolCall

DSML = "｜DSML｜"

_TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{calls_open}" block like the following:

{calls_open}
<{dsml}{invoke} name="$TOOL_NAME">
<{dsml}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}{parameter}>
...
</{dsml}{invoke}>
<{dsml}{invoke} name="$TOOL_NAME2">
...
</{dsml}{invoke}>
{calls_close}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class Dialect:
    """DSML with one family's tag names: `calls` (the block), `invoke` (a call), `parameter`."""

    def __init__(self, calls: str, invoke: str, parameter: str):
        self.calls, self.invoke, self.parameter = calls, invoke, parameter
        self.CALLS_OPEN = f"<{DSML}{calls}>"
        self.CALLS_CLOSE = f"</{DSML}{calls}>"
        self.INVOKE_HEAD = f"<{DSML}{invoke}"
        self.INVOKE_CLOSE = f"</{DSML}{invoke}>"
        head, close = re.escape(self.INVOKE_HEAD), re.escape(self.INVOKE_CLOSE)
        self._invoke = re.compile(rf'{head}\s+name="([^"]*)"\s*>(.*){close}', re.DOTALL)
        p_open, p_close = re.escape(f"<{DSML}{parameter}"), re.escape(f"</{DSML}{parameter}>")
        self._param = re.compile(rf'{p_open}\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?){p_close}', re.DOTALL)

    def tools_prompt(self, functions: list[dict]) -> str:
        """The tools section: one JSON schema per line, as the client sent it (key order kept)."""
        return _TOOLS_PROMPT.format(dsml=DSML, calls_open=self.CALLS_OPEN, calls_close=self.CALLS_CLOSE,
                                    invoke=self.invoke, parameter=self.parameter,
                                    schemas="\n".join(_json(f) for f in functions))

    def encode_calls(self, calls: list[tuple[str, dict]]) -> str:
        """A history turn's tool calls, (name, arguments) each, as the model writes them."""
        invokes = []
        for name, args in calls:
            params = "\n".join(
                f'<{DSML}{self.parameter} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
                f'{value if isinstance(value, str) else _json(value)}</{DSML}{self.parameter}>'
                for key, value in args.items())
            invokes.append(f'{self.INVOKE_HEAD} name="{name}">\n{params}\n{self.INVOKE_CLOSE}')
        return f"\n\n{self.CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{self.CALLS_CLOSE}"

    def parse_invoke(self, text: str) -> ToolCall | None:
        """One complete `<invoke ...>...</invoke>`; None when it is not well formed (the caller
        then keeps the raw text as content)."""
        m = self._invoke.fullmatch(text)
        if m is None:
            return None
        name, body = m.groups()
        args: dict = {}
        for key, is_string, value in self._param.findall(body):
            if key in args:
                return None
            if is_string == "true":
                args[key] = value
            else:
                try:
                    args[key] = json.loads(value)
                except json.JSONDecodeError:  # not JSON after all: keep the text rather than lose it
                    args[key] = value
        if self._param.sub("", body).strip():
            return None
        return ToolCall(name=name, arguments=_json(args))

    def calls_grammar(self, functions: list[dict], name: str | None = None) -> str:
        """EBNF of a block of calls that follow the functions' parameter schemas (parameters in
        schema order, the required ones present): one call of `name`, or one or more of any."""
        rules, choices = [], []
        for i, fn in enumerate(functions):
            if name is not None and fn["name"] != name:
                continue
            params = fn.get("parameters") or {}
            required = set(params.get("required") or ())
            parts = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                is_string, value = _value_rule(schema if isinstance(schema, dict) else {})
                opening = '<%s%s name="%s" string="%s">' % (DSML, self.parameter, key, "true" if is_string else "false")
                closing = "</%s%s>\n" % (DSML, self.parameter)
                rules.append(f"p{i}_{j} ::= {_lit(opening)} ({value}) {_lit(closing)}")
                parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
            head = '%s name="%s">\n' % (self.INVOKE_HEAD, fn["name"])
            rules.append(f"call{i} ::= {_lit(head)} {' '.join(parts)} {_lit(self.INVOKE_CLOSE)}")
            choices.append(f"call{i}")
        if not choices:
            raise ValueError(f"no tool named {name!r}")
        calls = "call" if name is not None else 'call ("\\n" call)*'
        root = f"root ::= {_lit(chr(10) * 2 + self.CALLS_OPEN + chr(10))} {calls} {_lit(chr(10) + self.CALLS_CLOSE)}"
        return "\n".join([root, f"call ::= {' | '.join(choices)}", *rules]) + _JSON_RULES


# ---------------------------------------------------------------- forcing calls (tool_choice)
_JSON_RULES = r'''
json ::= jobject | jarray | jstring | jnumber | "true" | "false" | "null"
jobject ::= "{" (jstring ":" json ("," jstring ":" json)*)? "}"
jarray ::= "[" (json ("," json)*)? "]"
jstring ::= "\"" ([^"\\<] | "\\" ["\\/bfnrt])* "\""
jnumber ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
text ::= [^<]*
'''


def _lit(text: str) -> str:
    """An EBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _value_rule(schema: dict) -> tuple[bool, str]:
    """(written as a DSML string, the EBNF of its value) for one parameter's JSON schema. Values
    never hold '<', which would start DSML markup."""
    if "enum" in schema:
        values = schema["enum"]
        if all(isinstance(v, str) for v in values):
            return True, " | ".join(_lit(v) for v in values)
        return False, " | ".join(_lit(_json(v)) for v in values)
    kind = schema.get("type")
    if kind == "string":
        return True, "text"
    if kind == "boolean":
        return False, '"true" | "false"'
    if kind == "integer":
        return False, '"-"? [0-9]+'
    if kind == "number":
        return False, '"-"? [0-9]+ ("." [0-9]+)?'
    return False, "json"


V4 = Dialect("tool_calls", "invoke", "parameter")
V41 = Dialect(" calls", " invoke", " parameter")
