"""The DeepSeek-V4 chat format through a real server: a tiny random V4 with DeepSeek's 129,280-
token vocabulary gets it automatically. Random weights write noise, so golden model outputs are
forced with a regex (so_args): the server must turn them into reasoning_content, content and
tool_calls, streamed or not; and streamed text never splits a UTF-8 character."""

from __future__ import annotations

import json
import re

import pytest

from conftest import running_server

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_OUTPUT = ('I need the weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
               '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
               '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
               '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


def literal(text: str) -> dict:
    """so_args forcing exactly `text` (a regex that escapes only the metacharacters)."""
    return {"schema_type": "regex", "schema": re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)}


@pytest.fixture(scope="module")
def ds_server(tmp_path_factory):
    from tiny_models import save_deepseek_vocab_model

    path = tmp_path_factory.mktemp("ds_vocab_model")
    save_deepseek_vocab_model(path)
    with running_server("--model", str(path), "--served-model-name", "dsv4-tiny", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "512", "--num-cache-pages", "32") as server:
        server.model_dir = path
        yield server


@pytest.fixture(scope="module")
def ds_client(ds_server):
    with ds_server.client() as c:
        yield c


def test_the_prompt_is_the_deepseek_v4_encoding(ds_server, ds_client):
    from deepinfer.core.tokenizer import Tokenizer

    golden = f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜></think>"
    resp = ds_client.chat.completions.create(
        model="dsv4-tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=1, extra_body={"chat_template_kwargs": {"thinking": False}})
    tokenizer = Tokenizer(ds_server.model_dir, bos_token_id=0)
    ids = tokenizer.encode(golden, add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(ids) and ids[0] == 0 and ids.count(0) == 1  # one BOS
    thinking = ds_client.chat.completions.create(model="dsv4-tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=1)
    # BOS <｜User｜> Hi <｜Assistant｜> <think>: thinking is the default
    assert thinking.usage.prompt_tokens == len(tokenizer.encode(f"{BOS}<｜User｜>Hi<｜Assistant｜><think>",
                                                                add_special_tokens=False)) == 5


def _ask(client, **kw):
    return client.chat.completions.create(
        model="dsv4-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        temperature=0.0, max_tokens=200, extra_body={"so_args": literal(TOOL_OUTPUT)}, **kw)


def test_tool_calls_and_reasoning_from_a_golden_output(ds_client):
    choice = _ask(ds_client).choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.model_extra["reasoning_content"] == "I need the weather."
    assert msg.content is None
    [call] = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_streamed_tool_calls_and_reasoning_join_to_the_same_message(ds_client):
    reasoning, content, calls, reasons = "", "", [], []
    for chunk in _ask(ds_client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert reasoning == "I need the weather." and content == ""
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris", "days": 2})]
    assert [r for r in reasons if r] == ["tool_calls"]


def test_thinking_off_the_output_is_content(ds_client):
    resp = ds_client.chat.completions.create(
        model="dsv4-tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0.0, max_tokens=50,
        extra_body={"so_args": literal("Hello there."), "chat_template_kwargs": {"thinking": False}})
    msg = resp.choices[0].message
    assert msg.content == "Hello there." and not msg.model_extra.get("reasoning_content") and not msg.tool_calls
    assert resp.choices[0].finish_reason == "stop"


def test_streamed_text_never_splits_a_utf8_character(ds_client):
    """Forced multi-byte characters that the tokens split (some tokens are half a character)."""
    body = dict(model="dsv4-tiny", prompt="x", temperature=0.0, max_tokens=80, logprobs=0,
                extra_body={"so_args": {"schema_type": "regex", "schema": "(日本語|😀|é|ü){10}"}})
    whole = ds_client.completions.create(**body).choices[0]
    assert len(whole.text) >= 10 and "\ufffd" not in whole.text
    assert any("\ufffd" in t for t in whole.logprobs.tokens)  # the output did split characters across tokens
    pieces = [c.choices[0].text for c in ds_client.completions.create(stream=True, **body)]
    assert "".join(pieces) == whole.text
    assert all("\ufffd" not in p for p in pieces)


FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "forecast"}}, "required"])
def test_tool_choice_forces_a_call_that_follows_the_schema(ds_client, choice):
    """Random weights never call a tool on their own: the format's grammar makes them (a named
    function: that one; "required": any), with arguments from the schema."""
    resp = ds_client.chat.completions.create(
        model="dsv4-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[FORECAST, NOW],
        tool_choice=choice, temperature=0.0, max_tokens=300, extra_body={"chat_template_kwargs": {"thinking": False}})
    choice_out = resp.choices[0]
    assert choice_out.finish_reason == "tool_calls", choice_out.message
    calls = choice_out.message.tool_calls
    assert calls and all(c.function.name in ("forecast", "now") for c in calls)
    for call in calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "forecast":
            assert args["city"] in ("Paris", "Rome") and set(args) <= {"city", "metric"}
        else:
            assert args == {}
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["forecast"]


def test_tool_choice_must_name_a_given_tool(ds_client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        ds_client.chat.completions.create(model="dsv4-tiny", messages=[{"role": "user", "content": "x"}],
                                          tools=[NOW], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"
