"""Data parallelism inside one instance (`deepinfer serve --data-parallel-size 2`, gloo): greedy
outputs equal one process's, concurrent requests spread over both ranks, `data_parallel_rank` pins
a request, a prompt goes where its prefix is cached, and a rank that dies fails its requests,
turns /health unhealthy and leaves no process or rendezvous dir behind; behind smg --dp-aware
each rank is a worker of its own and requests are pinned to ranks.

The balancer tests run without processes; the client tests drive a DataParallelClient in this
process (its loads() show where each request went); the fault test runs a real server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from conftest import http, running_server, wait_until
from fleet import running_smg
from deepinfer import SamplingParams
from deepinfer.llm import TINY_DSV4_DIR

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64)
PROMPTS = [[5, 17, 99, 3, 200, 41, 7, 8] * 3, [9, 10, 11], [300, 301, 302, 303, 304, 1, 2], [42] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# ------------------------------------------------------------ the balancer alone
def _balancer(pages=(8, 8)):
    from deepinfer.entrypoints.dp_balancer import LeastWorkBalancer

    return LeastWorkBalancer(list(pages), page_tokens=4, prefix_cache=True)


def test_balancer_takes_the_rank_with_least_owed_and_held_tokens():
    b = _balancer()
    keys = b.page_keys(list(range(10)))
    assert b.choose(keys, owed=[0, 0], held=[0, 0], candidates=range(2)) == 0  # ties: lowest rank
    assert b.choose(keys, owed=[5, 0], held=[0, 0], candidates=range(2)) == 1
    assert b.choose(keys, owed=[0, 0], held=[0, 7], candidates=range(2)) == 0
    assert b.choose(keys, owed=[3, 0], held=[0, 4], candidates=range(2)) == 0


def test_balancer_prefers_the_rank_holding_the_prefix_unless_it_is_busier_than_the_hit():
    b = _balancer()
    system = list(range(100, 112))  # three full pages of 4 tokens
    b.remember(1, b.page_keys(system))
    follow_up = b.page_keys(system + [7, 8, 9, 10, 11])
    assert b.hit_tokens(1, follow_up) == 12 and b.hit_tokens(0, follow_up) == 0
    assert b.choose(follow_up, owed=[0, 0], held=[0, 0], candidates=range(2)) == 1
    assert b.choose(follow_up, owed=[0, 11], held=[0, 0], candidates=range(2)) == 1
    assert b.choose(follow_up, owed=[0, 13], held=[0, 0], candidates=range(2)) == 0
    other = b.page_keys([1, 2, 3, 4, 5, 6, 7, 8])  # same length, other tokens: no hit anywhere
    assert b.hit_tokens(1, other) == 0


def test_balancer_forgets_the_least_recently_sent_pages_beyond_the_rank_cache():
    b = _balancer(pages=(2, 2))
    first, second = b.page_keys(list(range(8))), b.page_keys(list(range(50, 58)))
    b.remember(0, first)
    b.remember(0, second)
    assert b.hit_tokens(0, second) == 8 and b.hit_tokens(0, first) == 0


def test_out_of_range_data_parallel_rank_is_refused_naming_the_field():
    from deepinfer.entrypoints.async_llm import InvalidRequest
    from deepinfer.entrypoints.async_llm import check_data_parallel_rank

    assert check_data_parallel_rank(None, 2) is None and check_data_parallel_rank(1, 2) == 1
    for bad in (2, -1, True, "0", 1.0):
        with pytest.raises(InvalidRequest, match=r"data_parallel_rank=.* 0 to 1") as err:
            check_data_parallel_rank(bad, 2)
        assert err.value.param == "data_parallel_rank"


# ------------------------------------------------------------ a two-rank client in this process
@pytest.fixture(scope="module")
def dp_client():
    from deepinfer.entrypoints.dp_client import DataParallelClient

    client = DataParallelClient(TINY_DSV4_DIR, data_parallel_size=2, **ENGINE)
    try:
        yield client
    finally:
        client.close()
    assert all(not p.is_alive() for p in client.procs)


@pytest.fixture(scope="module")
def one_process_outputs():
    from deepinfer import LLM

    llm = LLM(TINY_DSV4_DIR, **ENGINE)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                              use_tqdm=False)]
    finally:
        llm.close()


async def _run(client, ids, rid: str, params=GREEDY, rank=None) -> list[int]:
    group = await client.add([(ids, params, None)], time.perf_counter(), [rid], data_parallel_rank=rank)
    tokens = []
    async for _, delta in group.deltas():
        tokens += delta.token_ids
        assert delta.error is None
    return tokens


def _prompt_tokens(client) -> list[int]:
    return [load["prompt_tokens_total"] for load in client.loads()]


def _settled(client, before: list[int], expected_added: int) -> list[int]:
    """Per-rank prompt tokens added since `before`, once the ranks' reports account for all of them."""
    wait_until(lambda: sum(_prompt_tokens(client)) - sum(before) == expected_added, 30, "the ranks' load reports")
    return [a - b for a, b in zip(_prompt_tokens(client), before)]


