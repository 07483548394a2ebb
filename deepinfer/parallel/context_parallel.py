"""Context parallelism: one step's tokens split over ranks, long prefills in balanced chunks.

Every rank of a context-parallel group schedules the same requests and holds the same decode
state. Within a step each rank owns some token rows and runs only their token-wise work
(queries, attention, MoE, residual streams); the keys and compressor inputs of all tokens are
all-gathered once per layer, so every rank writes the same window ring and compressed entries
and decode needs no extra assembly. The streams are gathered once more before the LM head.

Causal attention costs more for late tokens than early ones, so a chunk of n >= 2*cp tokens
is cut into 2*cp pieces and rank r owns pieces r and 2*cp-1-r: every rank gets one early and
one late piece. Shorter chunks (decode tokens) go whole to one rank, chunk by chunk in turn.
"""

from __future__ import annotations

import torch

from deepinfer.parallel import group
from deepinfer.parallel.expert_parallel import even_split


def balanced_owner(lens: list[int], ranks: int) -> list[int]:
    """Owning rank of every token row of a step whose chunks have sizes `lens`."""
    owner: list[int] = []
    for c, n in enumerate(lens):
        if n < 2 * ranks:
            owner += [c % ranks] * n
            continue
        for piece, size in enumerate(even_split(n, 2 * ranks)):
            owner += [piece if piece < ranks else 2 * ranks - 1 - piece] * size
    return owner


class StepSplit:
    """One step's rows on one rank: `own` (the token rows this rank computes) and `gather`."""

    def __init__(self, owner: torch.Tensor, rank: int, ranks: int, device: torch.device):
        self.owner, self.rank, self.ranks = owner, rank, ranks  # owner: host, the owning rank of every row
        rows = [(owner == r).nonzero().squeeze(1) for r in range(ranks)]
        self.own_rows = rows[rank]  # host copy of `own`
        self.counts = [len(r) for r in rows]
        # gathered rows arrive rank by rank; `restore` puts them back in step order
        restore = torch.empty(len(owner), dtype=torch.int64)
        restore[torch.cat(rows)] = torch.arange(len(owner))
        self.own, self.restore = self.own_rows.to(device), restore.to(device)

    def gather(self, own_rows: torch.Tensor) -> torch.Tensor:
        """Rows of every token of the step, in step order, from every rank's own rows."""
        return group.all_gather_rows(own_rows, self.counts)[self.restore]

    def subset(self, rows: torch.Tensor) -> "StepSplit":
        """The split of some of the step's rows (host indices), each computed by its owner: for a model
        that runs later layers on fewer rows (DeepSeek-V4.1's decoder on each chunk's tail)."""
        return StepSplit(self.owner[rows], self.rank, self.ranks, self.own.device)


class ContextParallel:
    """Handed to the model at construction (ParallelContext.context_parallel): the model splits
    every step it prepares."""

    def __init__(self, rank: int, ranks: int):
        self.rank, self.ranks = rank, ranks
        self.rows = {"own": 0, "step": 0}  # token rows computed here vs in the steps (for stats)

    def split(self, lens: list[int], device: torch.device) -> StepSplit:
        split = StepSplit(torch.tensor(balanced_owner(lens, self.ranks), dtype=torch.int64), self.rank, self.ranks,
                          device)
        self.rows["own"] += split.counts[self.rank]
        self.rows["step"] += sum(split.counts)
        return split
