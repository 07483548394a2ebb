"""/v1/responses (OpenAI's Responses API) on the shipped model through the official openai client:
the reply equals LLM.generate on the same conversation through the model's chat format (plain:
the shipped model was never trained to chat), whole and streamed, in the documented event order;
a response that ran out of max_output_tokens is "incomplete"; stateful fields and bad input are
400s in OpenAI's shape naming the field."""

from __future__ import annotations

import openai
import pytest

from conftest import SHIPPED

GREEDY = dict(model=SHIPPED, temperature=0.0, max_output_tokens=24)
INPUT = [{"role": "user", "content": "def fibonacci(n):"},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "    pass"}]},
         {"role": "user", "content": [{"type": "input_text", "text": "def main():"}]}]
CHAT = [{"role": "system", "content": "# utilities"}, {"role": "user", "content": "def fibonacci(n):"},
        {"role": "assistant", "content": "    pass"}, {"role": "user", "content": "def main():"}]


def _events(stream) -> list:
    return list(stream)


def test_the_reply_equals_generate_through_the_chat_format(client, tokenizer):
    from deepinfer import LLM, SamplingParams
    from deepinfer.entrypoints.chat.base import PlainChatFormat

    whole = client.responses.create(instructions="# utilities", input=INPUT, **GREEDY)
    prompt = PlainChatFormat().render(CHAT, None, {})
    assert whole.usage.input_tokens == len(tokenizer.encode(prompt))
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 24 and whole.usage.total_tokens == whole.usage.input_tokens + 24
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    events = _events(client.responses.create(instructions="# utilities", input=INPUT, stream=True, **GREEDY))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text and events[-1].response.output_text == whole.output_text
    llm = LLM(max_num_seqs=4)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    finally:
        llm.close()
    assert whole.output_text == out.outputs[0].text and whole.output_text


def test_the_stream_is_the_documented_event_sequence(client):
    events = _events(client.responses.create(input="def fibonacci(n):", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                                     "response.output_text.done", "response.content_part.done",
                                     "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item = events[2].item
    assert all(getattr(e, "item_id", item.id) == item.id for e in events)
    assert events[-4].text == "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_finished_response_is_completed_and_the_stream_helper_returns_it(client):
    """so_args (deepinfer's structured outputs) make the reply end before max_output_tokens."""
    forced = dict(input="def fibonacci(n):", extra_body={"so_args": {"schema_type": "regex", "schema": "return [0-9]"}},
                  model=SHIPPED, temperature=0.0, max_output_tokens=24)
    whole = client.responses.create(**forced)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.output_text.startswith("return ") and len(whole.output_text) == 8
    with client.responses.stream(**forced) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == whole.output_text
    json_mode = client.responses.create(input="def f():", text={"format": {"type": "json_object"}}, **GREEDY)
    assert json_mode.output_text.lstrip().startswith("{")


def _bad(client, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"input": "hi", **GREEDY, **kw})
    assert err.value.status_code == 400
    return err.value.body


def test_previous_response_id_is_refused_the_server_is_stateless(client):
    error = _bad(client, previous_response_id="resp_123")
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
    assert "stateless" in error["message"] and error["type"] == "invalid_request_error"
    assert _bad(client, conversation="conv_1")["param"] == "conversation"
    assert _bad(client, input=[{"type": "item_reference", "id": "msg_1"}])["param"] == "input[0].type"


@pytest.mark.parametrize("kw, param", [
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(temperature=-1.0), "temperature"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}]), "tools"),
    (dict(reasoning={"effort": "high"}), "reasoning.effort"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://a.example/x.png"}]}]),
     "input[0].content[0].image_url"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]),
     "input[0].content[0]"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_bad_fields_are_400s_naming_the_field(client, kw, param):
    error = _bad(client, **kw)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"]


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(input="hi", **{**GREEDY, "model": "nope"})
    assert err.value.body["code"] == "model_not_found"