def test_concurrent_requests_spread_over_both_ranks_and_match_one_process(dp_client, one_process_outputs):
    assert dp_client.dp_size == 2 and [load["dp_rank"] for load in dp_client.loads()] == [0, 1]
    before = _prompt_tokens(dp_client)

    async def all_at_once():
        return await asyncio.gather(*[_run(dp_client, ids, f"spread-{i}") for i, ids in enumerate(PROMPTS)])

    assert asyncio.run(all_at_once()) == one_process_outputs
    added = _settled(dp_client, before, sum(map(len, PROMPTS)))
    # each arrived while the others still owed their prefill: 24 -> rank 0, 3 -> 1, 7 -> 1, 9 -> 1
    # (rank 1's 3 + 7 owed tokens are still below rank 0's 24)
    assert added == [24, 3 + 7 + 9]
    assert all(load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 for load in dp_client.loads())


def test_a_ranks_stream_gets_each_token_as_its_step_ends(dp_client):
    """A rank decodes greedy requests in multi-step calls and sends each step's tokens over its pipe
    as the step ends: a 32-token completion reaches the client in about 32 deltas, not one per call."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    async def deltas():
        group = await dp_client.add([(PROMPTS[1], params, None)], time.perf_counter(), ["per-step"])
        return [delta.token_ids async for _, delta in group.deltas() if delta.token_ids]

    pieces = asyncio.run(deltas())
    assert sum(map(len, pieces)) == 32 and len(pieces) >= 16, pieces


def test_data_parallel_rank_pins_a_request(dp_client, one_process_outputs):
    for rank in (1, 0, 1):
        before = _prompt_tokens(dp_client)
        out = asyncio.run(_run(dp_client, PROMPTS[2], f"pinned-{rank}-{time.monotonic_ns()}", rank=rank))
        assert out == one_process_outputs[2]
        added = _settled(dp_client, before, len(PROMPTS[2]))
        assert added[rank] == len(PROMPTS[2]) and added[1 - rank] == 0


def test_a_prompt_goes_to_the_rank_that_holds_its_prefix(dp_client):
    system = [(7 * i) % 500 + 3 for i in range(300)]  # two full 128-token pages, seen by no other test
    asyncio.run(_run(dp_client, system, "prefix-first", rank=1))
    before = _prompt_tokens(dp_client)
    hits_before = [load["cached_tokens_total"] for load in dp_client.loads()]
    asyncio.run(_run(dp_client, system + [11, 12, 13], "prefix-follow-up"))  # both ranks idle: only the hit decides
    assert _settled(dp_client, before, len(system) + 3) == [0, len(system) + 3]
    hits = [load["cached_tokens_total"] - h for load, h in zip(dp_client.loads(), hits_before)]
    assert hits[0] == 0 and hits[1] >= 128  # the rank really served it from its prefix cache


def test_client_refuses_a_rank_it_does_not_have(dp_client):
    from deepinfer.entrypoints.async_llm import InvalidDataParallelRank

    with pytest.raises(InvalidDataParallelRank, match="data_parallel_rank=2"):
        asyncio.run(_run(dp_client, PROMPTS[1], "bad-rank", rank=2))
    assert dp_client.alive


@pytest.mark.slow
def test_expert_parallel_ranks_step_together_and_match_one_process(one_process_outputs):
    """--data-parallel-size 2 --expert-parallel-size 2: each rank owns its requests and half the
    experts; a rank without requests runs empty steps through the MoE collectives."""
    from deepinfer.entrypoints.dp_client import DataParallelClient

    client = DataParallelClient(TINY_DSV4_DIR, data_parallel_size=2, expert_parallel_size=2, **ENGINE)
    try:
        async def all_at_once():
            return await asyncio.gather(*[_run(client, ids, f"ep-{i}") for i, ids in enumerate(PROMPTS)])

        assert asyncio.run(all_at_once()) == one_process_outputs
        before = _prompt_tokens(client)
        assert asyncio.run(_run(client, PROMPTS[2], "ep-pinned", rank=1)) == one_process_outputs[2]  # rank 0 idles
        assert _settled(client, before, len(PROMPTS[2])) == [0, len(PROMPTS[2])]
    finally:
        client.close()
    assert all(not p.is_alive() for p in client.procs)


# ------------------------------------------------------------ a real server whose rank dies
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # a zombie has exited; only its parent's reaping is left
    except FileNotFoundError:
        return True


def _smg_pins_requests_to_ranks(server) -> None:
    """smg --dp-aware reads dp_size from /server_info, lists one worker per rank and adds
    data_parallel_rank to each body: round-robin over the ranks puts two of four requests on each
    (unpinned, this idle instance would send every one of these short prompts to rank 0)."""
    def prompt_tokens():
        return [r["prompt_tokens_total"] for r in json.loads(server.get("/server_info")[1])["internal_states"]]

    with running_smg([server.url], "round_robin", "--dp-aware") as router:
        assert sorted(w["url"] for w in router.workers()) == [f"{server.url}@0", f"{server.url}@1"]
        before = prompt_tokens()
        with router.client() as client:
            for prompt in ("a = 1", "b = 2", "c = 3", "d = 4"):
                client.completions.create(model="tiny-dsv4", prompt=prompt, max_tokens=2, temperature=0)
        status, out = http(router.url + "/generate", json.dumps({"text": "e = 5", "sampling_params": {
            "max_new_tokens": 2}}).encode(), {"content-type": "application/json"})
        assert status == 200 and out and json.loads(out)["meta_info"]["completion_tokens"] == 2
    grown = [a - b for a, b in zip(prompt_tokens(), before)]
    # five 4-token prompts (BOS + 3), two of the four completions on each rank
    assert sum(grown) == 5 * 4 and min(grown) >= 2 * 4, grown


@pytest.mark.slow
def test_killed_rank_fails_its_request_and_the_instance_turns_unhealthy(tmp_path):
    import openai

    with running_server("--model", TINY_DSV4_DIR, "--data-parallel-size", "2", "--max-num-seqs", "4",
                        env={"TMPDIR": str(tmp_path)}) as server:
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("deepinfer-group-")]  # the rendezvous dir
        pids = {int(r): int(p) for r, p in re.findall(r"data-parallel rank (\d) of 2: pid (\d+)", server.log())}
        assert sorted(pids) == [0, 1]
        assert server.metrics()["sglang:num_running_reqs"] == 0  # the gauges exist before the first request
        with server.client() as client:
            ok = client.completions.create(model="tiny-dsv4", prompt="def fib(n):", max_tokens=4, temperature=0)
            assert ok.choices[0].finish_reason == "length"
            _smg_pins_requests_to_ranks(server)
            # an idle instance sends a new prompt to rank 0 (lowest on ties): kill it mid-stream
            stream = client.completions.create(model="tiny-dsv4", prompt="Once upon a time", max_tokens=4000,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            first = next(iter(stream))
            assert first.choices[0].text is not None
            os.kill(pids[0], signal.SIGKILL)
            with pytest.raises(openai.APIError, match=r"data-parallel rank 0 \(pid \d+\) was killed by SIGKILL"):
                for _ in stream:
                    pass
            status, body = server.get("/health")
            assert status == 503, body
            with pytest.raises(openai.APIStatusError, match="rank 0") as refused:
                client.completions.create(model="tiny-dsv4", prompt="hello", max_tokens=2)
            assert refused.value.status_code == 503
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
    wait_until(lambda: all(_gone(pid) for pid in pids.values()), 30, "the rank processes to exit")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("deepinfer-group-")]
