"""L2: page payloads in host memory within a byte budget, least recently used out first. Pages enter
it as they enter the cache pool (write-through, HiCache's default policy), and an L1 eviction marks
its page recently used here, so what the pool drops is what L2 keeps longest. On a GPU the payloads
are pinned, so loading one back is a direct DMA. Touched by the engine thread only."""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostCache:
    def __init__(self, budget_bytes: int, pin: bool = False):
        self.budget = budget_bytes
        self.pin = pin
        self.pages: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    def get(self, key: bytes) -> torch.Tensor | None:
        payload = self.pages.get(key)
        if payload is not None:
            self.pages.move_to_end(key)
        return payload

    def touch(self, key: bytes) -> None:
        if key in self.pages:
            self.pages.move_to_end(key)

    def put(self, key: bytes, payload: torch.Tensor) -> list[bytes]:
        """Keep `payload` (a uint8 host tensor); returns the keys dropped to make room."""
        if payload.numel() > self.budget:
            return []
        if key in self.pages:
            self.pages.move_to_end(key)
            return []
        if self.pin and not payload.is_pinned():
            payload = payload.pin_memory()
        self.pages[key] = payload
        self.bytes += payload.numel()
        dropped = []
        while self.bytes > self.budget:
            old, data = self.pages.popitem(last=False)
            self.bytes -= data.numel()
            dropped.append(old)
        return dropped
