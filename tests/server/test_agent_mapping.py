"""The agent APIs' mapping without a server: Responses input items and Anthropic content blocks ->
the chat messages a chat format renders (the same prompt /v1/chat/completions gets for the same
conversation), and a DeepSeek-V4.1 reply with reasoning and DSML tool calls -> output items /
content blocks, whole and streamed in every split, fed through the official clients' own stream
accumulators (openai's ResponseStreamState, anthropic's accumulate_event)."""

from __future__ import annotations

import base64
import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from chat_goldens import WEATHER
from deepinfer.entrypoints.chat import ChatDelta
from deepinfer.entrypoints.chat.deepseek_v41 import DeepseekV41ChatFormat
from deepinfer.entrypoints.chat_turn import ImagePart
from deepinfer.entrypoints.protocol_anthropic import MessagesRequest
from deepinfer.entrypoints.protocol_responses import ResponsesRequest
from deepinfer.entrypoints.serving import APIError
from deepinfer.entrypoints.serving_messages import MessageWriter, conversation
from deepinfer.entrypoints.serving_responses import ResponseWriter, input_messages

V41 = DeepseekV41ChatFormat()
REPLY = ('I need the weather.</think>Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
         '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
         '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
         '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
         '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
CHAT_HISTORY = [  # the conversation both agent APIs' histories below stand for, as chat messages
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "I need the weather.",
     "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
                    for i, args in ((1, '{"city": "Paris"}'), (2, '{"city": "Rome"}'))]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "user", "content": "Thanks. Tomorrow?"},
]


def _prompt() -> str:
    return V41.render([{"role": "user", "content": "Weather?"}], [WEATHER], {})


def _fed(writer, pieces: list[str], finish_reason: str, *finish_args) -> list[dict]:
    parser = V41.parser(_prompt(), True)
    events = writer.start()
    for piece in pieces:
        events += writer.feed(parser.feed(piece))
    events += writer.feed(parser.finish())
    return events + writer.finish(finish_reason, *finish_args)


def _without_ids(value):
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "call_id", "item_id")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _responses_body(**kw) -> ResponsesRequest:
    return ResponsesRequest(model="m", input=kw.pop("input", "Weather?"),
                            tools=[{"type": "function", **WEATHER["function"]}], **kw)


# ------------------------------------------------------------------ /v1/responses
def test_a_reply_becomes_reasoning_message_and_function_call_items():
    writer = ResponseWriter(_responses_body(), prompt_tokens=7)
    events = _fed(writer, [REPLY], "stop", 30, 5)
    response = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and response["status"] == "completed"
    reasoning, message, paris, rome = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "I need the weather."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "Checking."
    assert message["status"] == "completed"
    assert (paris["type"], paris["name"], json.loads(paris["arguments"])) == \
        ("function_call", "get_weather", {"city": "Paris", "days": 2})
    assert json.loads(rome["arguments"]) == {"city": "Rome"} and paris["call_id"] != rome["call_id"]
    assert response["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 30,
                                 "output_tokens_details": {"reasoning_tokens": 5}, "total_tokens": 37}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_openai_client_accumulates_the_stream_to_the_same_response():
    writer = ResponseWriter(_responses_body(), prompt_tokens=7)
    events = _fed(writer, [REPLY[:5], REPLY[5:40], REPLY[40:]], "stop", 30, 5)
    state = ResponseStreamState(input_tools=[{"type": "function", **WEATHER["function"]}], text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(json.dumps(event))))
    final = state._completed_response
    assert final is not None and final.output_text == "Checking."
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "I need the weather."
    assert [(c.name, json.loads(c.arguments)) for c in final.output[2:]] == \
        [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
    assert [item.id for item in final.output] == [item["id"] for item in events[-1]["response"]["output"]]


def test_streamed_in_any_split_the_items_equal_the_whole():
    whole = _fed(ResponseWriter(_responses_body(), 7), [REPLY], "stop", 30, 5)[-1]["response"]["output"]
    for cut in range(len(REPLY) + 1):
        split = ResponseWriter(_responses_body(), 7)
        _fed(split, [REPLY[:cut], REPLY[cut:]], "stop", 30, 5)
        assert _without_ids(split.output) == _without_ids(whole), cut


def test_running_out_of_tokens_is_an_incomplete_response():
    writer = ResponseWriter(_responses_body(), prompt_tokens=7)
    events = _fed(writer, ["I need the"], "length", 3, 3)
    assert events[-1]["type"] == "response.incomplete"
    response = events[-1]["response"]
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    [reasoning] = response["output"]
    assert reasoning["status"] == "incomplete" and reasoning["content"][0]["text"] == "I need the"


def test_an_empty_reply_is_one_empty_message():
    writer = ResponseWriter(_responses_body(), prompt_tokens=7)
    writer.feed(ChatDelta())
    events = writer.finish("stop", 1, 0)
    [message] = events[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == ""


def test_input_items_are_the_chat_conversation():
    body = _responses_body(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                         "text": "I need the weather."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. Tomorrow?"}]},
    ])
    messages, sources = input_messages(body)
    assert messages == CHAT_HISTORY
    assert sources == ["instructions", "input[0]", "input[1]", "input[5]", "input[6]", "input[7]"]
    assert V41.render(messages, [WEATHER], {}) == V41.render(CHAT_HISTORY, [WEATHER], {})


@pytest.mark.parametrize("item, param", [
    ({"type": "item_reference", "id": "msg_1"}, "input[0].type"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]},
     "input[0].content[0].image_url"),
    ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
])
def test_bad_input_items_name_the_item(item, param):
    with pytest.raises(APIError) as err:
        input_messages(_responses_body(input=[item]))
    assert err.value.status == 400 and err.value.param == param and param.split(".")[0] in err.value.message


