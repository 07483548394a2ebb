"""/v1/completions on the shipped model through the openai client: streaming equals the whole
response, the same text as the offline LLM, usage, stop strings, seeds, logprobs, echo, n."""

from __future__ import annotations

import math

import pytest

from conftest import SHIPPED, stream_text

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():"]
GREEDY = dict(model=SHIPPED, temperature=0.0, max_tokens=40)


def test_streamed_deltas_join_to_the_greedy_text_and_match_the_offline_llm(client, tokenizer):
    from deepinfer import LLM, SamplingParams

    whole = [client.completions.create(prompt=p, **GREEDY) for p in PROMPTS]
    for p, resp in zip(PROMPTS, whole):
        text, reason = stream_text(client.completions.create(prompt=p, stream=True, **GREEDY))
        assert text == resp.choices[0].text and reason == resp.choices[0].finish_reason
        assert resp.usage.prompt_tokens == len(tokenizer.encode(p))
        assert resp.usage.completion_tokens == 40 and resp.choices[0].finish_reason == "length"
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + 40
    llm = LLM(max_num_seqs=4)  # the same greedy requests offline, one at a time as above
    try:
        for p, resp in zip(PROMPTS, whole):
            out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
            assert out.outputs[0].text == resp.choices[0].text
    finally:
        llm.close()


def test_prompt_lists_token_ids_and_n(client, tokenizer):
    resp = client.completions.create(prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    texts = [c.text for c in resp.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # greedy: n copies agree
    assert resp.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert resp.usage.completion_tokens == 4 * 40
    by_ids = client.completions.create(prompt=tokenizer.encode(PROMPTS[0]), **GREEDY)
    assert by_ids.choices[0].text == texts[0]
    batch = client.completions.create(prompt=[tokenizer.encode(p) for p in PROMPTS], **GREEDY)
    assert [c.text for c in batch.choices] == [texts[0], texts[2]]


def test_stop_strings_end_the_text_before_them(client):
    full = client.completions.create(prompt=PROMPTS[0], **GREEDY).choices[0].text
    stop = full[12:16]  # a string the greedy text reaches after some tokens
    assert stop.strip(), full
    at = full.index(stop)
    resp = client.completions.create(prompt=PROMPTS[0], stop=[stop, "never-appears"], **GREEDY)
    choice = resp.choices[0]
    assert choice.text == full[:at]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    text, reason = stream_text(client.completions.create(prompt=PROMPTS[0], stop=[stop], stream=True, **GREEDY))
    assert (text, reason) == (full[:at], "stop")  # no piece of the stop string leaked into the stream


def test_same_seed_same_text_other_seed_other_text(client):
    sample = dict(model=SHIPPED, prompt=PROMPTS[0], temperature=1.0, max_tokens=30)
    a = client.completions.create(seed=7, **sample).choices[0].text
    assert client.completions.create(seed=7, **sample).choices[0].text == a
    assert stream_text(client.completions.create(seed=7, stream=True, **sample))[0] == a
    assert client.completions.create(seed=8, **sample).choices[0].text != a
    # choice i samples with seed + i: reproducible, and unlike its sibling
    two = [c.text for c in client.completions.create(seed=7, n=2, **sample).choices]
    assert two[0] != two[1] and [c.text for c in client.completions.create(seed=7, n=2, **sample).choices] == two


def test_logprobs_are_present_and_consistent(client):
    resp = client.completions.create(prompt=PROMPTS[1], logprobs=3, **GREEDY)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3
        assert top[token] == value == max(top.values())  # greedy took the most likely token
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    streamed = []
    for chunk in client.completions.create(prompt=PROMPTS[1], logprobs=3, stream=True, **GREEDY):
        streamed += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_echo_prepends_the_prompt_and_its_logprobs(client, tokenizer):
    resp = client.completions.create(prompt=PROMPTS[0], echo=True, logprobs=1, **GREEDY)
    plain = client.completions.create(prompt=PROMPTS[0], **GREEDY).choices[0].text
    choice = resp.choices[0]
    assert choice.text == PROMPTS[0] + plain
    n_prompt = len(tokenizer.encode(PROMPTS[0]))
    assert len(choice.logprobs.tokens) == n_prompt + 40
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
    text, _ = stream_text(client.completions.create(prompt=PROMPTS[0], echo=True, stream=True, **GREEDY))
    assert text == PROMPTS[0] + plain


def test_stream_usage_comes_last(client):
    chunks = list(client.completions.create(prompt=PROMPTS[0], stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])


def test_vllm_sampling_fields_and_n_streaming(client):
    """Penalties, bias and vLLM's extra fields are accepted on both routes; n streams with choice indexes,
    each choice's text equal to the same request without streaming (seeded: choice i gets seed + i)."""
    fields = dict(frequency_penalty=0.5, presence_penalty=0.3, logit_bias={"5": -100},
                  extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 3, "top_k": 20,
                              "bad_words": ["import"], "include_stop_str_in_output": True, "skip_special_tokens": True})
    body = dict(model=SHIPPED, prompt="def f(x):", max_tokens=12, temperature=0.8, seed=7, n=2, **fields)
    whole = client.completions.create(**body)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in whole.choices}
    chat = client.chat.completions.create(model=SHIPPED, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0.0, n=2, **fields)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content


def _pieces(client, prompt: str) -> list[str]:
    stream = client.completions.create(prompt=prompt, stream=True, **GREEDY | dict(extra_body={"ignore_eos": True}))
    return [c.choices[0].text for c in stream if c.choices and c.choices[0].text]


def test_a_stream_carries_each_token_as_it_is_decoded_and_stream_interval_batches_them(client):
    """The engine decodes up to 8 greedy steps per call by default; the stream still gets each
    token as its step ends (a 40-token completion in about 40 pieces, the loop merging some when it
    falls behind), and `--stream-interval 8` sends them once per call: the same text in few pieces."""
    from conftest import running_server

    per_token = _pieces(client, PROMPTS[1])
    assert len(per_token) >= 20, per_token
    with running_server("--stream-interval", "8") as server, server.client() as batched_client:
        assert server.metrics()["sglang:num_running_reqs"] == 0  # routers' gauges exist before any request
        batched = _pieces(batched_client, PROMPTS[1])
    assert "".join(batched) == "".join(per_token)
    assert len(batched) <= 8, batched
