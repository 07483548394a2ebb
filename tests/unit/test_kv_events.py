"""KV events (core/kv_events.py, core/kv_event_publisher.py) as a router sees them: a plain ZMQ
SUB socket and a replay DEALER (tests/kv_event_client.py) on an engine's sockets."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.core.kv_event_publisher import KVEventPublisher
from deepinfer.core.kv_events import KVEventsConfig, external_hash, stored
from kv_event_client import EventClient, events

PAGE = 128


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**kw) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{_port()}", "topic": "", **kw}


def _publisher_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("deepinfer-kv-events")]


def test_a_prompts_pages_are_stored_chained_evicted_and_replayed():
    config = _config(buffer_steps=100)
    # 4 pages: room for one 3-page prompt, so a second prompt evicts the first one's pages
    llm = LLM(max_num_seqs=2, num_cache_pages=4, kv_events_config=config)
    client = EventClient(config["endpoint"], config["replay_endpoint"])
    try:
        rng = random.Random(0)
        doc = [rng.randint(2, 4000) for _ in range(420)]
        other = [rng.randint(2, 4000) for _ in range(300)]
        keys = llm.engine.cache.prefix.keys([], doc)
        a0, a1, a2 = (external_hash(k) for k in keys)
        one = SamplingParams(max_tokens=1)
        for prompt in (doc[:300], doc, other):  # 2 full pages; the same 2 + a third; 2 that evict 2
            llm.generate(prompt_token_ids=[prompt], sampling_params=one, use_tqdm=False)

        kept = client.replay(0)
        assert sorted(kept) == list(range(len(kept)))  # every batch, numbered from 0
        assert kept[0][1] == [{"type": "AllBlocksCleared"}]  # the cache starts empty
        assert all(isinstance(b[0], float) and b[2] == 0 for b in kept.values())  # [ts, events, dp_rank 0]
        got = events(kept, "BlockStored")
        assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in got[:2]] == [
            ([a0, a1], None, doc[:256]), ([a2], a1, doc[256:384])]  # the extension chains to its parent
        assert all(e["block_size"] == PAGE and e["medium"] == "CPU" and e["lora_id"] is None
                   and e["lora_name"] is None and "extra_keys" not in e for e in got)
        # the third prompt needed 3 pages with 1 free: the idle ones went least recently used, tail first
        assert events(kept, "BlockRemoved") == [{"type": "BlockRemoved", "block_hashes": [a2, a1], "medium": "CPU"}]
        b = [external_hash(k) for k in llm.engine.cache.prefix.keys([], other)]
        assert got[2]["block_hashes"] == b and got[2]["token_ids"] == other[:256]
        last = max(kept)
        assert client.replay(last - 1) == {last - 1: kept[last - 1], last: kept[last]}  # a subscriber's gap

        client.poll(lambda live: last in live)  # live batches are the ones replay keeps
        assert all(client.live[seq] == kept[seq] for seq in client.live)
        llm.close()
        client.poll(lambda live: last + 1 in live)  # closing ends with AllBlocksCleared, then the sockets go
        assert client.live[last + 1][1] == [{"type": "AllBlocksCleared"}]
        assert not _publisher_threads() and llm.engine.kv_events is None
        for endpoint in (config["endpoint"], config["replay_endpoint"]):  # nothing listens on the ports any more
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT
                s.bind(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
                s.listen()
    finally:
        llm.close()
        client.close()


def test_the_config_is_checked_field_by_field():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    assert KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}) is None
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                              '"replay_endpoint": "tcp://*:5558"}')
    assert on.binds() and on.publisher == "zmq"
    rank2 = on.for_rank(2)  # vLLM's layout: rank r on the ports + r
    assert (rank2.endpoint, rank2.replay_endpoint, rank2.data_parallel_rank) == ("tcp://*:5559", "tcp://*:5560", 2)
    assert KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/ev"}).for_rank(1).endpoint \
        == "ipc:///tmp/ev_dp1"
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "tcp://indexer:5557"}).binds()
    for bad, field in [('{"enable_kv_cache_events": true, "port": 1}', "kv_events_config.port"),
                       ({"enable_kv_cache_events": True, "endpoint": "5557"}, "kv_events_config.endpoint"),
                       ({"enable_kv_cache_events": True, "buffer_steps": 0}, "kv_events_config.buffer_steps"),
                       ({"enable_kv_cache_events": True, "publisher": "kafka"}, "kv_events_config.publisher"),
                       ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=field):
            KVEventsConfig.parse(bad)


def test_a_taken_port_is_reported_by_name():
    config = KVEventsConfig.parse(_config())
    first = KVEventPublisher(config)
    try:
        with pytest.raises(ValueError, match=config.endpoint.replace(".", r"\.")):
            KVEventPublisher(config)
    finally:
        first.close()
    assert not _publisher_threads()


class _Seq:
    """A sequence as the prefix cache reads it for events: tokens and multimodal spans."""

    def __init__(self, tokens, spans=()):
        self._tokens, self._spans = tokens, list(spans)

    def tokens(self, start, end):
        return self._tokens[start:end]

    def mm_spans(self):
        return self._spans


def test_runs_of_new_pages_make_one_event_each_and_images_are_named():
    keys = [bytes([i]) * 16 for i in range(4)]
    toks = list(range(4 * PAGE))
    # pages 0 and 2..3 are new (page 1 was cached already): two runs, the second chained to page 1
    first, second = stored(keys, [0, 2, 3], _Seq(toks), PAGE, "GPU")
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == \
        ([external_hash(keys[0])], None, toks[:PAGE])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == \
        ([external_hash(keys[2]), external_hash(keys[3])], external_hash(keys[1]), toks[2 * PAGE:])
    image = stored(keys, [0, 1], _Seq(toks, [(100, 140, b"\xab\xcd")]), PAGE, "GPU")[0]
    assert image.wire()["extra_keys"] == [("abcd",), ("abcd",)]  # the span overlaps both pages
    assert external_hash(keys[1]) == int.from_bytes(keys[1][8:], "big")  # the low 64 bits of the page key
