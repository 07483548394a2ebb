"""The collectives' contract (uneven all_to_all, fp8 as bytes, empty ranks) on real gloo
processes, and EPLB's placement planner."""

from __future__ import annotations

import io
import os

import torch
import torch.multiprocessing as mp


def _exchange(rank: int, world: int, store: str, results) -> None:
    from deepinfer.parallel import group

    group.init_group("gloo", rank, world, f"file://{store}")
    try:
        # rank r sends r+1 rows to every other rank and none to itself; rank 1 also sends fp8
        send = [0 if d == rank else rank + 1 for d in range(world)]
        rows = torch.arange(sum(send) * 4, dtype=torch.float32).view(-1, 4) / 8 + rank
        recv = group.exchange_counts(torch.tensor(send)).tolist()
        got = group.all_to_all_rows(rows, send, recv)
        fp8 = group.all_to_all_rows(rows.to(torch.float8_e4m3fn), send, recv)
        gathered = group.all_gather_rows(rows[:rank], list(range(world)))  # rank 0 contributes nothing
        # serialized, not queued as tensors: a queued tensor travels as a shared-memory fd that its
        # sender must outlive, and this rank exits right after
        buf = io.BytesIO()
        torch.save((rank, recv, got, fp8, gathered), buf)
        results.put(buf.getvalue())
    finally:
        group.destroy_group()


def test_uneven_all_to_all_carries_fp8_as_bytes(tmp_path):
    world = 3
    store = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_exchange, args=(r, world, store, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {r: (recv, got, fp8, gathered) for r, recv, got, fp8, gathered in
           (torch.load(io.BytesIO(results.get(timeout=120))) for _ in procs)}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank, (recv, got, fp8, gathered) in out.items():
        assert recv == [0 if s == rank else s + 1 for s in range(world)]
        expected = []
        for src in range(world):
            send = [0 if d == src else src + 1 for d in range(world)]
            rows = torch.arange(sum(send) * 4, dtype=torch.float32).view(-1, 4) / 8 + src
            expected.append(rows[sum(send[:rank]):sum(send[:rank + 1])])
        assert torch.equal(got, torch.cat(expected))
        assert fp8.dtype == torch.float8_e4m3fn and torch.equal(fp8.float(), torch.cat(expected).to(torch.float8_e4m3fn).float())
        assert gathered.shape == (0 + 1 + 2, 4)


def test_plan_placement_copies_hot_experts_and_balances_ranks():
    from deepinfer.parallel.eplb import Placement, plan_placement

    load = [100, 10, 10, 10, 10, 10, 10, 40]
    slots = plan_placement(load, num_slots=10, num_ranks=2)
    assert sorted(slots) == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]  # the hottest expert gets both spare slots
    per_rank = [slots[:5], slots[5:]]
    assert all(r.count(0) <= 2 for r in per_rank)
    loads = [sum(load[e] / slots.count(e) for e in r) for r in per_rank]
    assert max(loads) - min(loads) <= 10 + 1e-9
    placement = Placement(slots, 8, 2, torch.device("cpu"))
    picked = placement.pick(torch.zeros(6, 1, dtype=torch.int64), salt=0).view(-1).tolist()
    assert sorted(set(picked)) == [s for s, e in enumerate(slots) if e == 0]  # copies take turns


def test_plan_placement_without_load_is_round_robin_and_covers_every_expert():
    from deepinfer.parallel.eplb import plan_placement

    slots = plan_placement([0] * 8, num_slots=8, num_ranks=4)
    assert sorted(slots) == list(range(8))
    assert [sorted(slots[i:i + 2]) for i in range(0, 8, 2)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
