"""Driving the ranks from `LLM`: spawned worker processes, or this process as a torchrun rank.

Spawned (the default on one machine): the user's process is a driver, not a rank. It holds no
weights and sends each call to every worker over a pipe. Keeping it out of the group means a
worker that raises or dies never leaves the user's thread blocked inside a collective: the
driver sees the error or the dead process, terminates every worker and raises `WorkerError`.
The group rendezvous is a file store in a private temp dir, so concurrent runs never fight
over a TCP port. Workers watch the driver and exit if it disappears.

torchrun: every process runs the user's script; this one joins the group from RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT and is itself a rank. `generate` runs this rank's share
and all-gathers the outputs, so every rank returns the full list.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from deepinfer import envs
from deepinfer.parallel import group
from deepinfer.parallel.worker import RankWorker, RequestRejected, WorkerArgs, bind_device


class WorkerError(RuntimeError):
    """A worker process raised or died; all workers have been stopped."""


def _with_seeds(params: list) -> list:
    """Draw the random seeds here, once: every rank that samples a request must use the same one."""
    return [p if p.seq_seed is not None else dataclasses.replace(p, seq_seed=random.getrandbits(64))
            for p in params]


# ------------------------------------------------------------------ worker process
def _driver_lost(store_dir: str) -> None:
    """The driver died without its own cleanup (SIGKILL, say): its rendezvous directory goes with
    the workers, or every such death would leave one behind in the temp dir."""
    shutil.rmtree(store_dir, ignore_errors=True)


def _watch_parent(parent_pid: int, store_dir: str) -> None:
    """Exit when the driver is gone (even if this process is blocked in a collective)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            _driver_lost(store_dir)
            os._exit(1)


def join_group(rank: int, world_size: int, init_method: str, args: WorkerArgs) -> RankWorker:
    """A spawned rank's start: watch the parent (exit when it is gone), bind the device, join the
    group and build the rank's worker. Used by the generate workers and the serving ranks."""
    store_dir = os.path.dirname(init_method.removeprefix("file://"))
    threading.Thread(target=_watch_parent, args=(os.getppid(), store_dir), daemon=True).start()
    bind_device(rank)
    from deepinfer.backends import get_accelerator

    me = group.init_group(get_accelerator(args.accelerator).dist_backend, rank, world_size, init_method)
    return RankWorker(args, me)


def _worker_main(conn, rank: int, world_size: int, init_method: str, args: WorkerArgs) -> None:
    store_dir = os.path.dirname(init_method.removeprefix("file://"))
    try:
        worker = join_group(rank, world_size, init_method, args)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    while True:
        try:
            method, payload = conn.recv()
        except (EOFError, OSError):  # the driver's end closed without a "stop": it is gone
            _driver_lost(store_dir)
            break
        if method == "stop":
            break
        try:
            result = worker.generate(*payload) if method == "generate" else payload(worker)
        except RequestRejected as exc:
            try:
                conn.send(("rejected", exc.error))
            except Exception:  # an exception type that does not pickle: keep its message
                conn.send(("rejected", ValueError(str(exc.error))))
            continue
        except BaseException:
            conn.send(("fatal", traceback.format_exc()))
            return
        conn.send(("ok", result))
    group.destroy_group()


def how_it_ended(exitcode: int) -> str:
    """'was killed by SIGKILL' / 'exited with code 1' for a process's exit status."""
    return f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}"


