"""What every DSpark drafter (V4, V4.1) is set up by: the config's `dspark_*` keys and the `mtp.<k>.`
stages its checkpoint holds, and the layout of its per-slot context rings. Each family reads them its
own way and adds what it needs."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deepinfer.models.base import Pool, PoolSpec


@dataclass(frozen=True, slots=True)
class DSparkSettings:
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    num_stages: int


def mtp_stages(names) -> set[int]:
    """The drafter stage numbers k of the `mtp.<k>.` tensors among `names`."""
    return {int(m.group(1)) for name in names if (m := re.match(r"mtp\.(\d+)\.", name))}


def context_ring_pools(kv: list[torch.Tensor], ring: int, max_seqs: int) -> list[Pool]:
    """Each stage's context KV [slot rings | block scratch] as a ring pool: slot s holds rows
    [s * ring, (s + 1) * ring) (Drafter.slot_pools: what P/D moves with a request)."""
    slots = max_seqs * ring
    return [Pool(PoolSpec(f"dspark.{k}.kv", t.shape[1], ring=ring), t, slots, slots, 0) for k, t in enumerate(kv)]
