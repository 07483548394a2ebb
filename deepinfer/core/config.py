"""The engine's settings (LLM's and the server's engine arguments), validated with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backends.base import Accelerator
from deepinfer.core.kv_events import KVEventsConfig


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(max_position_embeddings, 8192)
    cache_bytes: int | None = None  # budget for the decode state (slots + pages); overrides the next
    gpu_memory_utilization: float = 0.9  # share of (free after weights + weights) the engine fills (core/memory.py)
    num_cache_pages: int | None = None  # or an explicit page count
    # compute dtype: the inputs of weight ops and the decode state; weights keep their stored format.
    # auto = the accelerator's preferred_dtype (float32 on cpu, bfloat16 on nvidia and ascend)
    dtype: str = "auto"
    seed: int = 0
    # DSpark drafting when the checkpoint has a drafter and DEEPINFER_USE_NEXTN_DECODE > 0; parallel
    # ranks turn it off (their verify lengths come from per-rank timings and would diverge)
    speculative: bool = True
    # bytes free before the weights were loaded, to plan the cache from; None: what the accelerator
    # reports free once they are (parallel ranks that must plan identical caches pass the smallest
    # value any of them sees)
    available_memory: int | None = None
    # engine processes sharing this machine's cores (parallel ranks): each uses its share
    processes_per_host: int = 1
    # publish the prefix cache's KV events for routers (core/kv_events.py); None: off
    kv_events: KVEventsConfig | None = None
    # the tiered prefix store (deepinfer/kv, docs/kv-store.md): a page store URL (file:///dir or
    # mooncake://host:port) and a host-memory tier's byte budget; None / 0: off
    kv_store: str | None = None
    kv_host_cache_bytes: int = 0
    # a stream listener (the server) gets a multi-step decode call's tokens every this many steps
    stream_interval: int = 1

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1 (decode steps between a stream's deltas), "
                             f"got {self.stream_interval!r}")
        for name in ("max_model_len", "cache_bytes", "num_cache_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_store is not None and (not isinstance(self.kv_store, str) or "://" not in self.kv_store):
            raise ValueError(f"kv_store must be a URL, file:///path/to/dir or mooncake://host:port, got {self.kv_store!r}")
        if not isinstance(self.kv_host_cache_bytes, int) or self.kv_host_cache_bytes < 0:
            raise ValueError(f"kv_host_cache_bytes must be an int >= 0 (0: no host-memory tier), "
                             f"got {self.kv_host_cache_bytes!r}")
        if self.kv_events is not None and not isinstance(self.kv_events, KVEventsConfig):
            raise ValueError(f"kv_events must be a KVEventsConfig (KVEventsConfig.parse), got {self.kv_events!r}")

    def compute_dtype(self, accel: Accelerator) -> torch.dtype:
        return accel.preferred_dtype if self.dtype == "auto" else getattr(torch, self.dtype)
