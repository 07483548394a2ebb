"""What every DSpark drafter (V4, V4.1) is set up by: the config's `dspark_*` keys and the `mtp.<k>.`
stages its checkpoint holds. Each family reads them its own way and adds what it needs."""

from __future__ import annotations

import re
from dataclasses import dataclass


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
