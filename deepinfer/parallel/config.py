"""ParallelConfig: how ranks split the work, and the layouts we refuse (with a clear reason).

Attention runs either on every rank with its own tokens (data/context parallel: dp*cp == world;
context-parallel ranks share requests but split each step's tokens) or replicated on every rank
(dp*cp == 1). MoE experts are either sharded over every rank
(ep == world) or whole on each (ep == 1). The usual layout is dp == ep: each rank owns its
requests and a 1/ep share of the experts, and tokens travel to their experts and back.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot run: says which sizes clash and what would work."""


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    context_parallel_size: int = 1
    num_redundant_experts: int = 0  # EPLB: extra physical expert slots holding copies of hot experts
    eplb_window_size: int = 0  # EPLB: steps of measured expert load a rearrangement looks at; 0 = off
    eplb_step_interval: int = 0  # EPLB: steps between rearrangements; 0 = never rearrange

    @property
    def world_size(self) -> int:
        return max(self.expert_parallel_size, self.data_parallel_size * self.context_parallel_size)

    @property
    def attention_ranks(self) -> int:
        """Ranks that hold different tokens (1 = attention replicated on every rank)."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def eplb_enabled(self) -> bool:
        return self.eplb_step_interval > 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def validate(self, n_routed_experts: int | None = None) -> None:
        names = ("expert_parallel_size", "data_parallel_size", "context_parallel_size")
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("num_redundant_experts", "eplb_window_size", "eplb_step_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"{name} must be an int >= 0, got {value!r}")
        ep, attn = self.expert_parallel_size, self.attention_ranks
        if ep > 1 and attn > 1 and ep != attn:
            raise LayoutError(
                f"expert_parallel_size={ep} must equal data_parallel_size*context_parallel_size={attn} when both "
                f"exceed 1 (each rank holds both an attention share and an expert share); use "
                f"expert_parallel_size={attn}, or 1 to keep every expert on every rank")
        if self.context_parallel_size > 1 and self.data_parallel_size > 1:
            raise LayoutError("context_parallel_size > 1 with data_parallel_size > 1 is not supported: "
                              "use one of the two")
        if (self.num_redundant_experts or self.eplb_step_interval) and ep == 1:
            raise LayoutError("EPLB (num_redundant_experts / eplb_step_interval) balances experts across "
                              "expert-parallel ranks: it needs expert_parallel_size > 1")
        if self.eplb_step_interval and not self.eplb_window_size:
            raise LayoutError("eplb_step_interval is set but eplb_window_size is 0: rearrangement needs a "
                              "window of measured load (e.g. eplb_window_size=eplb_step_interval)")
        if n_routed_experts is not None and ep > 1:
            slots = n_routed_experts + self.num_redundant_experts
            if slots % ep:
                raise LayoutError(
                    f"{n_routed_experts} routed experts + {self.num_redundant_experts} redundant slots = {slots} "
                    f"cannot be split evenly over expert_parallel_size={ep}: pick an expert_parallel_size "
                    f"that divides {slots}, or change num_redundant_experts")
