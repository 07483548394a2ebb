"""deepinfer behind smg, the SGLang model gateway (a real router, Rust, from the test extra), on
127.0.0.1: smg takes three tiny-dsv4 workers for SGLang workers (not "generic"), the official openai
client through it gets what a worker gives directly (and what LLM.generate gives), cache-aware
routing keeps one replica's prefix-cache hit rate where round-robin loses it, and faults: a
SIGTERMed worker finishes what it runs while the router sends new requests elsewhere; a worker
killed with -9 fails only its own requests, leaves nothing behind, and the survivor leaks nothing.

Workers A and B serve through smg; C is "one replica alone" and, in the fault test, the survivor."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from types import SimpleNamespace

import jsonschema
import pytest

from conftest import http, wait_until
from fleet import conversations, hit_rate, prefix_counters, running_servers, running_smg

from deepinfer.llm import TINY_DSV4_DIR

MODEL = "tiny-dsv4"
WORKER_ARGS = ("--model", TINY_DSV4_DIR, "--max-num-seqs", "8", "--shutdown-timeout", "60")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def fleet():
    with running_servers(3, *WORKER_ARGS) as (a, b, c), running_smg([a.url, b.url], "cache_aware") as router:
        yield SimpleNamespace(a=a, b=b, c=c, router=router)


def test_smg_takes_deepinfer_for_an_sglang_worker(fleet):
    listed = {w["url"]: w for w in fleet.router.workers()}
    _, info = http(fleet.a.url + "/server_info")
    capacity = json.loads(info)["max_total_num_tokens"]
    for server in (fleet.a, fleet.b):
        worker = listed[server.url]
        assert worker["runtime_type"] == "sglang" and worker["is_healthy"]
        labels = worker["labels"]  # read from /server_info, /model_info and /v1/models
        assert labels["dp_size"] == "1" and labels["served_model_name"] == MODEL
        assert labels["max_total_tokens"] == str(capacity) > "0" and labels["model_type"] == "deepseek_v4"
    assert "generic" not in fleet.router.log()
    # smg polls each worker's /v1/loads: its own load report (one entry per worker rank) carries our
    # ranks' token capacity, which only /v1/loads says
    loads = wait_until(lambda: _reported_loads(fleet.router), 30, "smg to report the workers' /v1/loads")
    assert sorted(entry["worker"] for entry in loads) == sorted([fleet.a.url, fleet.b.url])
    assert all(entry["max_total_num_tokens"] == capacity and entry["dp_rank"] == 0 for entry in loads)


def _reported_loads(router) -> list | None:
    status, raw = http(router.url + "/get_loads")
    loads = json.loads(raw).get("loads", []) if status == 200 else []
    return loads if len(loads) == 2 else None


def test_openai_client_through_smg(fleet):
    from deepinfer import LLM, SamplingParams

    client, prompt = fleet.router.client(), "def quicksort(items):"
    greedy = dict(model=MODEL, temperature=0.0, max_tokens=24)
    whole = client.completions.create(prompt=prompt, **greedy)
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **greedy))
    assert whole.choices[0].text == streamed and whole.usage.completion_tokens == 24
    llm = LLM(TINY_DSV4_DIR, max_num_seqs=1)
    try:
        offline = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    finally:
        llm.close()
    assert whole.choices[0].text == offline[0].outputs[0].text

    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(messages=messages, **greedy).choices[0].message.content
    chunks = client.chat.completions.create(messages=messages, stream=True, **greedy)
    assert chat == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # seeded sampling gives the same text whichever replica serves it
    sampled = [client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, max_tokens=24, seed=seed)
               .choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]

    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, max_tokens=60, seed=1,
                                           response_format=fmt).choices[0]
    assert reply.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)

    # SGLang's native /generate through smg: the same greedy text, SGLang's shape
    status, raw = http(fleet.router.url + "/generate", json.dumps(
        {"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}).encode(),
        {"content-type": "application/json"})
    native = json.loads(raw)
    assert status == 200 and native["text"] == whole.choices[0].text
    assert native["meta_info"]["finish_reason"] == {"type": "length", "length": 24}

    # the client's request id reaches the worker through smg and comes back
    raw_reply = client.completions.with_raw_response.create(prompt=prompt, extra_headers={"X-Request-Id": "trace-7"},
                                                            **greedy)
    assert raw_reply.headers["x-request-id"] == "trace-7" and raw_reply.parse().id == "cmpl-trace-7"


def _run_workload(client, convs, max_tokens: int = 8) -> None:
    """Every conversation's turns in order, turn by turn across conversations; each reply joins its history."""
    for turn in range(len(convs[0].users)):
        for conv in convs:
            reply = client.chat.completions.create(model=MODEL, messages=conv.messages(turn), temperature=0.0,
                                                   max_tokens=max_tokens)
            conv.replies.append(reply.choices[0].message.content)


