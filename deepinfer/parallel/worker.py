"""One rank: its own LLMEngine (requests, scheduler, cache) stepping in lockstep with the others.

Every iteration of the lockstep loop runs exactly one model forward per rank, so the
collectives inside it (MoE dispatch/combine, context-parallel gathers) pair up across ranks: a
rank with nothing scheduled runs an empty batch through the expert collectives instead. The loop
ends when no rank has work (one all-reduce per step). Scheduling is synchronous here: the
overlapped worker thread would make the number of forwards per engine step vary between ranks.
Pure data parallelism (no expert or context parallelism) has no collective inside a step: its
ranks run their requests to the end independently, without the per-step all-reduce.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed

from deepinfer.backends import get_accelerator
from deepinfer.core.engine import EngineConfig, LLMEngine
from deepinfer.models.base import ParallelContext
from deepinfer.outputs import RequestOutput
from deepinfer.parallel import group
from deepinfer.parallel.config import ParallelConfig
from deepinfer.parallel.context_parallel import ContextParallel
from deepinfer.parallel.expert_parallel import ExpertParallelMoE


class RequestRejected(Exception):
    """A request the engine refuses (bad input): every rank raises it before any collective, so
    the workers stay usable and the caller gets the original error."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclass(slots=True)
class WorkerArgs:
    model: str
    tokenizer: str | None
    engine: EngineConfig
    parallel: ParallelConfig
    accelerator: str


def assign_requests(token_lists: list[list[int]], params, ranks: int) -> list[int]:
    """Data-parallel owner of each request: the rank with the least work so far (prompt +
    max_tokens), lowest rank on ties. A pure function of the inputs, so every rank agrees."""
    work = [0] * ranks
    owner = []
    for ids, p in zip(token_lists, params):
        r = min(range(ranks), key=lambda x: (work[x], x))
        owner.append(r)
        work[r] += len(ids) + p.max_tokens
    return owner


class RankWorker:
    def __init__(self, args: WorkerArgs, rank: group.Rank):
        self.rank, self.parallel = rank, args.parallel
        accel = get_accelerator(args.accelerator)  # this rank's own instance
        self.ep = ExpertParallelMoE(accel, rank, self.parallel) if self.parallel.expert_parallel_size > 1 else None
        self.cp = ContextParallel(rank.rank, self.parallel.context_parallel_size) \
            if self.parallel.context_parallel_size > 1 else None
        # no DSpark on parallel ranks yet: ranks that share requests must pick identical verify
        # lengths, and the dynamic policy's step-cost table is timed on each rank. Synchronous
        # scheduling (see the module doc). Caches planned from the memory every rank has. KV events:
        # a serving rank publishes its own (parallel/serving_rank.py), on sockets of its rank.
        engine_config = dataclasses.replace(args.engine, speculative=False, available_memory=_agreed_free_memory(accel),
                                            processes_per_host=rank.local_world_size, kv_events=None)
        self.engine = LLMEngine(args.model, accel, engine_config, args.tokenizer,
                                ParallelContext(expert_parallel=self.ep, context_parallel=self.cp))
        self.engine.close()
        self.engine.zero_overhead = False
        self.parallel.validate(getattr(self.engine.model_config, "n_routed_experts", None))
        if self.ep is not None or self.cp is not None:  # their collectives run inside every forward
            self.engine.multi_step = 1
        self.steps = 0

    # ------------------------------------------------------------ requests
    def generate(self, token_lists: list[list[int]], params: list, texts: list) -> dict[int, RequestOutput]:
        """Serve this rank's share of the prompts; returns {prompt index: output}. The ranks of a
        request group (world / data_parallel_size ranks: replicated attention, or a context-
        parallel group) all serve the group's prompts identically; the first one returns them."""
        engine = self.engine
        group_size = self.rank.world_size // self.parallel.data_parallel_size
        try:
            for i, (ids, p) in enumerate(zip(token_lists, params)):
                engine.validate_request(ids, p, what=f"prompt {i}")
                if p.so_args is not None and group_size > 1:
                    raise ValueError("structured outputs (so_args) need data_parallel_size == world size: ranks "
                                     "that share requests must schedule identically, and grammar compiles finish "
                                     "at different times on each rank")
        except ValueError as exc:
            raise RequestRejected(exc) from exc
        owner = assign_requests(token_lists, params, self.parallel.data_parallel_size)
        mine = [i for i, r in enumerate(owner) if r == self.rank.rank // group_size]
        requests = {i: engine.add_request(token_lists[i], params[i], texts[i]) for i in mine}
        self._run_lockstep()
        engine.pop_finished()
        if self.rank.rank % group_size:
            return {}
        return {i: req.to_output() for i, req in requests.items()}

    def _run_lockstep(self) -> None:
        while self.step_once():
            pass

    def step_once(self) -> bool:
        """One iteration of the lockstep loop; False when no rank had work (then nothing ran).
        Pure data parallelism shares no collective: a rank steps only itself, and only when busy."""
        busy = self.engine.has_unfinished()
        if self.ep is None and self.cp is None:
            if busy:
                self.engine.step()
                self.steps += 1
            return busy
        if not group.any_rank(busy, self.engine.accel.device):
            return False
        before = self.engine.num_forwards
        if busy:
            self.engine.step()
        if self.engine.num_forwards == before and self.ep is not None:
            self.ep.idle_step()
        self.steps += 1
        if self.ep is not None:
            self.ep.end_step(self.steps)
        return True

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Per-rank counters for benchmarks and tests."""
        out = {"rank": self.rank.rank, "steps": self.steps, "forwards": self.engine.num_forwards}
        if self.ep is not None:
            out.update(ep_seconds=dict(self.ep.seconds), rearrangements=self.ep.rearrangements,
                       placements=[p.slot_to_expert for p in self.ep.placements])
        if self.cp is not None:
            out.update(cp_rows=dict(self.cp.rows))
        return out


def engine_stats(worker: "RankWorker") -> dict | None:
    """The engine counters of a request group's first rank (the others serve the same requests
    and would count them again); None on the others. For ParallelExecutor.collective_rpc."""
    group_size = worker.rank.world_size // worker.parallel.data_parallel_size
    return worker.engine.stats() if worker.rank.rank % group_size == 0 else None


def _agreed_free_memory(accel) -> int:
    """Ranks that serve the same requests must schedule (and preempt) identically, so their
    caches must hold the same number of pages; each would size its cache from the memory it
    sees free at its own moment. Every rank uses the smallest value instead."""
    free = torch.tensor([accel.memory_info()[0]], dtype=torch.int64, device=accel.device)
    torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN)
    return int(free.item())


def bind_device(local_rank: int) -> None:
    """One device per rank on machines with an accelerator (cuda:r, npu:r); nothing on cpu."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available() and acc.device_count() > 1:
        acc.set_device_index(local_rank % acc.device_count())
