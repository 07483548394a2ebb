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

    def inv_freq(self) -> "torch.Tensor":
        """One angle rate per channel pair, in float32 exactly as the reference computes it.
        YaRN blends interpolated and extrapolated rates with a linear ramp; V4 does not
        rescale cos/sin (attention factor 1). Computed once per config (every step reads it):
        the returned tensor is shared, read-only."""
        return _inv_freq(*self._key())

    def cos_sin(self, positions: "np.ndarray") -> tuple["torch.Tensor", "torch.Tensor"]:
        """(cos, sin) [len(positions), dim // 2] float32 of integer positions, gathered from a
        table of every position so far (grown by doubling): a step looks its rows up instead of
        running a multiply, a cos and a sin over them (~15 us of a decode step's planning). The
        values are those of `positions * inv_freq` computed in float32, as before."""
        import torch

        need = int(positions.max()) + 1 if len(positions) else 0
        table = self.table(need)
        if table is None:  # a long context: compute, rather than hold a table of every position
            freqs = torch.from_numpy(positions)[:, None].float() * _inv_freq(*self._key())
            return freqs.cos(), freqs.sin()
        return torch.from_numpy(table[0][positions]), torch.from_numpy(table[1][positions])

    def device_table(self, size: int, device) -> "tuple[torch.Tensor, torch.Tensor]":
        """(cos, sin) [size, dim // 2] of positions 0 .. size - 1 on `device`, the values `cos_sin`
        gives: for a step that looks its rows up by position tensors on the device (a recorded step
        reads no positions into Python)."""
        import torch

        table = self.table(size)
        if table is None:
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * _inv_freq(*self._key())
            return freqs.cos().to(device), freqs.sin().to(device)
        return tuple(torch.from_numpy(t[:size]).to(device) for t in table)

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
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * _inv_freq(*key)
            table = _COS_SIN_TABLES[key] = (freqs.cos().numpy(), freqs.sin().numpy())
        return table

    def _key(self) -> tuple:
        return self.theta, self.dim, tuple(sorted(self.yarn.items())) if self.yarn else None


_COS_SIN_TABLES: dict[tuple, tuple] = {}  # RopeConfig key -> (cos, sin) numpy tables
_COS_SIN_TABLE_MAX = 1 << 16  # positions: 16 MB per table at V4's 64 rotated channels


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
