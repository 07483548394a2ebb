"""KV events from real servers: vllm-router's kv_aware policy (the PyPI binary) in front of two
`deepinfer serve` workers routes each request to the worker whose prefix cache holds its prompt,
which it knows only from the workers' events; with `--data-parallel-size 2` each rank publishes
its own batches, tagged with its rank, on the ports + rank."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack, contextmanager

import pytest

from conftest import SHIPPED, free_port, http, running_server, wait_until
from deepinfer import SamplingParams
from deepinfer.core.model_runner import PAGE_TOKENS
from deepinfer.llm import default_model
from fleet import events_config, running_vllm_router
from kv_event_client import EventClient, events

PAGE = PAGE_TOKENS  # the prefix cache's page: the events' block size


def _looked_up(server) -> float:
    return server.metrics().get("deepinfer:prefix_cache_queries_total", 0.0)


def _hits(server) -> float:
    return server.metrics().get("deepinfer:prefix_cache_hits_total", 0.0)


@pytest.mark.slow
def test_vllm_router_kv_aware_sends_each_prompt_to_the_worker_that_cached_its_prefix():
    ports = [(free_port(), free_port()) for _ in range(2)]
    with ExitStack() as stack:
        workers = [stack.enter_context(running_server("--max-num-seqs", "4", "--kv-events-config", events_config(*p)))
                   for p in ports]
        subs = [stack.enter_context(_closing(EventClient(f"tcp://127.0.0.1:{ev}"))) for ev, _ in ports]
        router = stack.enter_context(running_vllm_router([w.url for w in workers], "kv_aware", SHIPPED, ports))
        url, router_log = router.url, router.log
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
                                max_num_batched_tokens=64, kv_events_config=events_config(port, replay))
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
