"""DeepSeek-V4.1 on the ascend backend (the torch_npu shim and its Triton kernels through the Triton
interpreter; no real torch_npu or AscendC here) against DeepSeek's reference: a golden prompt's prefill, then decode
steps, within the cpu backend's level-3 bound (tests/oracle/test_v41_e2e.py: `e2e_tolerance`, twice
the reference's own noise). Slow: the interpreter runs a tiny V4.1 forward in ~25 s."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed: the ascend backend's Triton kernels cannot run")

from v41_goldens import CONFIGS  # noqa: E402
from v41_models import check_split_decode  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_v41_prefill_then_decode_matches_the_reference(config):
    check_split_decode(config, "ascend")