@pytest.mark.slow
def test_cache_aware_routing_keeps_one_replicas_hit_rate(fleet):
    pair = [fleet.a.url, fleet.b.url]
    rates = {}
    before = prefix_counters([fleet.c.url])
    _run_workload(fleet.c.client(), conversations("alone"))
    rates["alone"] = hit_rate(before, prefix_counters([fleet.c.url]))
    before = prefix_counters(pair)
    _run_workload(fleet.router.client(), conversations("cache_aware"))
    rates["cache_aware"] = hit_rate(before, prefix_counters(pair))
    with running_smg(pair, "round_robin") as round_robin:
        before = prefix_counters(pair)
        _run_workload(round_robin.client(), conversations("round_robin"))
        rates["round_robin"] = hit_rate(before, prefix_counters(pair))
    assert rates["alone"] > 0.5, rates
    assert rates["cache_aware"] >= 0.9 * rates["alone"], rates
    assert rates["round_robin"] <= rates["cache_aware"] - 0.1, rates


def _stream(client, out: dict, started: threading.Event, max_tokens: int = 200) -> None:
    """A long streamed completion; `out` gets the worker smg chose, the text, the finish reason or the error."""
    try:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="def main():", temperature=0.0,
                                                          max_tokens=max_tokens, stream=True,
                                                          extra_body={"ignore_eos": True})
        out.update(worker=raw.headers.get("x-smg-routed-worker-id"), text="", reason=None)
        for chunk in raw.parse():
            started.set()
            out["text"] += chunk.choices[0].text
            out["reason"] = chunk.choices[0].finish_reason or out["reason"]
    except Exception as exc:  # noqa: BLE001 - a killed worker's stream ends in some client error
        out["error"] = exc
    finally:
        started.set()


def _served_by(client, n: int) -> list[str]:
    workers = []
    for _ in range(n):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="x = ", max_tokens=2, temperature=0.0)
        assert raw.parse().choices[0].finish_reason == "length"
        workers.append(raw.headers.get("x-smg-routed-worker-id"))
    return workers


@pytest.mark.slow
def test_sigterm_drains_and_kill_leaves_nothing_behind(fleet):
    a, b, c = fleet.a, fleet.b, fleet.c
    # SIGTERM: A finishes its running request, answers /health 503 meanwhile, and smg sends elsewhere
    with running_smg([a.url, c.url], "round_robin") as router:
        out, started = {}, threading.Event()
        runner = threading.Thread(target=_stream, args=(a.client(), out, started))
        runner.start()
        assert started.wait(60) and "error" not in out
        a.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: http(a.url + "/health")[0] == 503, 10, "A's /health to turn 503 while it drains")
        assert runner.is_alive()  # A's request still runs
        assert set(_served_by(router.client(), 4)) == {c.url}
        runner.join(120)
        assert out.get("reason") == "length" and "error" not in out, out
        assert a.proc.wait(30) in (0, -signal.SIGTERM)
    # kill -9: B's requests fail, C's finish, new ones go to C; B leaves nothing; C leaks no page or slot
    with running_smg([b.url, c.url], "round_robin") as router:
        outs, events = [{} for _ in range(4)], [threading.Event() for _ in range(4)]
        runners = [threading.Thread(target=_stream, args=(router.client(), o, e)) for o, e in zip(outs, events)]
        for r in runners:
            r.start()
        assert all(e.wait(60) for e in events)
        port = int(b.url.rsplit(":", 1)[1])
        os.killpg(b.proc.pid, signal.SIGKILL)
        b.proc.wait(30)
        for r in runners:
            r.join(120)
        on_b = [o for o in outs if o.get("worker") == b.url]
        on_c = [o for o in outs if o.get("worker") == c.url]
        assert len(on_b) == len(on_c) == 2, outs
        assert all("error" in o or o.get("reason") != "length" for o in on_b), on_b
        assert all(o.get("reason") == "length" and "error" not in o for o in on_c), on_c
        assert set(_served_by(router.client(), 4)) == {c.url}
    with pytest.raises(ProcessLookupError):
        os.killpg(b.proc.pid, 0)  # no process of B's session is left
    with socket.socket() as s:  # nothing listens on its port: a restarted worker can take it (as uvicorn binds)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    loads = json.loads(http(c.url + "/v1/loads")[1])["loads"][0]
    assert loads["num_running_reqs"] == loads["num_waiting_reqs"] == loads["num_used_tokens"] == 0
    metrics = c.metrics()
    assert metrics['deepinfer:cache_pages{state="used"}'] == 0
    assert metrics["deepinfer:sequence_slots_free"] == metrics["deepinfer:sequence_slots_total"]
