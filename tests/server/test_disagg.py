"""Prefill/decode disaggregation behind smg (--pd-disaggregation) on 127.0.0.1, with each transfer
engine (Mooncake's over TCP; NIXL's UCX over shared memory and TCP): the text through the P/D pair equals colocated LLM.generate (greedy and
seeded, whole and streamed, a prompt longer than the sliding window), the bytes moved per request
are what the cache spec says, a decode-side prefix-cache hit is not re-sent, and the faults: a
prefill that dies, a decode that never comes, a cancelled request, a mismatched peer, each ending
within the transfer timeout with nothing held on either side."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import http, running_server, wait_until
from fleet import prefix_counters
from pd import (TRANSFER_TIMEOUT_S, disagg_stats, generate, pd_args, running_pd_smg, running_prefill, settled,
                used_tokens)

from deepinfer.llm import TINY_DSV4_DIR

ARGS = ("--model", TINY_DSV4_DIR, "--max-num-seqs", "4")
WORDS = "cache page router worker token prefix replica engine request stream latency batch decode".split()
LONG = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(160))  # ~ 2 pages of 128 tokens, > the 128-token window
SHORT = "def quicksort(items):"
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 12, "sampling_seed": 1234}


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pd(request):
    backend = request.param
    with running_prefill(*ARGS, backend=backend) as prefill, \
            running_server(*ARGS, *pd_args("decode", backend=backend)) as decode, \
            running_pd_smg(prefill, decode) as router:
        yield SimpleNamespace(prefill=prefill, decode=decode, router=router, backend=backend)


def _reference(llm, prompt: str, sampling: dict) -> str:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0),
                            max_tokens=sampling["max_new_tokens"], seq_seed=sampling.get("sampling_seed"))
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def _settled(pd) -> None:
    settled(pd.prefill, pd.decode)


def test_roles_reported(pd):
    for server, mode in ((pd.prefill, "prefill"), (pd.decode, "decode")):
        info = json.loads(http(server.url + "/server_info")[1])
        assert info["disaggregation_mode"] == mode
        loads = json.loads(http(server.url + "/v1/loads?include=disagg")[1])["loads"][0]
        assert loads["disaggregation"]["mode"] == mode


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "longer-than-window"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_text_through_pd_equals_colocated(pd, colocated, prompt, sampling):
    cache = colocated.engine.cache
    expected = _reference(colocated, prompt, sampling)
    for stream in (False, True):
        before = disagg_stats(pd.decode)
        out = generate(pd.router.url, prompt, sampling, stream=stream)
        after = disagg_stats(pd.decode)
        assert out.text == expected, (stream, out.text, expected)
        assert len(out.token_ids) == sampling["max_new_tokens"]
        # one transfer; what moved is one slot's rings and the prompt's pages (less any this decode held)
        pages = cache.pages_for(out.prompt_tokens)
        sent = after["pages"] - before["pages"]
        skipped = after["skipped_pages"] - before["skipped_pages"]
        assert after["transfers"] - before["transfers"] == 1 and sent + skipped == pages
        assert after["bytes"] - before["bytes"] == cache.bytes_per_slot() + sent * cache.bytes_per_page()
    _settled(pd)


def test_openai_routes_through_pd(pd, colocated):
    """smg forwards /v1/completions and /v1/chat/completions to both workers with the bootstrap fields too."""
    client = pd.router.client()
    expected = _reference(colocated, LONG, GREEDY)
    whole = client.completions.create(model="tiny-dsv4", prompt=LONG, temperature=0.0, max_tokens=12)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-dsv4", prompt=LONG, temperature=0.0, max_tokens=12, stream=True))
    assert whole.choices[0].text == streamed == expected
    chat = client.chat.completions.create(model="tiny-dsv4", messages=[{"role": "user", "content": SHORT}],
                                          temperature=0.0, max_tokens=8)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    _settled(pd)


def test_decode_prefix_hit_is_not_resent(pd, colocated):
    """The second request of a long prompt finds its full pages in decode's prefix cache: only the rest moves."""
    prompt = "[hit] " + LONG
    first = generate(pd.router.url, prompt, GREEDY)
    full = first.prompt_tokens // colocated.engine.cache.page_tokens
    assert full >= 1
    _settled(pd)
    before, hits_before = disagg_stats(pd.decode), prefix_counters([pd.prefill.url])[0]
    second = generate(pd.router.url, prompt, GREEDY, stream=True)
    after = disagg_stats(pd.decode)
    assert after["skipped_pages"] - before["skipped_pages"] == full
    # prefill's own prefix cache served the repeated prompt too (it ran only the uncached part)
    assert prefix_counters([pd.prefill.url])[0] > hits_before
    assert after["pages"] - before["pages"] == colocated.engine.cache.pages_for(second.prompt_tokens) - full
    assert second.text == first.text
    _settled(pd)


