"""Errors in OpenAI's shape, on a server with an API key, one sequence slot, a waiting queue of
one, a small body limit and a short grammar-compile timeout (and DSpark drafting on, for its
metric): 400 naming the field, 401, 404, 413, 503; bad requests leave a running one untouched."""

from __future__ import annotations

import http.client
import json
import threading

import openai
import pytest

from conftest import SHIPPED, running_server, wait_until

KEY = "sk-test-key"
LIMIT = 1 << 20  # bytes of request body
MAX_MODEL_LEN = 2048
LONG = dict(model=SHIPPED, prompt="def main():", temperature=0.0, max_tokens=1500, stream=True,
            extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def small():
    with running_server("--max-num-seqs", "1", "--max-waiting-requests", "1", "--api-key", KEY,
                        "--max-body-bytes", str(LIMIT), "--max-model-len", str(MAX_MODEL_LEN),
                        env={"DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_XGRAMMAR_TIMEOUT": "0.3",
                             # 3 drafts every step: a dynamic length drafts little on a loaded CPU (7 tokens in
                             # one CI run, none accepted), which the acceptance test cannot count on
                             "DEEPINFER_ENABLE_MTP_VARLEN": "0"}) as s:
        yield s


@pytest.fixture(scope="module")
def authed(small):
    with small.client(api_key=KEY) as c:
        yield c


def _error(exc: openai.APIStatusError) -> dict:
    assert set(exc.body) == {"message", "type", "param", "code"}, exc.body  # OpenAI's error object
    return exc.body


def test_api_key_is_required_on_v1_routes(small, authed):
    with small.client(api_key="wrong") as bad, pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and _error(err.value)["code"] == "invalid_api_key"
    status, body = small.post("/v1/completions", {"model": SHIPPED, "prompt": "x"})  # no key at all
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert [m.id for m in authed.models.list().data] == [SHIPPED]
    assert small.get("/health")[0] == 200 and small.get("/metrics")[0] == 200  # probes need no key


def test_unknown_model_and_route_are_404(small, authed):
    with pytest.raises(openai.NotFoundError) as err:
        authed.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert _error(err.value)["code"] == "model_not_found" and err.value.body["param"] == "model"
    status, body = small.post("/v1/nowhere", {}, {"authorization": f"Bearer {KEY}"})
    assert status == 404 and body["error"]["code"] == "not_found"


def test_oversized_body_is_413_with_or_without_a_length(small, authed):
    with pytest.raises(openai.APIStatusError) as err:
        authed.completions.create(model=SHIPPED, prompt="x" * (LIMIT + 1000), max_tokens=1)
    assert err.value.status_code == 413 and _error(err.value)["code"] == "request_too_large"
    conn = http.client.HTTPConnection(small.url.removeprefix("http://"), timeout=30)
    try:  # chunked: no Content-Length to refuse up front, so the limit applies while reading
        conn.putrequest("POST", "/v1/completions")
        for name, value in {"authorization": f"Bearer {KEY}", "content-type": "application/json",
                            "transfer-encoding": "chunked"}.items():
            conn.putheader(name, value)
        conn.endheaders()
        body = json.dumps({"model": SHIPPED, "prompt": "y" * (LIMIT + 1000)}).encode()
        for i in range(0, len(body), 8192):
            piece = body[i:i + 8192]
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.send(b"0\r\n\r\n")
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


BAD = [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed=-1), "seed"), (dict(n=0), "n"), (dict(logprobs=50), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(extra_body={"top_k": -5}), "top_k"), (dict(prompt=[]), "prompt"), (dict(prompt=[[5, 10 ** 6]]), "prompt"),
    (dict(prompt=list(range(1, MAX_MODEL_LEN + 52))), "prompt"),  # longer than max_model_len
    (dict(extra_body={"so_args": {"schema_type": "regex", "schema": "(unclosed"}}), "so_args"),
    (dict(extra_body={"so_args": {"schema_type": "yaml", "schema": "x"}}), "so_args"),
    (dict(extra_body={"colour": "red"}), "colour"), (dict(suffix="x"), "suffix"), (dict(best_of=3), "best_of"),
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
    (dict(logit_bias={"5": 101.0}), "logit_bias"), (dict(logit_bias={"10000000": 1.0}), "logit_bias"),  # past the vocab
    (dict(n=129), "n"), (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 1.5}), "min_p"), (dict(extra_body={"min_tokens": 9}), "min_tokens"),  # > max_tokens 4
    (dict(extra_body={"allowed_token_ids": [10 ** 7]}), "allowed_token_ids"),
    (dict(extra_body={"bad_words": [""]}), "bad_words"),
]


