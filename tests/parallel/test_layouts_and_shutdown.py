"""Impossible layouts fail before any process starts; a failing worker fails generate and
leaves no process behind."""

from __future__ import annotations

import os
import time

import pytest

from parallel_helpers import PROMPTS, greedy_params


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead but not yet reaped
        return f.read().split(")")[-1].split()[0] == "Z"


@pytest.mark.parametrize("layout, message", [
    (dict(expert_parallel_size=3), "cannot be split evenly over expert_parallel_size=3"),
    (dict(expert_parallel_size=2, num_redundant_experts=1), "9 slots|= 9"),
    (dict(expert_parallel_size=4, data_parallel_size=2), "must equal data_parallel_size"),
    (dict(data_parallel_size=2, num_redundant_experts=2), "needs expert_parallel_size > 1"),
    (dict(expert_parallel_size=2, eplb_step_interval=4), "eplb_window_size is 0"),
    (dict(expert_parallel_size=0), "expert_parallel_size must be an int >= 1"),
])
def test_impossible_layouts_are_clear_errors(moe_model_dir, layout, message):
    from deepinfer import LLM
    from deepinfer.parallel import LayoutError

    with pytest.raises(LayoutError, match=message):
        LLM(moe_model_dir, **layout)


def test_torchrun_world_size_must_match_the_layout(moe_model_dir, monkeypatch):
    from deepinfer import LLM

    for key, value in dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .* needs 2"):
        LLM(moe_model_dir, expert_parallel_size=2)


def test_bad_request_raises_and_workers_stay_usable(moe_model_dir):
    from deepinfer import LLM

    llm = LLM(moe_model_dir, max_num_seqs=4, max_num_batched_tokens=64, expert_parallel_size=2, data_parallel_size=2)
    try:
        with pytest.raises(ValueError, match="outside"):
            llm.generate(prompt_token_ids=[[1, 2], [10**6]], sampling_params=greedy_params(), use_tqdm=False)
        out = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=greedy_params(2), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]
    finally:
        llm.close()


def test_worker_that_raises_fails_generate_and_leaves_no_process(moe_model_dir):
    from deepinfer import LLM
    from deepinfer.parallel import WorkerError
    from parallel_helpers import break_forward_on_rank1

    llm = LLM(moe_model_dir, max_num_seqs=4, max_num_batched_tokens=64, expert_parallel_size=2, data_parallel_size=2)
    pids = llm.parallel.workers.pids
    llm.parallel.collective_rpc(break_forward_on_rank1)
    with pytest.raises(WorkerError, match="(?s)rank 1 failed.*injected fault in rank 1's forward.*stopped"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy_params(), use_tqdm=False)
    assert all(_gone(pid) for pid in pids)  # rank 0 was blocked in a collective: terminated, not orphaned
    with pytest.raises(WorkerError, match="were stopped"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy_params(), use_tqdm=False)


def test_killed_worker_fails_generate_and_close_reaps_all(moe_model_dir):
    import signal
    import threading

    from deepinfer import LLM
    from deepinfer.parallel import WorkerError

    llm = LLM(moe_model_dir, max_num_seqs=4, max_num_batched_tokens=64, expert_parallel_size=2)
    pids = llm.parallel.workers.pids
    threading.Timer(0.3, os.kill, (pids[0], signal.SIGKILL)).start()
    with pytest.raises(WorkerError, match="rank 0 .* was killed by SIGKILL"):
        llm.generate(prompt_token_ids=PROMPTS * 8, sampling_params=greedy_params(200), use_tqdm=False)
    assert all(_gone(pid) for pid in pids)


def test_close_stops_every_worker(moe_model_dir):
    from deepinfer import LLM

    llm = LLM(moe_model_dir, expert_parallel_size=2)
    pids = llm.parallel.workers.pids
    llm.close()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids)


def test_workers_exit_when_the_driver_is_killed(moe_model_dir):
    import signal
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    script = ("import sys, time\nfrom deepinfer import LLM\n"
              f"llm = LLM({moe_model_dir!r}, expert_parallel_size=2)\n"
              "print(llm.parallel.workers._store_dir, *llm.parallel.workers.pids, flush=True)\ntime.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(here)),
                                                         os.environ.get("PYTHONPATH", "")]))
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        store_dir, *pids = driver.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and os.path.isdir(store_dir)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 15
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(pid) for pid in pids), "workers outlived their driver"
    assert not os.path.exists(store_dir), "the killed driver's rendezvous directory was left behind"
