"""DeepSeek-V4.1's vision encoder (ViT + aligner) on the ascend backend (torch_npu shim + the Triton
interpreter): on the golden tall image (65 patches; the wide one costs ~30 s more interpreted and adds nothing the
cpu test does not check) it is held to the bound the cpu backend is held to against DeepSeek's
reference, twice the reference's own bf16 noise. Measured (bf16 ulps, max / mean): ViT 5.25 / 0.82 (bound
13 / 2.3), aligner 3.0 / 0.51 (bound 5.3 / 1.2)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed: the ascend backend's Triton kernels cannot run")

from deepinfer.backends import get_accelerator  # noqa: E402
from v41_vision import check_image, encoder  # noqa: E402


def test_vision_encoder_matches_the_reference():
    check_image(encoder(get_accelerator("ascend")), 1)