@pytest.mark.parametrize("kwargs, param", BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_400_naming_the_field(authed, kwargs, param):
    body = dict(model=SHIPPED, prompt="def f():", max_tokens=4)
    body.update(kwargs)
    with pytest.raises(openai.BadRequestError) as err:
        authed.completions.create(**body)
    assert _error(err.value)["param"] == param and err.value.body["type"] == "invalid_request_error"


def test_bad_requests_do_not_disturb_a_running_one(authed):
    expected = authed.completions.create(**{**LONG, "stream": False, "max_tokens": 80}).choices[0].text
    stream = authed.completions.create(**{**LONG, "max_tokens": 80})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    for kwargs, _ in BAD[:6]:  # while it runs
        with pytest.raises(openai.BadRequestError):
            authed.completions.create(**{"model": SHIPPED, "prompt": "x", "max_tokens": 4, **kwargs})
    text += "".join(c.choices[0].text for c in chunks)
    assert text == expected


def test_a_full_queue_is_503(small, authed):
    """One slot, one waiting place: a running request, a waiting one, then a third is refused;
    once the first client leaves, the waiting one runs to completion."""
    before = small.metrics().get('deepinfer:request_success_total{finished_reason="abort"}', 0)
    running = authed.completions.create(**LONG)
    next(iter(running))  # it holds the slot
    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.update(
        resp=authed.completions.create(model=SHIPPED, prompt="import os", max_tokens=5, temperature=0.0)))
    thread.start()
    try:
        wait_until(lambda: small.metrics()["deepinfer:num_requests_waiting"] == 1, 60, "the second request to wait")
        with pytest.raises(openai.APIStatusError) as err:
            authed.completions.create(model=SHIPPED, prompt="x", max_tokens=5)
        assert err.value.status_code == 503 and _error(err.value)["code"] == "queue_full"
    finally:
        running.close()  # the client leaves: its request is aborted and the waiting one gets the slot
        thread.join(120)
    assert waiting["resp"].usage.completion_tokens == 5
    after = small.metrics()['deepinfer:request_success_total{finished_reason="abort"}']
    assert after == before + 1


def test_dspark_acceptance_is_reported(small, authed):
    authed.completions.create(model=SHIPPED, prompt="def fibonacci(n):", max_tokens=64, temperature=0.0)
    m = small.metrics()
    drafted = m["deepinfer:spec_decode_num_draft_tokens_total"]
    accepted = m["deepinfer:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and 0 < accepted <= drafted
    assert m["deepinfer:spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)


def test_a_grammar_that_compiles_too_slowly_is_a_400(authed):
    """Quick to check, seconds to compile (every token against every word): past the timeout
    the engine drops the request alone, and the client learns why."""
    words = ["".join(chr(97 + (i * 7 + j * 13) % 26) for j in range(12)) + str(i) for i in range(20000)]
    so_args = {"schema_type": "json", "schema": {"enum": words}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError if not stream else openai.APIError) as err:
            resp = authed.completions.create(model=SHIPPED, prompt="x", max_tokens=8, stream=stream,
                                             extra_body={"so_args": so_args})
            for _ in resp:  # a stream reports the error as an event
                pass
        assert "DEEPINFER_XGRAMMAR_TIMEOUT" in str(err.value)

