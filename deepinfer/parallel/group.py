"""The process group and the few collectives the engine uses, on torch.distributed.

The backend comes from the accelerator (gloo on cpu, nccl on nvidia, hccl on ascend). Tensors
travel as raw bytes when their dtype is one a backend cannot carry (gloo rejects fp8), so fp8
activations or expert weights cross the wire as uint8 views and are viewed back on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer import envs

_BYTE_DTYPES = tuple(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")) if d is not None)


@dataclass(frozen=True, slots=True)
class Rank:
    rank: int
    world_size: int

    @property
    def local_world_size(self) -> int:
        """Ranks on this machine: all of them when spawned here, torchrun's LOCAL_WORLD_SIZE under it."""
        return envs.torchrun_local_world_size(self.world_size)


def launched_by_torchrun() -> bool:
    """torchrun (and other env:// launchers) set these for every process it starts."""
    return envs.launched_by_torchrun()


def init_group(backend: str, rank: int | None = None, world_size: int | None = None,
               init_method: str | None = None, timeout_s: float = 600.0) -> Rank:
    """Join the group: explicit rank/world/init_method (spawned workers), else torchrun's env."""
    if not dist.is_initialized():
        if init_method is None:
            init_method = "env://"
            rank, world_size = envs.torchrun_rank()
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    return Rank(dist.get_rank(), dist.get_world_size())


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend can carry it: a byte view for fp8, itself otherwise."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in _BYTE_DTYPES else t


def exchange_counts(send_counts: torch.Tensor) -> torch.Tensor:
    """Each rank tells every other how many rows it will send: [W] int64 -> [W] rows to receive."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts)
    return recv


def all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Uneven all-to-all of rows [N, ...]: the first send_counts[0] rows go to rank 0, the next to
    rank 1, ...; returns the received rows in rank order. Any dtype, fp8 included."""
    wire = _wire(rows)
    out = torch.empty((sum(recv_counts), *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    dist.all_to_all_single(out, wire, recv_counts, send_counts)
    return out.view(rows.dtype) if wire.dtype != rows.dtype else out


def all_gather_rows(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Concatenate every rank's rows (rank r holds counts[r] of them): gloo needs equal sizes,
    so each share is padded to the largest and trimmed after."""
    width = max(counts)
    wire = _wire(rows)
    padded = torch.zeros((width, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    padded[:wire.shape[0]] = wire
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    out = torch.cat([p[:n] for p, n in zip(parts, counts)])
    return out.view(rows.dtype) if wire.dtype != rows.dtype else out


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when `flag` is true on at least one rank (the lockstep loop's stop condition)."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t
