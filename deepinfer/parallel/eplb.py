"""EPLB: where each expert lives, redundant copies of hot experts, and rearrangement from load.

A layer has E logical experts and S = E + R physical slots, S/W per rank (rank r owns slots
[r*S/W, (r+1)*S/W)). `plan_placement` gives hot experts extra copies (the one with the largest
load per copy gets the next one) and packs the copies onto ranks heaviest first, each onto the
least loaded rank that has room and, if possible, no copy of that expert yet. Every rank runs
the plan on the same all-reduced integer loads, so all ranks agree without exchanging it.
"""

from __future__ import annotations

from collections import deque

import torch


def contiguous_placement(num_experts: int) -> list[int]:
    """No redundancy, no balancing: rank r holds experts [r*E/W, (r+1)*E/W)."""
    return list(range(num_experts))


def plan_placement(load: list[int], num_slots: int, num_ranks: int) -> list[int]:
    """Physical slot -> logical expert, from per-expert load (token rows routed to it)."""
    num_experts = len(load)
    copies = [1] * num_experts
    for _ in range(num_slots - num_experts):
        hottest = max(range(num_experts), key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    share = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    per_rank = num_slots // num_ranks
    rank_load = [0.0] * num_ranks
    hosted: list[list[int]] = [[] for _ in range(num_ranks)]
    for weight, expert in share:
        room = [r for r in range(num_ranks) if len(hosted[r]) < per_rank]
        fresh = [r for r in room if expert not in hosted[r]] or room
        target = min(fresh, key=lambda r: (rank_load[r], len(hosted[r]), r))
        hosted[target].append(expert)
        rank_load[target] += weight
    return [e for r in range(num_ranks) for e in sorted(hosted[r])]


class Placement:
    """One layer's slot -> expert map and, per expert, its slots (to pick a copy per token)."""

    def __init__(self, slot_to_expert: list[int], num_experts: int, num_ranks: int, device: torch.device):
        self.slot_to_expert = list(slot_to_expert)
        self.slots_per_rank = len(slot_to_expert) // num_ranks
        slots_of: list[list[int]] = [[] for _ in range(num_experts)]
        for slot, expert in enumerate(slot_to_expert):
            slots_of[expert].append(slot)
        missing = [e for e, s in enumerate(slots_of) if not s]
        if missing:
            raise ValueError(f"placement leaves experts {missing[:8]} without a slot")
        width = max(len(s) for s in slots_of)
        self.copies = torch.tensor([len(s) for s in slots_of], dtype=torch.int64, device=device)
        self.slots = torch.tensor([s + [s[0]] * (width - len(s)) for s in slots_of], dtype=torch.int64, device=device)

    def pick(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        """Physical slot for each (token, k) of ids [T, k]: copies of an expert take turns by
        token row (offset by `salt`, the rank), so a hot expert's tokens spread over its copies.
        Which copy serves a token never changes the result: copies hold the same weights."""
        turn = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + salt
        return self.slots[ids, turn % self.copies[ids]]

    def local_experts(self, rank: int) -> list[int]:
        return self.slot_to_expert[rank * self.slots_per_rank:(rank + 1) * self.slots_per_rank]


class LoadRecorder:
    """Token rows routed to each logical expert, per layer, over the last `window` steps."""

    def __init__(self, num_layers: int, num_experts: int, window: int, device: torch.device):
        # kept on the device: counting must not sync it, and nccl/hccl all-reduce device tensors
        self.current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.history: deque[torch.Tensor] = deque(maxlen=window)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        self.current[layer] += torch.bincount(ids.reshape(-1), minlength=self.current.shape[1])

    def end_step(self) -> None:
        self.history.append(self.current)
        self.current = torch.zeros_like(self.current)

    def window_load(self) -> torch.Tensor:
        """[layers, experts] summed over the window (this rank's tokens only)."""
        return torch.stack(list(self.history)).sum(0) if self.history else torch.zeros_like(self.current)
