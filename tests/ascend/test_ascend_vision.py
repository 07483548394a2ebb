"""DeepSeek-V4.1's vision encoder (ViT + aligner) on the ascend backend (torch_npu shim + the Triton
interpreter): on the golden tall image (65 patches; the wide one costs ~30 s more interpreted and adds nothing the
cpu test does not check) it is held to the bound the cpu backend is held to against DeepSeek's
reference, twice the reference's own bf16 noise. Measured (bf16 ulps, max / mean): ViT 5.25 / 0.82 (bound
13 / 2.3), aligner 3.0 / 0.51 (bound 5.3 / 1.2)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed: the ascend backend's Triton kernels cannot run")

from deepinfer.backends import get_accelerator  # noqa: E402
from deepinfer.models.deepseek_v41.image_processor import process_image  # noqa: E402
from v41_goldens import load  # noqa: E402
from v41_vision import assert_within_noise, encoder, png, vl_config  # noqa: E402


def test_vision_encoder_matches_the_reference():
    g = load("vision")
    enc = encoder(get_accelerator("ascend"))
    image = process_image(png(1), vl_config())
    feats = enc.features([image.patches], [image.grid])
    assert_within_noise(feats, g["image1.vit"], "image1.vit")
    (rows,) = enc.align(feats, [image.grid])
    assert_within_noise(rows, g["image1.aligner"], "image1.aligner")
