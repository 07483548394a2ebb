"""Step planning every family shares (host numpy, run in `prepare`): where each token of a step sits,
the rows of a sliding-window ring pool, which rows a ring keeps after the step, several decode steps
planned at once, and the rows this rank owns under context parallelism. A family's step module keeps
only what is its own (its layer kinds, compressed entries, attention lists)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.base import StepData


@dataclass(slots=True)
class RopeTables(StepData):
    """cos/sin of every token's position, for the window's RoPE and the compressed entries'."""

    main: tuple[np.ndarray, np.ndarray]
    compress: tuple[np.ndarray, np.ndarray]


def arange_within(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes `counts`: (group index of each element, index within its group)."""
    group = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return group, np.arange(len(group)) - first[group]


def decode_tokens(batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of `steps` decode steps of `batch` sequences planned at once, step by step: token
    (s, b), flat s * batch + b, is sequence b at its start position + s. -> (sequence, step) per token."""
    return np.tile(np.arange(batch), steps), np.repeat(np.arange(steps), batch)


def ring_rows(pos: np.ndarray, start: np.ndarray, first: np.ndarray, slot: np.ndarray, ring: int,
              ring_slots: int, members: int = 1) -> np.ndarray:
    """Row of position `pos` of the sequence whose tokens in this step start at position `start`, at
    flat token `first`, in `slot` (all broadcast against pos), in a pool of [ring rows of every slot |
    scratch rows] with `members` rings of `ring` rows per slot (member 0's: a layer adds member * ring
    where the row is in the ring): the step's own tokens are read from the scratch (one row per flat
    token), older ones from the ring; negative positions give -1."""
    scratch = ring_slots * members * ring + first + (pos - start)
    ringed = slot * members * ring + pos % ring  # numpy's % is floor-mod, as torch.remainder
    rows = np.where(pos >= start, scratch, ringed)
    return np.where(pos >= 0, rows, -1)


def commit_rows(pos: np.ndarray, end: np.ndarray, flat: np.ndarray, slot: np.ndarray, ring: int,
                ring_slots: int, members: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(scratch rows, member-0 ring rows) of the tokens a ring of `ring` rows keeps after the step:
    per token its position, its sequence's end in the step, its flat row and its slot."""
    keep = np.flatnonzero(pos >= end - ring)
    return ring_slots * members * ring + flat[keep], slot[keep] * members * ring + pos[keep] % ring


def per_step(planned: np.ndarray, steps: int) -> np.ndarray:
    """An array planned for several decode steps at once (`decode_tokens` order) as [steps, batch, ...]:
    row s is step s's."""
    return planned.reshape(steps, -1, *planned.shape[1:])


def first_step_ids(ids: torch.Tensor, steps: int) -> np.ndarray:
    """The token ids [steps, batch] of several decode steps planned at once: row 0 is the first step's
    (`ids`), the others the engine feeds back from each step's samples."""
    out = np.zeros((steps, len(ids)), dtype=np.int64)
    out[0] = ids.numpy()
    return out


class OwnedRows:
    """Context parallelism's view of a step (deepinfer/parallel: `split`, None with one process): `own`
    selects the token rows this rank computes, `all_tokens` gathers rows of every token from every rank."""

    def set_split(self, split) -> None:
        self.split = split
        self.own: slice | torch.Tensor = slice(None) if split is None else split.own

    def all_tokens(self, own_rows: torch.Tensor) -> torch.Tensor:
        """Rows of every token of the step, from the rows of the tokens this process owns."""
        return own_rows if self.split is None else self.split.gather(own_rows)
