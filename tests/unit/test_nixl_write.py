"""NixlWrite's polling (kv/transfer.py), on a stand-in for NIXL's agent that answers "PROC" a given
number of times: a short wait leaves a running write running (the engine thread hands it to a
thread), a long one sees it done, and a failed or overdue write raises TransferError and drops the
peer's metadata (the next write fetches it again)."""

from __future__ import annotations

import time

import pytest

from deepinfer.kv.transfer import NixlWrite, TransferError


class _Agent:
    def __init__(self, states: list[str]):
        self.states, self.released, self.forgotten, self.polls = list(states), [], 0, []

    def check_xfer_state(self, handle) -> str:
        self.polls.append(time.monotonic())
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def release_xfer_handle(self, handle) -> None:
        self.released.append(handle)


def _write(states: list[str], timeout: float = 5.0) -> tuple[NixlWrite, _Agent]:
    agent = _Agent(states)

    def forget():
        agent.forgotten += 1
    return NixlWrite(agent, forget, "handle", "PROC", "a write", time.monotonic() + timeout), agent


def test_a_short_wait_leaves_a_running_write_and_a_long_one_sees_it_done():
    write, agent = _write(["PROC"] * 50 + ["DONE"])
    assert write.wait(0) is False and not agent.released
    assert write.wait(float("inf")) is True
    assert agent.released == ["handle"] and agent.forgotten == 0


@pytest.mark.parametrize("states, timeout, says", [(["PROC", "ERR"], 5.0, "failed"), (["PROC"], 0.05, "timed out")],
                         ids=["failed", "overdue"])
def test_a_failed_or_overdue_write_raises_and_forgets_the_peer(states, timeout, says):
    write, agent = _write(states, timeout)
    with pytest.raises(TransferError, match=says):
        write.wait(float("inf"))
    assert agent.released == ["handle"] and agent.forgotten == 1


def test_a_slow_write_is_polled_apart_not_in_a_spin():
    """Past SPIN_S the polls sleep POLL_S apart: a thread finishing a slow write leaves the GIL to
    the engine thread most of the time."""
    write, agent = _write(["PROC"])
    start = time.monotonic()
    assert write.wait(0.05) is False
    late = [t for t in agent.polls if t - start > 2 * NixlWrite.SPIN_S]
    assert len(late) > 10 and (late[-1] - late[0]) / (len(late) - 1) >= NixlWrite.POLL_S
