"""Shared helpers of the parallel tests; also imported by the spawned workers (functions passed to
`collective_rpc`): multiprocessing's spawn start method hands the children the parent's sys.path."""

from __future__ import annotations

PROMPTS = [[5, 17, 99, 3, 200, 41, 7, 8] * 3, [9, 10, 11], [300, 301, 302, 303, 304, 1, 2], [42] * 9]


def greedy_params(max_tokens: int = 6):
    from deepinfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, top_logprobs=3, prompt_logprobs=2, ignore_eos=True)


def run_llm(model_dir: str, prompts=PROMPTS, params=None, **parallel):
    from deepinfer import LLM

    llm = LLM(model_dir, max_num_seqs=4, max_num_batched_tokens=64, **parallel)
    try:
        return llm.generate(prompt_token_ids=prompts, sampling_params=params or greedy_params(), use_tqdm=False)
    finally:
        llm.close()


def assert_same_outputs(reference, outputs, tol: float = 1e-4) -> None:
    """Same greedy tokens; the same top logprobs (generated and prompt) within `tol` (default: fp32 noise)."""
    assert len(reference) == len(outputs)
    for ref, got in zip(reference, outputs):
        assert got.prompt_token_ids == ref.prompt_token_ids
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        pairs = list(zip(ref.outputs[0].logprobs, got.outputs[0].logprobs))
        if ref.prompt_logprobs is not None or got.prompt_logprobs is not None:
            pairs += list(zip(ref.prompt_logprobs[1:], got.prompt_logprobs[1:]))
        for a, b in pairs:
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) <= tol


# ---- run inside the workers through collective_rpc
def break_forward_on_rank1(worker):
    """Make rank 1's third model forward raise, in the middle of a generate."""
    if worker.rank.rank != 1:
        return None
    forward = worker.engine.model.forward
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected fault in rank 1's forward")
        return forward(*args, **kwargs)

    worker.engine.model.forward = failing
    return None


def worker_stats(worker):
    return worker.stats()

