"""Chat-format goldens both DeepSeek formats' tests share (V4: test_chat_formats.py, V4.1:
test_chat_format_v41.py): a tool, two calls of it, and the part of DeepSeek's tools section that is
the same text in both (the part before it names each dialect's DSML tags)."""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS_SECTION_TAIL = """String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
CALLS = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
         {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]
