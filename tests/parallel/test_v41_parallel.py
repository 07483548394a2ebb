"""DeepSeek-V4.1 under expert and data parallelism (gloo): the outputs of one process. The routed experts
of V4.1 take their routing weight inside (before the FP8 quantization of the w2 input), so rows travel
to the expert ranks with their weights; context parallelism is refused with a clear error."""

from __future__ import annotations

import pytest

from parallel_helpers import assert_same_outputs, run_llm
from v41_goldens import checkpoint_dir


@pytest.fixture(scope="module")
def reference():
    return run_llm(str(checkpoint_dir("ced10")))


@pytest.mark.parametrize("layout", [dict(expert_parallel_size=2), dict(data_parallel_size=2)], ids=["ep2", "dp2"])
def test_two_ranks_match_one_process(reference, layout):
    assert_same_outputs(reference, run_llm(str(checkpoint_dir("ced10")), **layout))


def test_context_parallelism_is_refused():
    with pytest.raises(Exception, match="context parallelism is not supported for DeepSeek-V4.1"):
        run_llm(str(checkpoint_dir("ced10")), context_parallel_size=2)
