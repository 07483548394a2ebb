"""Memory planning: how many cache pages fit beside the weights, and the report of where memory went.

`gpu_memory_utilization` (upstream's name, default 0.9) is the share of the memory this engine may
fill: the memory free once the weights are in place plus the weights themselves, so

    cache budget = utilization x (free after weights + weight bytes) - weight bytes - activation headroom

On nvidia and ascend "free" is the device's free memory; on cpu it is the host's available RAM
(MemAvailable: other processes share it). The activation headroom is a bound on what one step
allocates besides the cache (`activation_headroom`). `cache_bytes` or `num_cache_pages` override
the rule. A checkpoint whose weights cannot fit at all is refused before it is loaded, and a cache
that cannot hold one page beside its sequence slots is refused with every size of the sum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.backends.quant import QuantizedWeight

GiB = float(1 << 30)


def _gib(n: int | float) -> str:
    return f"{n / GiB:.3f} GiB"


def checkpoint_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the checkpoint's safetensors files (what the weights occupy as stored)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def weight_kind(w) -> str:
    """How a loaded weight is stored: its dtype, or a quantized format with its block."""
    if isinstance(w, QuantizedWeight):
        scale = "ue8m0" if w.scale.dtype == torch.uint8 else "float32"
        return f"{w.format} {w.block[0]}x{w.block[1]} ({scale} scales)"
    return str(w.dtype).removeprefix("torch.")


def weights_by_kind(*weight_dicts: dict) -> dict[str, int]:
    """Bytes per storage kind (scales included with their weights), over every tensor given."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for weights in weight_dicts:
        for w in weights.values():
            key = id(w.data) if isinstance(w, QuantizedWeight) else id(w)
            if key in seen:  # a tied embedding / head is held once
                continue
            seen.add(key)
            nbytes = w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
            kind = weight_kind(w)
            out[kind] = out.get(kind, 0) + nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def activation_headroom(hidden_size: int, vocab_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A bound on what one step allocates besides the cache: 64 float32 vectors of the hidden size
    per batched token (residual streams, projections, the MoE's routed rows, attention gathers) and
    4 float32 rows of the vocabulary per sequence (logits, sampling)."""
    return 4 * (64 * hidden_size * max_num_batched_tokens + 4 * vocab_size * max_num_seqs)


class DoesNotFit(ValueError):
    """The model or its cache does not fit: the message names every size."""


def check_weights_fit(model_dir, free: int, utilization: float, device: str) -> None:
    """Refuse, before loading, a checkpoint whose stored bytes exceed what the device may hold."""
    need = checkpoint_bytes(model_dir)
    if need > utilization * free:
        raise DoesNotFit(
            f"the checkpoint in {model_dir} holds {_gib(need)} of weights (kept as stored), but the {device} has "
            f"{_gib(free)} free and gpu_memory_utilization={utilization} allows {_gib(utilization * free)}: free "
            "memory, raise gpu_memory_utilization, or shard the experts (expert_parallel_size)")


@dataclass
class CachePlan:
    """The sum behind the cache size (all bytes)."""

    utilization: float
    free_after_weights: int
    weight_bytes: int
    headroom: int
    budget: int  # what the cache may take
    fixed: int  # sequence slots + step scratch rows
    per_page: int
    pages: int
    explicit: str = ""  # "cache_bytes" / "num_cache_pages" when the user set the size
    capped: bool = False  # the budget holds more than every slot at max_model_len needs

    def describe(self) -> str:
        if self.explicit == "num_cache_pages":
            return f"num_cache_pages given: {self.pages} pages"
        rule = f"cache_bytes={self.budget}" if self.explicit else (
            f"{self.utilization} x ({_gib(self.free_after_weights)} free + {_gib(self.weight_bytes)} weights) - "
            f"{_gib(self.weight_bytes)} weights - {_gib(self.headroom)} activation headroom = {_gib(self.budget)}")
        return rule + (" (more than every sequence slot at max_model_len needs)" if self.capped else "")


def plan_pages(*, utilization: float, free_after_weights: int, weight_bytes: int, headroom: int, fixed: int,
               per_page: int, max_pages: int, cache_bytes: int | None, device: str, what: str) -> CachePlan:
    """How many pages the cache gets (at most `max_pages`: every slot at max_model_len)."""
    if cache_bytes is not None:
        budget, explicit = cache_bytes, "cache_bytes"
    else:
        budget = int(utilization * (free_after_weights + weight_bytes)) - weight_bytes - headroom
        explicit = ""
    plan = CachePlan(utilization, free_after_weights, weight_bytes, headroom, budget, fixed, per_page, 0, explicit)
    if per_page == 0:
        return plan
    pages = (budget - fixed) // per_page
    if pages < 1:
        source = f"cache_bytes={cache_bytes}" if cache_bytes is not None else \
            f"on the {device}, {plan.describe()}"
        raise DoesNotFit(
            f"the cache does not fit: it needs {_gib(fixed + per_page)} ({what} and one page of {per_page} bytes), "
            f"{source}. Lower max_num_seqs or max_num_batched_tokens, raise gpu_memory_utilization, or free memory")
    plan.pages, plan.capped = int(min(pages, max_pages)), pages > max_pages
    return plan


@dataclass
class MemoryReport:
    """Where the engine's memory went (LLM.memory_report())."""

    device: str
    weights: dict[str, int]  # bytes by storage kind
    checkpoint_bytes: int
    cache: dict[str, int]  # pools' bytes: total, per page, pages, slots, scratch
    plan: CachePlan
    free_after: int  # device / host memory free once the cache is allocated
    notes: list[str] = field(default_factory=list)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    def as_dict(self) -> dict:
        return {"device": self.device, "weights": dict(self.weights), "weight_bytes": self.weight_bytes,
                "checkpoint_bytes": self.checkpoint_bytes, "cache": dict(self.cache),
                "headroom": self.plan.headroom, "free_after": self.free_after, "plan": self.plan.describe()}

    def __str__(self) -> str:
        lines = [f"deepinfer memory on the {self.device}:"]
        ratio = f" ({self.weight_bytes / self.checkpoint_bytes:.3f}x the checkpoint's {_gib(self.checkpoint_bytes)})" \
            if self.checkpoint_bytes else ""
        lines.append(f"  weights {_gib(self.weight_bytes)}{ratio}")
        lines += [f"    {kind:<40} {_gib(n)}" for kind, n in self.weights.items()]
        c = self.cache
        lines.append(f"  cache {_gib(c['total'])}: {c['pages']} pages of {c['per_page']} bytes, "
                     f"{c['slots']} sequence slots ({_gib(c['slot_bytes'])}), step scratch {_gib(c['scratch_bytes'])}")
        lines.append(f"    sized by {self.plan.describe()}")
        lines.append(f"  headroom: {_gib(self.plan.headroom)} reserved for activations, {_gib(self.free_after)} free now")
        return "\n".join(lines + [f"  {n}" for n in self.notes])