class SpawnedWorkers:
    """world_size worker processes on this machine (torch.multiprocessing, spawn)."""

    def __init__(self, args: WorkerArgs, world_size: int, start_timeout_s: float = 600.0):
        ctx = torch.multiprocessing.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="deepinfer-group-")
        init_method = f"file://{os.path.join(self._store_dir, 'store')}"
        self.conns, self.procs = [], []
        self.closed = False
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, rank, world_size, init_method, args),
                               name=f"deepinfer-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs, self._store_dir)
        self._gather(start_timeout_s, "starting")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, method: str, payload, timeout_s: float | None = None) -> list:
        """Run `method` on every worker; one result per rank, in rank order."""
        if self.closed:
            raise WorkerError("the parallel workers were stopped (after an error, or close()); create a new LLM")
        for conn in self.conns:
            conn.send((method, payload))
        return self._gather(timeout_s, method)

    def _gather(self, timeout_s: float | None, what: str) -> list:
        results: dict[int, object] = {}
        rejected = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = set(range(len(self.procs)))
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], left)
            if not ready:
                self._fail(f"workers {sorted(pending)} did not answer within {timeout_s:.0f} s while {what}")
            for r in sorted(pending):
                conn, proc = self.conns[r], self.procs[r]
                if conn in ready or conn.poll():
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):  # it died: say how
                        dead = self._dead_workers(grace_s=1.0) or [f"worker rank {r} closed its pipe"]
                        self._fail("\n".join(dead) + f" while {what}")
                    if status == "fatal":
                        # a peer that died makes the others fail in their collectives: name it first
                        dead = self._dead_workers(grace_s=0.5)
                        self._fail("".join(d + "\n" for d in dead) + f"worker rank {r} failed while {what}:\n{value}")
                    if status == "rejected":
                        rejected = value
                    results[r] = value
                    pending.discard(r)
                elif proc.sentinel in ready:
                    self._fail("\n".join(self._dead_workers(grace_s=0.0)) + f" while {what}")
        if rejected is not None:
            raise rejected
        return [results[r] for r in range(len(self.procs))]

    def _dead_workers(self, grace_s: float) -> list[str]:
        """One line per worker process that died (waiting up to grace_s for one to). A worker that
        reported its own exception exits cleanly and is not listed."""
        exited = wait([p.sentinel for p in self.procs], grace_s)
        lines = []
        for r, proc in enumerate(self.procs):
            if proc.sentinel in exited:
                proc.join()  # the sentinel closes a moment before the exit status is ready
                if proc.exitcode == 0:
                    continue
                lines.append(f"worker rank {r} (pid {proc.pid}) {how_it_ended(proc.exitcode)}")
        return lines

    def _fail(self, message: str):
        self.close()
        raise WorkerError(message + "\nall deepinfer workers have been stopped")

    def close(self) -> None:
        self.closed = True
        self._finalizer()


def _stop(conns, procs, store_dir: str) -> None:
    """Ask workers to leave, then terminate and kill whatever is still alive; wait for all."""
    for conn, proc in zip(conns, procs):
        if proc.is_alive():
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)


class ParallelExecutor:
    """What `LLM` holds when any parallel size exceeds 1."""

    def __init__(self, args: WorkerArgs):
        self.parallel = args.parallel
        world = self.parallel.world_size
        if group.launched_by_torchrun():
            started = envs.torchrun_rank()[1]
            if started != world:
                raise ValueError(
                    f"torchrun started WORLD_SIZE={started} processes but the layout "
                    f"(expert_parallel_size={self.parallel.expert_parallel_size}, data_parallel_size="
                    f"{self.parallel.data_parallel_size}, context_parallel_size={self.parallel.context_parallel_size})"
                    f" needs {world}: run torchrun --nproc-per-node/--nnodes for {world} processes")
            bind_device(envs.torchrun_local_rank())
            from deepinfer.backends import get_accelerator

            me = group.init_group(get_accelerator(args.accelerator).dist_backend)
            self.local = RankWorker(args, me)
            self.workers = None
        else:
            self.local = None
            self.workers = SpawnedWorkers(args, world)

    def generate(self, token_lists, params, texts) -> list:
        if self.workers is not None:
            parts = self.workers.call("generate", (token_lists, _with_seeds(params), texts))
        else:
            shared = [_with_seeds(params) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(shared, src=0)
            try:
                mine = self.local.generate(token_lists, shared[0], texts)
            except RequestRejected as exc:
                raise exc.error from None
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        merged = {i: out for part in parts for i, out in part.items()}
        return [merged[i] for i in range(len(token_lists))]

    def collective_rpc(self, fn) -> list:
        """fn(worker) on every rank (a picklable, importable function); one result per rank."""
        if self.workers is not None:
            return self.workers.call("rpc", fn)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, fn(self.local))
        return parts

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        else:
            group.destroy_group()
