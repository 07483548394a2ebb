"""DSpark's verify-length policy and acceptance rule, on hand-made inputs."""

from __future__ import annotations

import torch

from deepinfer.backends.cpu import CpuAccelerator
from deepinfer.core.speculative.accept import Block, accept
from deepinfer.core.speculative.planner import StepCost, VerifyLengthPlanner


def test_step_cost_interpolates_between_profiled_points():
    cost = StepCost([1, 4, 8], [1.0, 2.0, 4.0])
    assert cost(1) == 1.0 and cost(0) == 1.0
    assert cost(2) == 1.0 + 1 / 3 and cost(6) == 3.0 and cost(8) == 4.0
    assert cost(20) == 4.0 + 0.5 * 12  # past the last point: the last segment's slope


def test_fixed_length_is_the_cap():
    planner = VerifyLengthPlanner(5, None)
    assert planner.lengths(["a", "b"], torch.zeros(2, 5), [5, 2]) == [5, 2]


def test_dynamic_budget_spends_drafts_where_they_pay():
    free = VerifyLengthPlanner(5, StepCost([1, 64], [1.0, 1.0]))  # extra tokens cost nothing: verify everything
    assert free.lengths(["a", "b"], torch.full((2, 5), 0.01), [5, 3]) == [5, 3]
    # a token costs half a one-token step: a draft pays only while it raises tokens per second
    steep = VerifyLengthPlanner(5, StepCost([1, 65], [1.0, 33.0]))
    survival = torch.tensor([[0.99, 0.98, 0.97, 0.5, 0.1], [0.3, 0.1, 0.05, 0.01, 0.0]])
    first = steep.lengths(["a", "b"], survival, [5, 5])  # new requests: lagged survival 1.0 -> full budget
    assert sum(first) == 10 and first == [5, 5]
    lengths = steep.lengths(["a", "b"], survival, [5, 5])  # now the lagged values are these survivals
    assert lengths == [3, 0]  # (2 + .99 + .98 + .97) / cost(5) is the best rate
    steep.forget("a")
    assert "a" not in steep.lagged


def test_dynamic_lengths_are_prefixes_of_current_survival():
    planner = VerifyLengthPlanner(5, StepCost([1, 8, 64], [1.0, 1.5, 30.0]))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        conf = torch.rand(6, 5, generator=gen)
        survival = torch.cumprod(conf, dim=1)
        caps = torch.randint(0, 6, (6,), generator=gen).tolist()
        ids = [str(i) for i in range(6)]
        lengths = planner.lengths(ids, survival, caps)
        assert all(0 <= n <= c for n, c in zip(lengths, caps))
        chosen = [survival[r, j].item() for r, n in enumerate(lengths) for j in range(n)]
        left = [survival[r, j].item() for r, (n, c) in enumerate(zip(lengths, caps)) for j in range(n, c)]
        assert not chosen or not left or min(chosen) >= max(left)  # the top of the current survivals


def _block(target, drafts, temperature=0.0, draft_logprobs=None):
    return Block(target, drafts, draft_logprobs, temperature, 0, 1.0, torch.tensor(7), 10)


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    target = torch.zeros(4, 16)
    for row, tok in enumerate([5, 6, 9, 2]):
        target[row, tok] = 1.0
    accel = CpuAccelerator()
    assert accept(accel, [_block(target, [5, 6, 7])]) == [[5, 6, 9]]
    assert accept(accel, [_block(target, [5, 6, 9])]) == [[5, 6, 9, 2]]  # all accepted + bonus
    assert accept(accel, [_block(target[:1], [])]) == [[5]]


def test_sampled_draft_from_the_target_distribution_is_always_accepted():
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(4, 16, generator=gen)
    logp = target.log_softmax(-1)
    drafts = [3, 11, 0]
    out = accept(CpuAccelerator(), [_block(target, drafts, 1.0, logp[:3])])
    assert out[0][:3] == drafts and len(out[0]) == 4
    # a draft the target gives (almost) no mass is rejected and replaced
    target[0, 3] = -1e9
    out = accept(CpuAccelerator(), [_block(target, drafts, 1.0, logp[:3])])
    assert len(out[0]) == 1 and out[0][0] != 3


def test_zero_budget_is_known_before_drafting():
    """Drafts that do not pay give a budget of 0 from the lagged survivals alone, so the step can
    skip the drafter; a request the planner has not seen yet counts as sure (1.0)."""
    planner = VerifyLengthPlanner(5, StepCost([1, 65], [1.0, 33.0], [1, 8], [0.5, 0.5]))
    assert planner.budget(["a"], [5]) == 5
    planner.lengths(["a"], torch.full((1, 5), 0.05), [5])
    assert planner.budget(["a"], [5]) == 0
    assert planner.budget(["a", "new"], [5, 5]) > 0


def test_measured_step_times_correct_the_profile():
    """Drafting steps that measure 5x their profiled cost stop paying; plain steps that measure
    slower than profiled make drafting pay again."""
    cost = StepCost([1, 8], [1.0, 1.4], [1, 8], [0.2, 0.2])
    planner = VerifyLengthPlanner(5, cost)
    planner.lengths(["a"], torch.full((1, 5), 0.9), [5])
    assert planner.budget(["a"], [5]) == 5  # (1 + 4.5) / (1.29 + 0.2) per second beats 1 / 1.0
    for _ in range(40):
        planner.observe_step(True, 6, 1, 5 * (cost(6) + cost.drafter(1)))
    assert planner.draft_scale > 4.5 and planner.budget(["a"], [5]) == 0  # 5.5 / 7.4 < 1 / 1.0
    for _ in range(40):
        planner.observe_step(False, 1, 1, 4 * cost(1))
    assert planner.plain_scale > 3.5 and planner.budget(["a"], [5]) == 5
    planner.observe_step(False, 0, 0, 1.0)  # nothing decoded: ignored
    assert VerifyLengthPlanner(5, None).budget(["a"], [5]) == 5  # fixed length: no corrections


def test_accepted_drafts_calibrate_the_confidences():
    """A drafter whose confidences promise 0.9 per draft but whose drafts are rejected stops drafting."""
    planner = VerifyLengthPlanner(5, StepCost([1, 8], [1.0, 1.4], [1, 8], [0.2, 0.2]))
    planner.lengths(["a"], torch.full((1, 5), 0.9), [5])
    assert planner.budget(["a"], [5]) == 5
    for _ in range(60):
        planner.observe_acceptance(predicted=4.5, accepted=0)
    assert planner.acceptance_scale < 0.1 and planner.budget(["a"], [5]) == 0
