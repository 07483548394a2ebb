"""EP, attention DP and EPLB on gloo: the outputs of one process, from 2 and 4 processes (DeepSeek-V4,
and DeepSeek-V3 for the two-rank layouts)."""

from __future__ import annotations

import pytest

from parallel_helpers import assert_same_outputs, greedy_params, run_llm, PROMPTS


@pytest.mark.parametrize("layout", [
    dict(expert_parallel_size=2),
    dict(expert_parallel_size=2, data_parallel_size=2),
    dict(data_parallel_size=2),
], ids=["ep2", "dp2-ep2", "dp2"])
def test_two_ranks_match_one_process(family_case, layout):
    path, reference = family_case
    assert_same_outputs(reference, run_llm(path, **layout))


@pytest.mark.parametrize("layout", [
    dict(expert_parallel_size=4),
    dict(expert_parallel_size=4, data_parallel_size=4),
], ids=["ep4", "dp4-ep4"])
def test_four_ranks_match_one_process(moe_model_dir, reference_outputs, layout):
    assert_same_outputs(reference_outputs, run_llm(moe_model_dir, **layout))


def test_eplb_rearrangement_mid_run_changes_nothing(moe_model_dir, reference_outputs):
    """Redundant copies of hot experts and a rearrangement every 2 steps (weights move between
    ranks mid-generate): the same tokens and logprobs as one process."""
    from deepinfer import LLM
    from deepinfer.parallel.eplb import plan_placement
    from parallel_helpers import worker_stats

    llm = LLM(moe_model_dir, max_num_seqs=4, max_num_batched_tokens=64, expert_parallel_size=2,
              data_parallel_size=2, num_redundant_experts=2, eplb_window_size=3, eplb_step_interval=2)
    try:
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy_params(), use_tqdm=False)
        stats = llm.parallel.collective_rpc(worker_stats)
        engine_stats = llm.stats()
    finally:
        llm.close()
    assert_same_outputs(reference_outputs, outputs)
    # LLM.stats() sums the two data-parallel groups: every prompt looked up in a prefix cache once
    assert engine_stats["prefix_cache_queries"] == len(PROMPTS) and engine_stats["num_preemptions"] == 0
    assert all(s["rearrangements"] >= 2 for s in stats)
    initial = plan_placement([0] * 8, 10, 2)
    assert any(p != initial for p in stats[0]["placements"]), "load never moved an expert"
    for placement in stats[0]["placements"]:  # 10 slots: every expert once, two hot ones twice
        assert sorted(set(placement)) == list(range(8)) and len(placement) == 10


def test_idle_data_parallel_rank_still_serves_its_experts(moe_model_dir, reference_outputs):
    """One prompt, two DP ranks: rank 1 owns no request and runs empty batches through the
    expert collectives for every step of rank 0's request."""
    from deepinfer import LLM
    from parallel_helpers import worker_stats

    llm = LLM(moe_model_dir, max_num_seqs=4, max_num_batched_tokens=64, expert_parallel_size=2, data_parallel_size=2)
    try:
        outputs = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=greedy_params(), use_tqdm=False)
        stats = llm.parallel.collective_rpc(worker_stats)
    finally:
        llm.close()
    assert_same_outputs(reference_outputs[:1], outputs)
    assert stats[0]["forwards"] > 0 and stats[1]["forwards"] == 0 and stats[1]["steps"] == stats[0]["steps"]


def test_seeded_sampling_matches_one_process(moe_model_dir):
    """Replicated attention samples on every rank: the same seed must give every rank (and one
    process) the same tokens."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, seq_seed=1234, ignore_eos=True)
    reference = run_llm(moe_model_dir, PROMPTS[:2], params)
    outputs = run_llm(moe_model_dir, PROMPTS[:2], params, expert_parallel_size=2)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]



def test_quantized_experts_shard_and_move_as_stored(tmp_path):
    """A checkpoint stored as V4-Flash stores it (FP4 experts, FP8 dense): EP2 x DP2 with EPLB moving
    the packed FP4 bytes and their scales between ranks mid-run gives one process's outputs."""
    from deepinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
    from deepinfer.models.deepseek_v4.weights import checkpoint_source
    from quant_checks import flash_layout, save_upstream
    from tiny_models import make_hf_model

    hf, hfc = make_hf_model("mixed_hc4_yarn", seed=11)
    cfg = DeepseekV4Config.from_dict(hfc.to_dict())
    hfc.save_pretrained(tmp_path)
    save_upstream(flash_layout(hf.state_dict(), DeepseekV4Model.checkpoint_tensors(cfg)), tmp_path, checkpoint_source)
    reference = run_llm(str(tmp_path))
    assert_same_outputs(reference, run_llm(str(tmp_path), expert_parallel_size=2, data_parallel_size=2,
                                           num_redundant_experts=2, eplb_window_size=3, eplb_step_interval=2))
