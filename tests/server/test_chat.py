"""/v1/chat/completions on the shipped model (the plain chat format: it was never trained to
chat): streaming equals the whole message, the documented prompt, structured outputs
(response_format json_schema / json_object, so_args), logprobs, refusals of what it cannot do."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import SHIPPED

GREEDY = dict(model=SHIPPED, temperature=0.0, max_tokens=32)
MESSAGES = [{"role": "system", "content": "# utilities"}, {"role": "user", "content": "def fibonacci(n):"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "size", "tags"], "additionalProperties": False}


def _joined(stream) -> tuple[str, str | None, list]:
    text, reason, chunks = "", None, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason, chunks


def test_streamed_chat_joins_to_the_whole_message(client):
    whole = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content and not msg.tool_calls
    text, reason, chunks = _joined(client.chat.completions.create(messages=MESSAGES, stream=True, **GREEDY))
    assert text == msg.content and reason == whole.choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert whole.usage.completion_tokens == 32


def test_plain_format_is_the_messages_text_completed(client, tokenizer):
    """Documented: each message's content and a newline, tokenized like a completions prompt."""
    prompt = "".join(m["content"] + "\n" for m in MESSAGES)
    chat = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    completion = client.completions.create(prompt=prompt, **GREEDY)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(prompt)) == completion.usage.prompt_tokens
    assert chat.choices[0].message.content == completion.choices[0].text


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    for seed in range(3):
        resp = client.chat.completions.create(model=SHIPPED, messages=MESSAGES, temperature=1.0, max_tokens=80,
                                              seed=seed, response_format=fmt)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    obj = client.chat.completions.create(model=SHIPPED, messages=MESSAGES, temperature=1.0, max_tokens=60, seed=1,
                                         response_format={"type": "json_object"}, extra_body={"top_k": 20})
    if obj.choices[0].finish_reason == "stop":  # a free-form object may not close within the budget
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    so_args = {"schema_type": "regex", "schema": "[a-z]{3}-[0-9]{2}"}
    regex = client.chat.completions.create(messages=MESSAGES, **GREEDY, extra_body={"so_args": so_args})
    content = regex.choices[0].message.content
    assert len(content) == 6 and content[3] == "-" and content[:3].isalpha() and content[4:].isdigit()


def test_chat_logprobs(client):
    resp = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    assert "".join(e.token for e in entries) == resp.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob  # greedy: the top one
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    bare = client.chat.completions.create(messages=MESSAGES, logprobs=True, **GREEDY).choices[0].logprobs.content
    assert [e.logprob for e in bare] == pytest.approx([e.logprob for e in entries]) and not bare[0].top_logprobs


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), "tools"),
    (dict(extra_body={"chat_template_kwargs": {"thinking": True}}), "chat_template_kwargs.thinking"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),  # the shipped model has no vision encoder
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
     "messages[0].content"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(tool_choice="required"), "tool_choice"),  # without tools
])
def test_what_the_plain_format_cannot_do_is_a_400_naming_the_field(client, kwargs, param):
    body = dict(messages=MESSAGES, **GREEDY)
    body.update(kwargs)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