def _direct(server_url: str, room: int, prefill, sampling=GREEDY, text=LONG):
    """A /generate with bootstrap fields sent straight to one worker (what smg sends each of them)."""
    return generate(server_url, text, sampling, bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port,
                    bootstrap_room=room)


def test_nixl_writes_are_posted_by_the_prefill_engine_thread(pd):
    """With NIXL the prefill's engine thread posts a finished request's write itself and polls it
    briefly (a writer thread would wait for the GIL the engine thread holds); Mooncake's blocking
    write stays on a thread. Either way the text is colocated's and nothing stays held."""
    before = disagg_stats(pd.prefill)
    for i in range(3):
        assert generate(pd.router.url, f"{SHORT} #{i}", GREEDY).text
    after = disagg_stats(pd.prefill)
    assert after["transfers"] - before["transfers"] == 3
    inline = after["inline_writes"] - before["inline_writes"]
    assert inline >= 1 if pd.backend == "nixl" else inline == 0, (pd.backend, inline)
    _settled(pd)


def test_decode_never_comes_prefill_frees_after_timeout(pd):
    before = disagg_stats(pd.prefill)
    out = _direct(pd.prefill.url, 9001, pd.prefill)  # no decode asks for room 9001
    assert len(out.token_ids) == 1  # prefill runs the prompt and the first token only
    wait_until(lambda: disagg_stats(pd.prefill)["held_requests"] == 1 or
               disagg_stats(pd.prefill)["failed"] > before["failed"], 10, "prefill to hold the request's pages")
    t0 = time.monotonic()
    wait_until(lambda: disagg_stats(pd.prefill)["failed"] == before["failed"] + 1, TRANSFER_TIMEOUT_S * 3,
               "prefill to give up on room 9001")
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S * 3
    _settled(pd)


@pytest.mark.slow  # a second decode worker starts (and is killed)
def test_decode_killed_after_asking_prefill_frees_and_keeps_serving(pd):
    """A decode worker offers its pages for a room and is killed (-9) before prefill has the request:
    prefill's write to the dead peer fails or lands nowhere, and either way it holds nothing once
    the room ends (within the transfer timeout), its engine never stalls, and the pair still serves."""
    room = 9005
    with running_server(*ARGS, *pd_args("decode", backend=pd.backend)) as doomed:
        asking = threading.Thread(target=lambda: _try(lambda: _direct(doomed.url, room, pd.prefill)), daemon=True)
        asking.start()
        wait_until(lambda: disagg_stats(doomed)["receiving"] == 1, 10, "the doomed decode to ask for its room")
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(10)
    t0 = time.monotonic()
    out = _direct(pd.prefill.url, room, pd.prefill)  # prefill runs the prompt, then writes to the dead peer
    assert len(out.token_ids) == 1
    wait_until(lambda: disagg_stats(pd.prefill)["held_requests"] == 0 and disagg_stats(pd.prefill)["rooms"] == 0,
               TRANSFER_TIMEOUT_S * 3, "prefill to end the dead decode's room")
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S * 3
    assert generate(pd.router.url, SHORT, GREEDY).text
    _settled(pd)


def _try(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the worker it talks to is killed under it
        pass


def test_cancelled_request_frees_both_sides(pd):
    """A decode request whose client goes away while it waits for prefill: decode cancels the room at
    prefill and frees its slot and pages; the prefill request that comes later is freed as well."""
    import socket

    body = json.dumps({"text": LONG, "sampling_params": GREEDY, "stream": True, "bootstrap_host": "127.0.0.1",
                       "bootstrap_port": pd.prefill.bootstrap_port, "bootstrap_room": 9002}).encode()
    host, port = pd.decode.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: disagg_stats(pd.decode)["receiving"] == 1, 10, "decode to reserve pages for room 9002")
        assert used_tokens(pd.decode) > 0
    wait_until(lambda: disagg_stats(pd.decode)["receiving"] == 0 and used_tokens(pd.decode) == 0, 10,
               "decode to free the cancelled request's pages")
    out = _direct(pd.prefill.url, 9002, pd.prefill)  # prefill's copy of the request arrives late
    assert len(out.token_ids) == 1
    _settled(pd)
    assert generate(pd.router.url, SHORT, GREEDY).text  # both still serve


