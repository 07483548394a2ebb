"""Context parallelism: long prefills split over 2 ranks in balanced chunks give the outputs of
one process, and decode afterwards reads the window and compressed state (V4) or the latent pages
(V3) they built."""

from __future__ import annotations

import pytest
import torch

from parallel_helpers import assert_same_outputs, greedy_params, run_llm, worker_stats


def test_balanced_chunks_give_every_rank_early_and_late_tokens():
    from deepinfer.parallel.context_parallel import balanced_owner

    assert balanced_owner([8], 2) == [0, 0, 1, 1, 1, 1, 0, 0]
    assert balanced_owner([10, 1, 1, 3], 2) == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0] + [1] + [0] + [1, 1, 1]
    owner = balanced_owner([1000], 4)
    causal_work = [sum(t + 1 for t, r in enumerate(owner) if r == rank) for rank in range(4)]
    assert max(causal_work) / min(causal_work) < 1.01


@pytest.fixture(scope="module")
def long_prompts():
    """Prompts that cross the sliding window (32), many CSA windows (4) and HCA windows (64),
    prefilled in chunks of 64 tokens, beside a short one."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 512, (300,), generator=g).tolist(), torch.randint(2, 512, (150,), generator=g).tolist(),
            [7, 8, 9]]


_REFERENCES: dict[str, list] = {}  # model dir -> its single-process outputs of long_prompts


@pytest.mark.parametrize("family, layout", [
    ("v4", dict(context_parallel_size=2)), ("v4", dict(context_parallel_size=2, expert_parallel_size=2)),
    ("v3", dict(context_parallel_size=2)),
], ids=["v4-cp2", "v4-cp2-ep2", "v3-cp2"])
def test_cp2_matches_one_process(request, long_prompts, family, layout):
    from deepinfer import LLM

    path = request.getfixturevalue("moe_model_dir" if family == "v4" else "v3_model_dir")
    if path not in _REFERENCES:
        _REFERENCES[path] = run_llm(path, long_prompts, greedy_params(8))
    long_reference = _REFERENCES[path]
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=64, **layout)
    try:
        outputs = llm.generate(prompt_token_ids=long_prompts, sampling_params=greedy_params(8), use_tqdm=False)
        stats = llm.parallel.collective_rpc(worker_stats)
    finally:
        llm.close()
    assert_same_outputs(long_reference, outputs)
    own = [s["cp_rows"]["own"] for s in stats]
    assert sum(own) == stats[0]["cp_rows"]["step"]  # every token computed exactly once
    assert min(own) > 0.4 * sum(own)  # and the work is split, not done by one rank
