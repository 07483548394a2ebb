"""vLLM's prefill/decode protocol (kv_transfer_params) behind the real vllm-router
(--vllm-pd-disaggregation): the router sends the request to the prefill worker with max_tokens 1 and
{"do_remote_decode": true}, then to the decode worker with the kv_transfer_params the prefill
answered; the state moves as in SGLang's protocol (Mooncake TCP on 127.0.0.1). Text equals colocated
LLM.generate, one transfer per request, nothing held afterwards; the protocol driven by hand; a room
no decode asks for is freed; bad kv_transfer_params are 400s naming the field."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from conftest import http, running_server, wait_until
from fleet import running_vllm_router
from pd import TRANSFER_TIMEOUT_S, disagg_stats, pd_args, running_prefill, settled

from deepinfer.llm import TINY_DSV4_DIR

ARGS = ("--model", TINY_DSV4_DIR, "--max-num-seqs", "4")
WORDS = "cache page router worker token prefix replica engine request stream latency batch decode".split()
LONG = " ".join(WORDS[i * 5 % len(WORDS)] for i in range(160))  # ~2 pages of 128 tokens, > the 128-token window
SHORT = "def quicksort(items):"
MODEL = "tiny-dsv4"


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pd(request):
    backend = request.param
    with running_prefill(*ARGS, backend=backend) as prefill, \
            running_server(*ARGS, *pd_args("decode", backend=backend)) as decode:
        # --kv-connector nixl: the router's name for vLLM's pass-through protocol (the prefill's
        # kv_transfer_params go to decode as they are); the bytes move through the workers' own
        # transfer engine, Mooncake's or NIXL's
        flags = ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url, "--kv-connector", "nixl"]
        with running_vllm_router([prefill.url, decode.url], "round_robin", MODEL, worker_flags=flags) as router:
            yield SimpleNamespace(prefill=prefill, decode=decode, router=router)


def _reference(llm, prompt: str, max_tokens: int, seed: int | None = None) -> str:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0 if seed is None else 0.9, top_p=1.0 if seed is None else 0.95,
                            max_tokens=max_tokens, seq_seed=seed)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def _post(url: str, route: str, body: dict) -> tuple[int, dict]:
    status, raw = http(url + route, json.dumps(body).encode(), {"content-type": "application/json"}, timeout=120)
    return status, json.loads(raw)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "longer-than-window"])
def test_completions_through_vllm_router_equal_colocated(pd, colocated, prompt):
    client = pd.router.client()
    for seed in (None, 1234):
        expected = _reference(colocated, prompt, 12, seed)
        sampling = dict(temperature=0.0) if seed is None else dict(temperature=0.9, top_p=0.95, seed=seed)
        before = disagg_stats(pd.decode)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampling)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, stream=True, **sampling))
        after = disagg_stats(pd.decode)
        assert whole.choices[0].text == streamed == expected, (seed, whole.choices[0].text, streamed, expected)
        assert whole.usage.completion_tokens == 12
        assert after["transfers"] - before["transfers"] == 2 and after["failed"] == before["failed"]
    settled(pd.prefill, pd.decode)


def test_chat_through_vllm_router_equals_the_decode_worker_alone(pd):
    """The chat route through the pair gives what a colocated worker gives for the same messages
    (the decode worker serves plain requests too)."""
    messages = [{"role": "user", "content": SHORT}]
    routed = pd.router.client().chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=8)
    status, alone = _post(pd.decode.url, "/v1/chat/completions",
                          {"model": MODEL, "messages": messages, "temperature": 0.0, "max_tokens": 8})
    assert status == 200
    assert routed.choices[0].message.content == alone["choices"][0]["message"]["content"]
    assert routed.usage.completion_tokens == 8
    settled(pd.prefill, pd.decode)


def test_the_protocol_by_hand(pd, colocated):
    """What the router does, step by step: the prefill's answer names its bootstrap server and room;
    the decode request with it continues from the transferred state."""
    status, first = _post(pd.prefill.url, "/v1/completions", {
        "model": MODEL, "prompt": LONG, "max_tokens": 1, "temperature": 0.0, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    assert status == 200, first
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == pd.prefill.bootstrap_port and int(params["remote_request_id"]) >= 0
    assert disagg_stats(pd.prefill)["held_requests"] == 1  # kept for the decode worker
    status, out = _post(pd.decode.url, "/v1/completions", {
        "model": MODEL, "prompt": LONG, "max_tokens": 12, "temperature": 0.0, "kv_transfer_params": params})
    assert status == 200, out
    assert out["choices"][0]["text"] == _reference(colocated, LONG, 12)
    assert out["kv_transfer_params"] is None  # only a prefill worker answers with them
    settled(pd.prefill, pd.decode)


def test_a_room_no_decode_asks_for_is_freed(pd):
    status, first = _post(pd.prefill.url, "/v1/completions", {
        "model": MODEL, "prompt": LONG, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and first["kv_transfer_params"]["remote_request_id"]
    assert disagg_stats(pd.prefill)["held_requests"] == 1
    t0 = time.monotonic()
    wait_until(lambda: disagg_stats(pd.prefill)["held_requests"] == 0, TRANSFER_TIMEOUT_S * 3,
               "the prefill worker to free a room nobody asked for")
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S * 3
    settled(pd.prefill, pd.decode)


@pytest.mark.parametrize("where, body, param", [
    ("decode", {"stream": False, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ("prefill", {"stream": True, "kv_transfer_params": {"do_remote_decode": True}}, "stream"),
    ("prefill", {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                                        "remote_request_id": "1"}}, "kv_transfer_params"),
    ("decode", {"kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1, "remote_request_id": "1"}},
     "kv_transfer_params.remote_host"),
    ("decode", {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                                       "remote_request_id": "not-a-room"}}, "kv_transfer_params.remote_request_id"),
    ("decode", {"n": 2, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                                               "remote_port": 1, "remote_request_id": "1"}}, "kv_transfer_params"),
], ids=["decode-asked-to-prefill", "prefill-streamed", "prefill-asked-to-decode", "no-remote-host", "bad-room",
        "n-2"])
def test_bad_kv_transfer_params_are_400s_naming_the_field(pd, where, body, param):
    server = pd.decode if where == "decode" else pd.prefill
    status, out = _post(server.url, "/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 4, **body})
    assert status == 400 and out["error"]["param"] == param, out
    settled(pd.prefill, pd.decode)


def test_a_room_the_prefill_does_not_have_fails_the_decode_request(pd):
    """A decode request naming a room its prefill worker never had (a restart, a stale answer) ends
    within the transfer timeout with the reason; the pair serves on."""
    status, out = _post(pd.decode.url, "/v1/completions", {
        "model": MODEL, "prompt": SHORT, "max_tokens": 4, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                               "remote_port": pd.prefill.bootstrap_port, "remote_request_id": "77"}})
    assert status == 502 and out["error"]["code"] == "kv_transfer_failed", out
    assert "77" in out["error"]["message"]
    settled(pd.prefill, pd.decode)
    assert pd.router.client().completions.create(model=MODEL, prompt=SHORT, max_tokens=4).choices[0].text
