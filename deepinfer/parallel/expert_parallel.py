"""Expert parallelism: routed experts sharded over ranks, tokens dispatched to them and back.

Handed to the model at construction (ParallelContext.expert_parallel): the model registers each MoE
layer's expert stacks (`add_layer`) and calls what it gets back for that layer's routed experts.
Per MoE layer and step, each rank:
  dispatch: sorts its (token, k) rows by the physical slot that serves them (slots are
    contiguous per rank, so this also groups them by destination), exchanges row counts,
    then sends the rows, each with its slot, in one all_to_all_single (uneven splits);
  computes: its local experts on the rows it received (the accelerator's moe_experts op,
    one expert per row, weight 1);
  combine: sends the outputs back the same way and sums each token's k outputs with its
    routing weights in k order, the single-process formula, so results match one process.
The shared expert stays local (the model runs it). With attention replicated (one set of
tokens on every rank) each rank takes an even slice of the tokens and the outputs are
all-gathered after combine. A rank with no tokens still joins every collective
(`idle_step`), which is how data-parallel ranks stay in lockstep.
"""

from __future__ import annotations

import time

import torch

from deepinfer.backends.quant import QuantizedWeight
from deepinfer.parallel import group
from deepinfer.parallel.config import ParallelConfig
from deepinfer.parallel.eplb import LoadRecorder, Placement, contiguous_placement, plan_placement


def even_split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


