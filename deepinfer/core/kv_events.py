"""KV cache events: what the prefix cache (core/prefix_cache.py) holds, told to routers as vLLM
tells them, so a KV-aware router (vllm-router `--policy kv_aware`, Dynamo's or llm-d's ZMQ
indexers) sends a request to the replica that has its prefix cached.

The configuration is vLLM's `--kv-events-config` JSON (KVEventsConfig). The events are vLLM's:
- BlockStored: pages entered the prefix cache. `block_hashes` (one per page, each chained to the
  one before it), `parent_block_hash` (the page before the first one, None at a prompt's start),
  `token_ids` (the pages' tokens, block_size each), `block_size` (the page size in tokens),
  `lora_id` / `lora_name` (None: no adapters), `medium` (where the pages live), and, only when a
  page holds an image, `extra_keys` (per page: the digests of the images it overlaps, else None).
- BlockRemoved: pages were evicted (`block_hashes`, `medium`).
- AllBlocksCleared: the cache is empty (published when publishing starts and when it stops).
A block hash is the low 64 bits of the prefix cache's own page key read big-endian, as vLLM
sends its hashes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): an id a router uses to chain
parents and to remove pages; routers match requests on `token_ids`, not on these ids.

The engine thread records events as the prefix cache changes and hands one batch per step to the
publisher (core/kv_event_publisher.py), whose thread encodes and sends it: nothing here blocks a
step. On the wire a batch is vLLM's EventBatch, a msgpack array [ts, events, data_parallel_rank]
whose events are maps tagged by "type" (msgspec's tag=True) - what vllm-router 0.1.17 decodes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from typing import Sequence

MASK64 = (1 << 64) - 1


def external_hash(key: bytes) -> int:
    """The block hash a router sees for a prefix-cache page key."""
    return int.from_bytes(key, "big") & MASK64


def medium_of(device) -> str:
    """vLLM's `medium` for pages on `device` (a torch.device): "GPU" for cuda, as vLLM says it,
    else the device type upper-cased ("CPU", "NPU")."""
    return "GPU" if device.type == "cuda" else device.type.upper()


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    extra_keys: list | None = None  # per page: the image digests it overlaps (hex), else None

    def wire(self) -> dict:
        out = {"type": "BlockStored", "block_hashes": self.block_hashes, "parent_block_hash": self.parent_block_hash,
               "token_ids": self.token_ids, "block_size": self.block_size, "lora_id": None, "medium": self.medium,
               "lora_name": None}
        if self.extra_keys is not None:  # vLLM leaves the field out while it is None (omit_defaults)
            out["extra_keys"] = self.extra_keys
        return out


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str

    def wire(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(slots=True)
class AllBlocksCleared:
    def wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


def stored(keys: Sequence[bytes], new: Sequence[int], seq, page_tokens: int, medium: str) -> list[BlockStored]:
    """BlockStored events for pages `new` (indices into a sequence's page `keys`, ascending) that
    just entered the cache: one event per run of consecutive pages. `seq` is the sequence
    (core/request.py's Request): its tokens(start, end) and mm_spans()."""
    spans = seq.mm_spans()
    out = []
    start = 0
    while start < len(new):
        end = start + 1
        while end < len(new) and new[end] == new[end - 1] + 1:
            end += 1
        first, last = new[start], new[end - 1]
        extra = [tuple(d.hex() for s, e, d in spans if s < (i + 1) * page_tokens and e > i * page_tokens) or None
                 for i in range(first, last + 1)] if spans else None
        out.append(BlockStored([external_hash(k) for k in keys[first:last + 1]],
                               external_hash(keys[first - 1]) if first else None,
                               list(seq.tokens(first * page_tokens, (last + 1) * page_tokens)), page_tokens, medium,
                               extra if extra is not None and any(extra) else None))
        start = end
    return out


def removed(events: list, key: bytes, medium: str) -> None:
    """Record that the page keyed `key` was evicted (evictions in a row make one event)."""
    if events and isinstance(events[-1], BlockRemoved) and events[-1].medium == medium:
        events[-1].block_hashes.append(external_hash(key))
    else:
        events.append(BlockRemoved([external_hash(key)], medium))


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (`--kv-events-config`). endpoint: the PUB socket, bound when it names
    every interface (`tcp://*:5557`), an ipc:// or inproc:// address, or (unlike vLLM, which
    connects there) a loopback address (`tcp://127.0.0.1:5557`: a router on this host subscribes
    without the port being open to others); else connected to (a relay that binds, e.g.
    `tcp://indexer:5557`). replay_endpoint: a ROUTER socket (always bound) that
    sends a subscriber the batches it missed. buffer_steps: batches kept for replay. hwm: the PUB
    socket's high-water mark. max_queue_size: batches waiting for the publisher thread. topic: the
    first frame of every message. With data parallelism rank r publishes on the ports + r (an
    ipc:// or inproc:// address gets `_dp<r>`), as vLLM does (for_rank)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    data_parallel_rank: int = 0  # set by for_rank, not by users

    @classmethod
    def parse(cls, value) -> "KVEventsConfig | None":
        """`value` (a JSON string, a dict, a KVEventsConfig or None) as a config; None when events
        are off (no value, enable_kv_cache_events false, or publisher "null")."""
        if value is None or isinstance(value, cls):
            config = value
        else:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"kv_events_config is not valid JSON ({exc}); give e.g. "
                                     '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'') from None
            if not isinstance(value, dict):
                raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
            known = [f.name for f in fields(cls) if f.name != "data_parallel_rank"]
            for key in value:
                if key not in known:
                    raise ValueError(f"kv_events_config.{key} is not a field of vLLM's KVEventsConfig; the fields "
                                     f"are {', '.join(known)}")
            config = cls(**{k: ("zmq" if k == "publisher" and v is None else v) for k, v in value.items()})
        if config is None:
            return None
        config.validate()
        return config if config.enable_kv_cache_events and config.publisher == "zmq" else None

    def validate(self) -> None:
        def field_error(name: str, want: str):
            return ValueError(f"kv_events_config.{name} must be {want}, got {getattr(self, name)!r}")

        if not isinstance(self.enable_kv_cache_events, bool):
            raise field_error("enable_kv_cache_events", "true or false")
        if self.publisher not in ("zmq", "null"):
            raise field_error("publisher", '"zmq" (or "null": no events)')
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise field_error(name, "an integer >= 1")
        if not isinstance(self.topic, str):
            raise field_error("topic", "a string")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not re.match(r"(tcp://.+:\d+|ipc://.+|inproc://.+)$", value):
                raise field_error(name, 'a ZMQ address: "tcp://HOST:PORT" ("tcp://*:PORT" binds), "ipc://PATH" '
                                        'or "inproc://NAME"')
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("kv_events_config.replay_endpoint must differ from endpoint (it is a second socket)")

    def for_rank(self, rank: int) -> "KVEventsConfig":
        """This config for data-parallel rank `rank`: its own sockets (see the class doc)."""
        return replace(self, endpoint=_offset(self.endpoint, rank), replay_endpoint=_offset(self.replay_endpoint, rank),
                       data_parallel_rank=rank)

    def binds(self) -> bool:
        """Whether the PUB socket binds its endpoint (else it connects to it)."""
        e = self.endpoint
        host = e.removeprefix("tcp://").rsplit(":", 1)[0] if e.startswith("tcp://") else ""
        return (e.startswith(("ipc://", "inproc://")) or "*" in e or "::" in e
                or host in ("localhost", "[::1]") or host.startswith("127."))


def _offset(endpoint: str | None, rank: int) -> str | None:
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
