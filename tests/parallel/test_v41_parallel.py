"""DeepSeek-V4.1 under expert, data and context parallelism (gloo): the outputs of one process. The routed
experts of V4.1 take their routing weight inside (before the FP8 quantization of the w2 input), so rows
travel to the expert ranks with their weights. Under context parallelism each rank computes its share of
a step's rows; window keys, compressor inputs and ratio-1 latents of every row are gathered so every rank
writes the same cache, Engram hashes every token on every rank, and the CED decoder layers run on each
rank's share of the tails."""

from __future__ import annotations

import pytest
import torch

from parallel_helpers import assert_same_outputs, greedy_params, run_llm, worker_stats
from v41_goldens import checkpoint_dir


@pytest.fixture(scope="module")
def reference():
    return run_llm(str(checkpoint_dir("ced10")))


@pytest.mark.parametrize("layout", [dict(expert_parallel_size=2), dict(data_parallel_size=2)], ids=["ep2", "dp2"])
def test_two_ranks_match_one_process(reference, layout):
    assert_same_outputs(reference, run_llm(str(checkpoint_dir("ced10")), **layout))


def long_prompts() -> list[list[int]]:
    """Prompts across many windows (16), ratio-2 pairs and Engram n-grams, beside a short one."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (300,), generator=g).tolist(), torch.randint(3, 512, (150,), generator=g).tolist(),
            [7, 8, 9]]


def run_with_stats(prompts, params, max_num_batched_tokens: int, then=None, **layout):
    """Outputs of `prompts` (then of `then`, served after them: prefix-cache hits) and per-rank stats."""
    from deepinfer import LLM

    llm = LLM(str(checkpoint_dir("ced10")), max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, **layout)
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        if then is not None:
            outputs = llm.generate(prompt_token_ids=then, sampling_params=params, use_tqdm=False)
        stats = llm.parallel.collective_rpc(worker_stats) if llm.parallel is not None else None
        hits = llm.stats().get("prefix_cache_hits")
    finally:
        llm.close()
    return outputs, stats, hits


def no_prompt_logprobs(max_tokens: int):
    from deepinfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, top_logprobs=3, ignore_eos=True)


# chunked: 64-token prefill chunks in balanced pieces beside decode rows (mixed batches), prompt logprobs
# (whole sequences through every layer); the short prompt's last decode steps (it alone) leave a rank with
# no rows, which still writes every cache and, under expert parallelism, serves the other's experts.
# ced: the 300- and 150-token prompts in one step each, no prompt logprobs: the CED split runs the
# decoder layers on each prompt's last 140 rows, each rank on its share of them.
# prefix: then the long prompts extended by 20 tokens, which hit the prefix cache (their first 256
# tokens' compressed pages) and replay the window tail.
CASES = {"chunked": (lambda: [greedy_params(8), greedy_params(8), greedy_params(14)], 64, None),
         "ced": (lambda: no_prompt_logprobs(8), 512, None),
         "prefix": (lambda: no_prompt_logprobs(8), 64, lambda p: [q + list(range(30, 50)) for q in p[:2]])}
_REFERENCES: dict[str, list] = {}  # case -> its single-process outputs


@pytest.mark.parametrize("case, layout", [("chunked", dict(context_parallel_size=2)),
                                          ("ced", dict(context_parallel_size=2)),
                                          ("chunked", dict(context_parallel_size=2, expert_parallel_size=2)),
                                          ("prefix", dict(context_parallel_size=2))],
                         ids=["cp2-chunked", "cp2-ced-tail", "cp2-ep2-chunked", "cp2-prefix-hit"])
def test_cp2_matches_one_process(case, layout):
    params, tokens, then = CASES[case]
    then = then(long_prompts()) if then is not None else None
    if case not in _REFERENCES:
        _REFERENCES[case] = run_with_stats(long_prompts(), params(), tokens, then)[0]
    outputs, stats, hits = run_with_stats(long_prompts(), params(), tokens, then, **layout)
    if then is not None:
        assert hits  # the extended prompts reused cached pages
    # bit-identical: every row computes the same ops on the same inputs as in one process (the cpu ops
    # compute a row independently of the rows beside it), and the gathered keys are the ones computed
    assert_same_outputs(_REFERENCES[case], outputs, tol=0.0)
    own = [s["cp_rows"]["own"] for s in stats]
    assert sum(own) == stats[0]["cp_rows"]["step"]  # every token computed exactly once
    assert min(own) > 0.4 * sum(own)  # and the work is split, not done by one rank


def test_images_under_context_parallelism_are_refused():
    """Images stay single-process under every parallel layout (each rank would run the vision encoder,
    and image rows under CP are untested): a clear error, and the engine keeps serving text."""
    from deepinfer import LLM

    from v41_goldens import vision_pngs

    llm = LLM(str(checkpoint_dir("mini6vl")), max_num_seqs=2, max_num_batched_tokens=256, context_parallel_size=2)
    try:
        with pytest.raises(ValueError, match="multi_modal_data is not supported with parallel layouts.*one process"):
            llm.generate([{"prompt": "a <image> b", "multi_modal_data": {"image": vision_pngs()[0]}}], use_tqdm=False)
        assert llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=no_prompt_logprobs(2),
                            use_tqdm=False)[0].outputs[0].token_ids  # and text still runs
    finally:
        llm.close()
