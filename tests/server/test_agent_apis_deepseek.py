"""/v1/responses and /v1/messages with the DeepSeek-V4 chat format (a tiny random V4 with DeepSeek's
vocabulary gets it), on a server with an API key: the prompt of a conversation with tools and tool
results equals the chat route's for the same conversation; a golden reply (reasoning, then a DSML
tool call; random weights write noise, so it is forced with so_args) comes back as a reasoning item
and a function_call / a thinking and a tool_use block, whole and streamed; Anthropic clients
authenticate with x-api-key."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from conftest import running_server

KEY = "sk-agent-key"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOL_OUTPUT = ('I need the weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
               '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
               '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
FORCED = {"so_args": {"schema_type": "regex", "schema": re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", TOOL_OUTPUT)}}
CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.fixture(scope="module")
def ds_server(tmp_path_factory):
    from tiny_models import save_deepseek_vocab_model

    path = tmp_path_factory.mktemp("ds_vocab_model")
    save_deepseek_vocab_model(path)
    with running_server("--model", str(path), "--served-model-name", "dsv4-tiny", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "512", "--num-cache-pages", "32", "--api-key", KEY) as server:
        yield server


# the first request's prefill of a long prompt (the tools section) can take minutes on a loaded CI machine
SLOW = 900


@pytest.fixture(scope="module")
def gpt(ds_server):
    with openai.OpenAI(base_url=ds_server.base_url, api_key=KEY, max_retries=0, timeout=SLOW) as c:
        yield c


@pytest.fixture(scope="module")
def claude(ds_server):
    with anthropic.Anthropic(base_url=ds_server.url, api_key=KEY, max_retries=0, timeout=SLOW) as c:
        yield c


def test_a_tool_conversation_is_the_chat_routes_prompt(gpt, claude):
    chat = gpt.chat.completions.create(model="dsv4-tiny", messages=CHAT, max_tokens=4, temperature=0.0,
                                       tools=[{"type": "function", "function": WEATHER}])
    resp = gpt.responses.create(model="dsv4-tiny", max_output_tokens=4, temperature=0.0,
                                tools=[{"type": "function", **WEATHER}], input=[
                                    {"role": "user", "content": "Weather in Paris?"},
                                    {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                     "arguments": '{"city": "Paris"}'},
                                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    no_tools = gpt.chat.completions.create(model="dsv4-tiny", messages=CHAT[:1], max_tokens=1)
    assert chat.usage.prompt_tokens > no_tools.usage.prompt_tokens + 100  # the tools section is in the prompt
    msg = claude.messages.create(model="dsv4-tiny", max_tokens=4, extra_body={"temperature": 0.0},
                                 thinking={"type": "enabled", "budget_tokens": 1024},
                                 tools=[{"name": "get_weather", "description": "Weather of a city",
                                         "input_schema": WEATHER["parameters"]}], messages=[
                                     {"role": "user", "content": "Weather in Paris?"},
                                     {"role": "assistant", "content": [{"type": "tool_use", "id": "c1",
                                                                        "name": "get_weather",
                                                                        "input": {"city": "Paris"}}]},
                                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                                   "content": "sunny"}]}])
    assert msg.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_give_reasoning_and_a_function_call(gpt):
    kw = dict(model="dsv4-tiny", input="Weather in Paris?", tools=[{"type": "function", **WEATHER}],
              temperature=0.0, max_output_tokens=200, extra_body=FORCED)
    whole = gpt.responses.create(**kw)
    assert whole.status == "completed"
    reasoning, call = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I need the weather."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and whole.usage.output_tokens_details.reasoning_tokens > 0
    with gpt.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [("reasoning", None),
                                                                          ("function_call", "get_weather")]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}


def test_messages_give_thinking_and_tool_use(claude):
    kw = dict(model="dsv4-tiny", max_tokens=200, thinking={"type": "enabled", "budget_tokens": 1024},
              tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
              messages=[{"role": "user", "content": "Weather in Paris?"}], extra_body={"temperature": 0.0, **FORCED})
    whole = claude.messages.create(**kw)
    thinking, use = whole.content
    assert thinking.type == "thinking" and thinking.thinking == "I need the weather."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert whole.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as stream:
        deltas = {event.delta.type for event in stream if event.type == "content_block_delta"}
        final = stream.get_final_message()
    assert deltas == {"thinking_delta", "input_json_delta"}
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_the_api_key_in_either_header_and_errors_in_each_shape(ds_server):
    body = {"model": "dsv4-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    status, error = ds_server.post("/v1/messages", body, {"x-api-key": "wrong"})
    assert status == 401 and error["type"] == "error" and error["error"]["type"] == "authentication_error"
    status, ok = ds_server.post("/v1/messages", body, {"x-api-key": KEY})
    assert status == 200 and ok["type"] == "message"
    status, error = ds_server.post("/v1/responses", {"model": "dsv4-tiny", "input": "Hi"}, {"x-api-key": "wrong"})
    assert status == 401 and error["error"]["code"] == "invalid_api_key"
    with anthropic.Anthropic(base_url=ds_server.url, api_key="wrong", max_retries=0) as bad, \
            pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(**body)
    with ds_server.client(api_key="wrong") as bad, pytest.raises(openai.AuthenticationError):
        bad.responses.create(model="dsv4-tiny", input="Hi")