class ExpertParallelMoE:
    def __init__(self, accel, rank: group.Rank, parallel: ParallelConfig):
        self.accel, self.rank, self.world = accel, rank.rank, rank.world_size
        self.device = accel.device
        self.replicated = parallel.attention_ranks == 1
        self.parallel = parallel
        self.placements: list[Placement] = []
        self.local: list[tuple[torch.Tensor, torch.Tensor]] = []  # this rank's slots of each layer's stacks
        self.layer_args: list[tuple[int, int, float]] = []  # (hidden, top_k, swiglu limit) per layer
        self.layer_experts: list = []  # per layer: the model's expert function (weights inside) or None
        self.recorder: LoadRecorder | None = None
        self.seconds = {"sync": 0.0, "dispatch": 0.0, "experts": 0.0, "combine": 0.0}
        self.rearrangements = 0

    @property
    def num_layers(self) -> int:
        return len(self.local)

    def add_layer(self, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, limit: float, experts=None):
        """A MoE layer's full expert stacks [E, 2I, D] / [E, D, I]: this rank keeps its slots' copies
        (the full stacks are not held). Returns the layer's routed experts, (h, weights, ids) -> out.
        `experts(h, weights, ids, gate_up, down) -> [T, D]`: the model's own routed-expert computation
        when its routing weights act inside the expert (DeepSeek-V4.1 scales the intermediate before
        quantizing it for w2): each row then travels with its weight and the rank applies it; by
        default the accelerator's moe_experts runs at weight 1 and the weights are applied at combine."""
        i, num_experts = self.num_layers, gate_up.shape[0]
        self.num_experts, self.num_slots = num_experts, num_experts + self.parallel.num_redundant_experts
        start = plan_placement([0] * num_experts, self.num_slots, self.world) if self.parallel.num_redundant_experts \
            else contiguous_placement(num_experts)
        self.placements.append(Placement(start, num_experts, self.world, self.device))
        mine = torch.tensor(self.placements[i].local_experts(self.rank), device=gate_up.device)
        self.local.append((gate_up[mine].contiguous(), down[mine].contiguous()))
        self.layer_args.append((gate_up.shape[2], top_k, limit))
        self.layer_experts.append(experts)
        if self.parallel.eplb_enabled:  # sized for every layer so far: layers register in order, before any step
            self.recorder = LoadRecorder(self.num_layers, num_experts, self.parallel.eplb_window_size, self.device)
        return lambda h, weights, ids: self(i, h, weights, ids)

    # ------------------------------------------------------------ forward
    def __call__(self, i: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.replicated:
            return self._dispatch_combine(i, h, weights, ids)
        counts = even_split(h.shape[0], self.world)
        lo = sum(counts[:self.rank])
        mine = slice(lo, lo + counts[self.rank])
        out = self._dispatch_combine(i, h[mine], weights[mine], ids[mine])
        return group.all_gather_rows(out, counts)

    def idle_step(self) -> None:
        """A step in which this rank has no tokens: serve the other ranks' tokens anyway."""
        for i, (d, k, _) in enumerate(self.layer_args):
            h = torch.zeros(0, d, device=self.device)
            self(i, h, torch.zeros(0, k, device=self.device), torch.zeros(0, k, dtype=torch.int64, device=self.device))

    def _dispatch_combine(self, i: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = ids.shape
        placement = self.placements[i]
        if self.recorder is not None:
            self.recorder.add(i, ids)
        t0 = time.perf_counter()
        slots = placement.pick(ids, self.rank).reshape(-1)
        order = torch.argsort(slots, stable=True)
        sorted_slots = slots[order]
        send = torch.bincount(sorted_slots // placement.slots_per_rank, minlength=self.world)
        recv = group.exchange_counts(send)  # also where a rank waits for slower ones
        t_sync = time.perf_counter()
        send_counts, recv_counts = send.tolist(), recv.tolist()
        # one message per row: the activation's bytes followed by the local slot's (one collective, not
        # two), and its routing weight's when the model applies weights inside the expert
        inside = self.layer_experts[i]
        x = h[order // top_k].contiguous()
        parts = [x.view(torch.uint8), (sorted_slots % placement.slots_per_rank).unsqueeze(1).view(torch.uint8)]
        if inside is not None:
            parts.append(weights.reshape(-1)[order].float().unsqueeze(1).contiguous().view(torch.uint8))
        got = group.all_to_all_rows(torch.cat(parts, dim=1), send_counts, recv_counts)
        tail = 12 if inside is not None else 8
        rows = got[:, :-tail].contiguous().view(x.dtype)
        # reshape, not contiguous(): one received row of 4D+12 bytes is already "contiguous" and would
        # keep its row stride, which an 8-byte view rejects (V4.1's rows with weights, a rank getting one)
        local_slot = got[:, -tail:][:, :8].reshape(-1).view(torch.int64)
        t1 = time.perf_counter()
        gate_up, down = self.local[i]
        if not rows.shape[0]:  # nothing routed here this step; the op is not defined on empty input
            out = torch.zeros(0, h.shape[1], dtype=torch.float32, device=self.device)
        elif inside is not None:
            row_weights = got[:, -4:].reshape(-1).view(torch.float32).unsqueeze(1)
            out = inside(rows, row_weights, local_slot.unsqueeze(1), gate_up, down)
        else:
            ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=self.device)
            out = self.accel.moe_experts(rows, ones, local_slot.unsqueeze(1), gate_up, down, self.layer_args[i][2])
        t2 = time.perf_counter()
        back = group.all_to_all_rows(out, recv_counts, send_counts)
        per_slot = torch.empty_like(back)
        per_slot[order] = back
        per_slot = per_slot.view(num_tokens, top_k, h.shape[1])
        if inside is None:
            result = (per_slot * weights.unsqueeze(-1)).sum(dim=1)
        else:  # weighted already; summed in k order, as the model's single-process experts
            result = per_slot[:, 0]
            for j in range(1, top_k):
                result = result + per_slot[:, j]
        t3 = time.perf_counter()
        self.seconds["sync"] += t_sync - t0
        self.seconds["dispatch"] += t1 - t_sync
        self.seconds["experts"] += t2 - t1
        self.seconds["combine"] += t3 - t2
        return result

    # ------------------------------------------------------------ EPLB
    def end_step(self, step: int) -> None:
        """Close a lockstep step's load record; every `eplb_step_interval` steps, rearrange."""
        if self.recorder is None:
            return
        self.recorder.end_step()
        if step % self.parallel.eplb_step_interval == 0:
            self.rearrange()

    def rearrange(self) -> None:
        """Re-plan every layer from the window's load summed over ranks, and move expert weights
        to their new slots with one uneven all_to_all per layer (copies come from the lowest
        rank that holds the expert now)."""
        load = group.sum_over_ranks(self.recorder.window_load()).tolist()
        for i in range(self.num_layers):
            new = plan_placement(load[i], self.num_slots, self.world)
            if new != self.placements[i].slot_to_expert:
                self._move_weights(i, new)
                self.placements[i] = Placement(new, self.num_experts, self.world, self.device)
        self.rearrangements += 1

    def _move_weights(self, i: int, new: list[int]) -> None:
        old, per_rank, me = self.placements[i].slot_to_expert, self.placements[i].slots_per_rank, self.rank
        source: dict[int, int] = {}  # expert -> the old slot it is copied from
        for slot, expert in enumerate(old):
            source.setdefault(expert, slot)
        src_rank = [source[e] // per_rank for e in new]  # per new slot
        send_rows = [source[new[s]] % per_rank for s in range(len(new)) if src_rank[s] == me]
        send_counts = [sum(src_rank[s] == me for s in range(d * per_rank, (d + 1) * per_rank))
                       for d in range(self.world)]
        my_slots = range(me * per_rank, (me + 1) * per_rank)
        recv_counts = [sum(src_rank[s] == r for s in my_slots) for r in range(self.world)]
        stacks = self.local[i]
        parts = [t for w in stacks for t in _tensors_of(w)]  # a quantized stack moves its scales along
        packed = torch.cat([t.reshape(per_rank, -1).view(torch.uint8) for t in parts], dim=1)
        got = group.all_to_all_rows(packed[torch.tensor(send_rows, dtype=torch.int64, device=packed.device)],
                                    send_counts, recv_counts)
        arrival = sorted(range(per_rank), key=lambda j: (src_rank[me * per_rank + j], j))  # rank order, then slot
        placed = torch.empty_like(got)
        placed[torch.tensor(arrival, dtype=torch.int64, device=got.device)] = got
        moved, start = [], 0
        for t in parts:
            width = t[0].numel() * t.element_size()
            moved.append(placed[:, start:start + width].contiguous().view(t.dtype).view(t.shape))
            start += width
        gate_up = _with_tensors(stacks[0], moved[:len(_tensors_of(stacks[0]))])
        self.local[i] = (gate_up, _with_tensors(stacks[1], moved[len(_tensors_of(stacks[0])):]))


def _tensors_of(stack) -> list[torch.Tensor]:
    """The tensors an expert stack is stored in, each with the experts as dim 0."""
    return [stack.data, stack.scale] if isinstance(stack, QuantizedWeight) else [stack]


def _with_tensors(stack, tensors: list[torch.Tensor]):
    """`stack` rebuilt from moved tensors (the inverse of _tensors_of)."""
    if isinstance(stack, QuantizedWeight):
        return QuantizedWeight(tensors[0], tensors[1], stack.format, stack.block, stack.act)
    return tensors[0]