def test_mismatched_peer_is_refused(pd):
    """Prefill refuses a destination whose cache is not its own (another dtype here), naming the field."""
    from deepinfer.kv.bootstrap import BootstrapError, call

    base = f"http://127.0.0.1:{pd.prefill.bootstrap_port}"
    route = call("GET", f"{base}/route")
    layout = dict(route["layout"], dtype="bfloat16")
    with pytest.raises(BootstrapError, match="dtype=bfloat16.*--dtype"):
        call("POST", f"{base}/rooms/9003", {"layout": layout, "pages": [], "slot": 0})
    other = "nixl" if pd.backend == "mooncake" else "mooncake"
    with pytest.raises(BootstrapError, match=f"moves state with '{other}'.*same --disaggregation-transfer-backend"):
        call("POST", f"{base}/rooms/9003", {"layout": dict(route["layout"], backend=other), "pages": [], "slot": 0})


@pytest.mark.slow  # a third worker starts (and is killed)
def test_prefill_killed_decode_fails_in_bounded_time_and_keeps_serving(pd):
    """A second prefill is killed (-9) while decode waits for its state: decode's request fails within
    the transfer timeout naming the cause, frees its pages, and the pair behind smg still serves."""
    with running_prefill(*ARGS, backend=pd.backend) as doomed:
        result = {}

        def ask():
            body = {"text": LONG, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": doomed.bootstrap_port, "bootstrap_room": 9004}
            result["status"], raw = http(pd.decode.url + "/generate", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
            result["error"] = json.loads(raw)["error"]
        t = threading.Thread(target=ask)
        t0 = time.monotonic()
        t.start()
        wait_until(lambda: disagg_stats(pd.decode)["receiving"] == 1, 10, "decode to wait for the doomed prefill")
        os.killpg(doomed.server.proc.pid, signal.SIGKILL)
        t.join(TRANSFER_TIMEOUT_S * 3)
        assert not t.is_alive()
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S * 3
    # an upstream failure (502), naming the room and the prefill worker that went away
    assert result["status"] == 502 and result["error"]["code"] == "kv_transfer_failed", result
    assert "bootstrap_room 9004" in result["error"]["message"]
    assert f"127.0.0.1:{doomed.bootstrap_port}" in result["error"]["message"]
    _settled(pd)
    assert generate(pd.router.url, SHORT, GREEDY).text


@pytest.mark.slow  # its own prefill and decode workers, drafting
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_drafting_workers_move_the_drafters_rings(backend, monkeypatch):
    """With DSpark drafting on both sides, the drafter's context rings of the request's slot move with it
    (the bytes are the cache spec's plus one slot of each stage's ring), decode drafts from them, and
    the text equals colocated drafting's."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.kv import transfer_layout as layout

    env = {"DEEPINFER_USE_NEXTN_DECODE": "5"}
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "5")
    llm = LLM(TINY_DSV4_DIR, max_num_seqs=4)
    try:
        out = llm.generate([LONG], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
        expected, drafter = out.outputs[0].text, llm.engine.spec.drafter
        moved = layout.expected_bytes(llm.engine.cache, llm.engine.cache.pages_for(len(out.prompt_token_ids)), drafter)
        assert moved > layout.expected_bytes(llm.engine.cache, llm.engine.cache.pages_for(len(out.prompt_token_ids)))
    finally:
        llm.close()

    def drafted(server) -> float:
        return sum(v for k, v in server.metrics().items() if k.startswith("deepinfer:spec_decode_num_draft_tokens"))

    with running_prefill(*ARGS, backend=backend, env=env) as prefill, \
            running_server(*ARGS, *pd_args("decode", backend=backend), env=env) as decode, \
            running_pd_smg(prefill, decode) as router:
        before, drafts = disagg_stats(decode), drafted(decode)
        got = generate(router.url, LONG, {"temperature": 0.0, "max_new_tokens": 32})
        assert got.text == expected
        assert disagg_stats(decode)["bytes"] - before["bytes"] == moved
        assert drafted(decode) > drafts  # decode drafted, from the rings prefill filled
        settled(prefill, decode)