def test_an_image_part_is_decoded_where_it_stood():
    png = b"\x89PNG fake"
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages, _ = input_messages(_responses_body(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Look"}, {"type": "input_image", "image_url": url}]}]))
    assert messages[0]["content"] == ["Look", ImagePart(png, "input[0].content[1]")]


# ------------------------------------------------------------------ /v1/messages
def test_a_reply_becomes_thinking_text_and_tool_use_blocks():
    writer = MessageWriter("m", prompt_tokens=7)
    events = _fed(writer, [REPLY], "stop", None, 30)
    final = writer.final
    assert [b["type"] for b in final["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert final["content"][0] == {"type": "thinking", "thinking": "I need the weather.", "signature": ""}
    assert final["content"][1] == {"type": "text", "text": "Checking."}
    assert final["content"][2]["name"] == "get_weather" and final["content"][2]["input"] == {"city": "Paris", "days": 2}
    assert final["content"][3]["input"] == {"city": "Rome"} and final["content"][2]["id"].startswith("toolu_")
    assert final["stop_reason"] == "tool_use" and final["usage"] == {"input_tokens": 7, "output_tokens": 30}
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_the_anthropic_client_accumulates_any_split_to_the_whole_message():
    whole = MessageWriter("m", 7)
    _fed(whole, [REPLY], "stop", None, 30)
    for cut in range(len(REPLY) + 1):
        split = MessageWriter("m", 7)
        snapshot, bufs = None, {}
        for event in _fed(split, [REPLY[:cut], REPLY[cut:]], "stop", None, 30):
            snapshot = accumulate_event(event=json.loads(json.dumps(event)), current_snapshot=snapshot, json_bufs=bufs)
        got = snapshot.to_dict(exclude_none=True)
        assert _without_ids(got["content"]) == _without_ids(whole.final["content"]), cut
        assert got["stop_reason"] == "tool_use" and got["usage"]["output_tokens"] == 30


def test_stop_reasons():
    for finish, stop, reason, sequence in [("length", None, "max_tokens", None),
                                           ("stop", "\n\n", "stop_sequence", "\n\n"), ("stop", 1, "end_turn", None)]:
        writer = MessageWriter("m", 1)
        writer.feed(ChatDelta(content="hi"))
        events = writer.finish(finish, stop, 2)
        assert (writer.final["stop_reason"], writer.final["stop_sequence"]) == (reason, sequence)
        assert events[-2]["delta"] == {"stop_reason": reason, "stop_sequence": sequence}


def test_content_blocks_are_the_chat_conversation():
    body = MessagesRequest(model="m", max_tokens=5, system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I need the weather.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "c2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "c2", "content": [{"type": "text", "text": "rain"}]},
            {"type": "text", "text": "Thanks. Tomorrow?"}]},
    ])
    messages, sources = conversation(body)
    assert messages == CHAT_HISTORY
    assert sources == ["system", "messages[0]", "messages[1]", "messages[2]", "messages[2]", "messages[2]"]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "system", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://a.png"}}]}],
     "messages[0].content[0].source.url"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "text/plain",
                                                                 "data": "eA=="}}]}],
     "messages[0].content[0].source.media_type"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "Sure, "}], "messages[1].role"),
])
def test_bad_blocks_name_the_block(messages, param):
    with pytest.raises(APIError) as err:
        conversation(MessagesRequest(model="m", max_tokens=5, messages=messages))
    assert err.value.status == 400 and err.value.param == param
