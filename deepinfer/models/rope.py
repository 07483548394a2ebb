"""DeepSeek's rotary embedding tables (partial RoPE with optional YaRN), shared by the V3, V4 and
V4.1 families: the angles, their YaRN frequency blend and mscale, as DeepSeek's reference computes them."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass(slots=True)
class RopeConfig:
    theta: float
    dim: int  # rotated channels at the end of each head
    yarn: dict | None = None  # factor, original_max_position_embeddings, beta_fast, beta_slow

    def inv_freq(self, device=None) -> "torch.Tensor":
        """One angle rate per channel pair, in float32 exactly as the reference computes it.
        YaRN blends interpolated and extrapolated rates with a linear ramp; V4 does not
        rescale cos/sin (attention factor 1). Computed once per config and kept once per device
        (every step reads it; a captured step must not copy it there): the returned tensor is
        shared, read-only."""
        import torch

        return _inv_freq(*self._key()) if device is None else _inv_freq_on(self._key(), torch.device(device))

    def cos_sin(self, positions: "np.ndarray") -> tuple["torch.Tensor", "torch.Tensor"]:
        """(cos, sin) [len(positions), dim // 2] float32 of integer positions, gathered from a
        table of every position so far (grown by doubling): a step looks its rows up instead of
        running a multiply, a cos and a sin over them (~15 us of a decode step's planning). The
        values are those of `positions * inv_freq` computed in float32, as before."""
        import numpy
        import torch

        need = int(positions.max()) + 1 if len(positions) else 0
        table = self.table(need)
        if table is None:  # a long context: compute, rather than hold a table of every position
            return self.rotations(torch.from_numpy(positions))
        return tuple(torch.from_numpy(numpy.take(t, positions, axis=0)) for t in table)  # take: ~2x [] here

    def rotations(self, positions: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
        """(cos, sin) [len(positions), dim // 2] float32 of an integer position tensor, computed where
        it lives: the one formula behind `cos_sin` and its tables (the same values). A step that
        holds its positions as device tensors (DSpark's drafting and verify steps, recorded and
        replayed: core/graphs.py) calls this: a few elementwise ops of fixed shape, no host read,
        and no table of every position up to max_model_len in device memory."""
        freqs = positions[:, None].float() * self.inv_freq(positions.device)
        return freqs.cos(), freqs.sin()

    def table(self, need: int) -> "tuple[np.ndarray, np.ndarray] | None":
        """The (cos, sin) tables [>= need, dim // 2] behind `cos_sin` (shared, read-only), or None
        past the longest table kept."""
        import torch

        if need > _COS_SIN_TABLE_MAX:
            return None
        key = self._key()
        table = _COS_SIN_TABLES.get(key)
        if table is None or table[0].shape[0] < need:
            size = max(4096, 1 << max(need - 1, 1).bit_length())
            cos, sin = self.rotations(torch.arange(size))
            table = _COS_SIN_TABLES[key] = (cos.numpy(), sin.numpy())
        return table

    def _key(self) -> tuple:
        return self.theta, self.dim, tuple(sorted(self.yarn.items())) if self.yarn else None


_COS_SIN_TABLES: dict[tuple, tuple] = {}  # RopeConfig key -> (cos, sin) numpy tables
_COS_SIN_TABLE_MAX = 1 << 16  # positions: 16 MB per table at V4's 64 rotated channels


@functools.lru_cache(maxsize=64)
def _inv_freq_on(key: tuple, device: "torch.device") -> "torch.Tensor":
    rates = _inv_freq(*key)
    return rates if device == rates.device else rates.to(device)


@functools.lru_cache(maxsize=64)
def _inv_freq(theta: float, dim: int, yarn_items: tuple | None) -> "torch.Tensor":
    import torch

    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    if not yarn_items:
        return extrapolated
    yarn = dict(yarn_items)
    factor = float(yarn["factor"])
    orig = float(yarn["original_max_position_embeddings"])
    beta_fast = float(yarn.get("beta_fast") or 32)
    beta_slow = float(yarn.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated (original) rate
    return 1.0 / (factor * pos_freqs) * (1 - keep) + extrapolated * keep
