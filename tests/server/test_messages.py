"""/v1/messages (Anthropic's Messages API) on the shipped model through the official anthropic
client: the reply equals LLM.generate on the same conversation through the model's chat format
(plain: the shipped model was never trained to chat), whole and streamed, in the documented event
order; stop_sequences and max_tokens as stop reasons; count_tokens; bad requests are 400s in
Anthropic's error shape {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import anthropic
import pytest

from conftest import SHIPPED

GREEDY = dict(model=SHIPPED, max_tokens=24, extra_body={"temperature": 0.0})  # newer clients no longer name it
MESSAGES = [{"role": "user", "content": "def fibonacci(n):"},
            {"role": "assistant", "content": [{"type": "text", "text": "    pass"}]},
            {"role": "user", "content": [{"type": "text", "text": "def main():"}]}]
CHAT = [{"role": "system", "content": "# utilities"}, {"role": "user", "content": "def fibonacci(n):"},
        {"role": "assistant", "content": "    pass"}, {"role": "user", "content": "def main():"}]


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_the_reply_equals_generate_through_the_chat_format(claude, tokenizer):
    from deepinfer import LLM, SamplingParams
    from deepinfer.entrypoints.chat.base import PlainChatFormat

    whole = claude.messages.create(system="# utilities", messages=MESSAGES, **GREEDY)
    prompt = PlainChatFormat().render(CHAT, None, {})
    assert whole.type == "message" and whole.role == "assistant" and whole.model == SHIPPED
    assert whole.usage.input_tokens == len(tokenizer.encode(prompt)) and whole.usage.output_tokens == 24
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    [block] = whole.content
    with claude.messages.stream(system=[{"type": "text", "text": "# utilities"}], messages=MESSAGES, **GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == block.text and final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24 and final.usage.input_tokens == whole.usage.input_tokens
    llm = LLM(max_num_seqs=4)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    finally:
        llm.close()
    assert block.type == "text" and block.text == out.outputs[0].text and block.text


def test_the_stream_is_the_documented_event_sequence(claude):
    events = list(claude.messages.create(messages=MESSAGES[:1], stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1 and kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.usage.output_tokens == 0
    assert events[1].index == 0 and events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 24


def test_a_stop_sequence_ends_the_text_before_it(claude):
    full = claude.messages.create(messages=MESSAGES[:1], **GREEDY).content[0].text
    stop = full[8:12]
    assert stop.strip(), full
    resp = claude.messages.create(messages=MESSAGES[:1], stop_sequences=[stop, "never-appears"], **GREEDY)
    assert resp.content[0].text == full[:full.index(stop)]
    assert resp.stop_reason == "stop_sequence" and resp.stop_sequence == stop
    with claude.messages.stream(messages=MESSAGES[:1], stop_sequences=[stop], **GREEDY) as s:
        final = s.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (resp.content[0].text,
                                                                               "stop_sequence", stop)


def test_count_tokens_counts_the_prompt_a_message_gets(claude):
    count = claude.messages.count_tokens(model=SHIPPED, system="# utilities", messages=MESSAGES)
    whole = claude.messages.create(system="# utilities", messages=MESSAGES, **{**GREEDY, "max_tokens": 1})
    assert count.input_tokens == whole.usage.input_tokens


def _bad(claude, status: int = 400, **kw) -> dict:
    with pytest.raises(anthropic.APIStatusError) as err:
        claude.messages.create(**{"messages": MESSAGES[:1], **GREEDY, **kw})
    assert err.value.status_code == status
    body = err.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


@pytest.mark.parametrize("kw, field", [
    (dict(extra_body={"temperature": 0.0, "bogus": 1}), "bogus"),
    (dict(extra_body={"temperature": 1.5}), "temperature"),  # Anthropic's range is [0, 1]
    (dict(max_tokens=0), "max_tokens"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]), "messages[1]"),
    (dict(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
     "messages[0].content[0]"),
    (dict(tools=[{"name": "f", "input_schema": {"type": "object"}}]), "tools"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0]"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (dict(tool_choice={"type": "any"}), "tool_choice"),
])
def test_bad_requests_are_400s_in_anthropics_shape(claude, kw, field):
    error = _bad(claude, **kw)
    assert error["type"] == "invalid_request_error" and error["message"].startswith(field), error


def test_an_unknown_model_is_a_404_not_found_error(claude):
    error = _bad(claude, 404, model="claude-nope")
    assert error["type"] == "not_found_error" and "claude-nope" in error["message"]


def test_other_routes_keep_openais_shape(server):
    status, body = server.post("/v1/chat/completions", {"model": SHIPPED, "messages": [], "bogus": 1})
    assert status == 400 and set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    status, body = server.post("/v1/messages", {"model": SHIPPED, "messages": []})
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
