"""Output allocation for the kernels. Tests set `poison = True` so every buffer starts as NaN
(integers as INT64_MIN): an element a kernel fails to write then shows up as a mismatch."""

from __future__ import annotations

import torch

poison = False


def empty(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    if not poison:
        return torch.empty(*shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)
