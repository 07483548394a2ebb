"""KV events from real servers: vllm-router's kv_aware policy (the PyPI binary) in front of two
`deepinfer serve` workers routes each request to the worker whose prefix cache holds its prompt,
which it knows only from the workers' events; with `--data-parallel-size 2` each rank publishes
its own batches, tagged with its rank, on the ports + rank."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

import pytest

from conftest import SHIPPED, free_port, http, running_server, stop, wait_until
from deepinfer import SamplingParams
from deepinfer.llm import default_model
from kv_event_client import EventClient, events

PAGE = 128
ROUTER = os.path.join(os.path.dirname(sys.executable), "vllm-router")


def _events_config(port: int, replay_port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": ""})


@contextmanager
def _router(workers: list[tuple[str, int, int]]):
    """vllm-router, kv_aware, subscribed to each (url, event port, replay port); yields (url, log path)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="vllm-router-", suffix=".log", delete=False)
    args = [ROUTER, "--worker-urls", *[w for w, _, _ in workers], "--policy", "kv_aware", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--kv-event-block-size", str(PAGE), "--kv-event-model", SHIPPED, "--log-level", "debug"]
    for url, ev, rp in workers:
        args += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}", "--kv-event-replay-source",
                 f"{url}=tcp://127.0.0.1:{rp}"]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"})
    try:
        def text() -> str:
            with open(log.name) as f:
                return re.sub(r"\x1b\[[0-9;]*m", "", f.read())

        def subscribed():
            if proc.poll() is not None:
                raise AssertionError(f"vllm-router exited with {proc.returncode}:\n{text()}")
            return all(f"kv_index subscriber for {url} rank0 on" in text() for url, _, _ in workers)
        wait_until(subscribed, 60, "vllm-router to subscribe to both workers' events", interval=0.2)
        wait_until(lambda: _up(f"http://127.0.0.1:{port}"), 60, "vllm-router to answer /health", interval=0.2)
        yield f"http://127.0.0.1:{port}", text
    finally:
        stop(proc, grace=10)
        log.close()
        os.unlink(log.name)


def _up(url: str) -> bool:
    try:
        return http(url + "/health", timeout=2)[0] == 200
    except OSError:
        return False


def _looked_up(server) -> float:
    return server.metrics().get("deepinfer:prefix_cache_queries_total", 0.0)


def _hits(server) -> float:
    return server.metrics().get("deepinfer:prefix_cache_hits_total", 0.0)


@pytest.mark.slow
def test_vllm_router_kv_aware_sends_each_prompt_to_the_worker_that_cached_its_prefix():
    ports = [(free_port(), free_port()) for _ in range(2)]
    with ExitStack() as stack:
        workers = [stack.enter_context(running_server("--max-num-seqs", "4", "--kv-events-config", _events_config(*p)))
                   for p in ports]
        subs = [stack.enter_context(_closing(EventClient(f"tcp://127.0.0.1:{ev}"))) for ev, _ in ports]
        url, router_log = stack.enter_context(_router([(w.url, *p) for w, p in zip(workers, ports)]))
        # two long prefixes (3+ pages each), each computed on one worker directly, behind the router's back:
        # it learns where they are cached only from the events
        doc = "the quick brown fox jumps over the lazy dog. " * 40
        system = "You are a careful assistant. Answer in one word. " * 40
        workers[1].post("/v1/completions", {"model": SHIPPED, "prompt": doc, "max_tokens": 1})
        workers[0].post("/v1/chat/completions", {"model": SHIPPED, "max_tokens": 1,
                                                 "messages": [{"role": "system", "content": system},
                                                              {"role": "user", "content": "hello"}]})
        for w, sub in enumerate(subs):  # the workers published them; the router's own subscriber saw them too
            sub.poll(lambda live: events(live, "BlockStored"))
            seq = max(sub.live)
            wait_until(lambda: f"source={workers[w].url} rank=0 seq={seq}" in router_log(), 30,
                       f"vllm-router to take worker {w}'s batch {seq}")
        for turn in range(3):
            for target, body, path in [
                    (1, {"prompt": doc + f" question {turn}?"}, "/v1/completions"),
                    (0, {"messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": f"question {turn}?"}]}, "/v1/chat/completions")]:
                looked, hits = [_looked_up(w) for w in workers], _hits(workers[target])
                status, raw = http(url + path, json.dumps({"model": SHIPPED, "max_tokens": 1, **body}).encode(),
                                   {"content-type": "application/json"})
                assert status == 200, raw
                after = [_looked_up(w) for w in workers]
                assert after[target] > looked[target] and after[1 - target] == looked[1 - target], (turn, path)
                assert _hits(workers[target]) - hits >= 3 * PAGE  # and it was served from that cache


@contextmanager
def _closing(client: EventClient):
    try:
        yield client
    finally:
        client.close()


def _consecutive_free_ports() -> int:
    """A port p with p + 1 free too (rank r of a data-parallel server publishes on the ports + r)."""
    import socket

    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


@pytest.mark.slow
def test_each_data_parallel_rank_publishes_its_own_events():
    from deepinfer.entrypoints.dp_client import DataParallelClient

    port, replay = _consecutive_free_ports(), _consecutive_free_ports()
    client = DataParallelClient(default_model(), data_parallel_size=2, max_num_seqs=4,
                                max_num_batched_tokens=64, kv_events_config=_events_config(port, replay))
    subs = []
    try:
        subs = [EventClient(f"tcp://127.0.0.1:{port + r}", f"tcp://127.0.0.1:{replay + r}") for r in range(2)]
        prompt = [(11 * i) % 700 + 5 for i in range(300)]  # two full pages
        asyncio.run(_run(client, prompt, rank=1))
        subs[1].poll(lambda live: events(live, "BlockStored"))
        stored = events(subs[1].live, "BlockStored")
        assert stored[0]["token_ids"] == prompt[:2 * PAGE]
        assert all(batch[2] == 1 for batch in subs[1].live.values())  # [ts, events, data_parallel_rank]
        kept = subs[0].replay(0)  # rank 0 served nothing: only its start
        assert [(batch[1], batch[2]) for batch in kept.values()] == [([{"type": "AllBlocksCleared"}], 0)]
    finally:
        client.close()
        for sub in subs:
            sub.close()
    assert all(not p.is_alive() for p in client.procs)


async def _run(client, ids, rank: int) -> None:
    group = await client.add([(ids, SamplingParams(max_tokens=1), None)], time.perf_counter(),
                             [f"kv-{time.monotonic_ns()}"], data_parallel_rank=rank)
    async for _, delta in group.deltas():
        assert delta.error is None


def test_chat_takes_the_sglang_fields_vllm_router_adds_only_at_deepinfers_meaning():
    from pydantic import ValidationError

    from deepinfer.entrypoints.protocol import ChatCompletionRequest

    base = {"model": SHIPPED, "messages": [{"role": "user", "content": "hi"}]}
    added = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
             "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
             "include_reasoning": True, "logprobs": False}  # what vllm-router 0.1.17 writes into a chat body
    ChatCompletionRequest.model_validate({**base, **added})
    for name, value in [("no_stop_trim", True), ("return_hidden_states", True), ("include_reasoning", False)]:
        with pytest.raises(ValidationError, match=name):
            ChatCompletionRequest.model_validate({**base, name: value})
