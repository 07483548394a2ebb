"""The tiny DeepSeek-V4.1 vision checkpoint (tests/goldens/v41/mini6vl) and its goldens, for the tests of
deepinfer's image input on every backend: its vision config, the golden images, a VisionEncoder on a given
accelerator, and the comparison with the reference's outputs within its own noise."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from deepinfer.models.deepseek_v41.image_processor import ProcessedImage, process_image
from deepinfer.models.deepseek_v41.vision import VisionEncoder, checkpoint_tensors
from deepinfer.models.deepseek_v41.vision_config import VisionConfig
from v41_goldens import VL_CONFIG, checkpoint_dir, load, ulp_error, vision_tolerance

VL_DIR = checkpoint_dir(VL_CONFIG)
IMAGES = (0, 1)


def vl_config() -> VisionConfig:
    data = json.loads((VL_DIR / "config.json").read_text())
    return VisionConfig.from_dict(data, data["text_config"]["hidden_size"])


def png(j: int) -> bytes:
    return load("vision")[f"image{j}.png"].numpy().tobytes()


def stored_tensors() -> dict[str, torch.Tensor]:
    return load_file(VL_DIR / "model-vision.safetensors")


def encoder(accel) -> VisionEncoder:
    """The checkpoint's vision tower on `accel` (weights as the loader gives them: float32)."""
    cfg, stored = vl_config(), stored_tensors()
    specs = checkpoint_tensors(cfg)
    weights = {name: stored[name].float() for name in specs}
    assert {n: tuple(w.shape) for n, w in weights.items()} == {n: s.shape for n, s in specs.items()}
    return VisionEncoder(cfg, weights, accel)


def assert_within_noise(out: torch.Tensor, expected: torch.Tensor, key: str) -> None:
    """ulp_error (bf16 ulps) of `out` against the golden within vision_tolerance(key): twice the
    reference's own worst noise probe on that tensor (max, p99.9, mean)."""
    err = ulp_error(out.cpu(), expected)
    tol = vision_tolerance(key)
    got = {"max": err.max().item(), "p999": err.quantile(0.999).item(), "mean": err.mean().item()}
    print(f"\n{key}: bf16 ulps {got} (tolerance {tol})", end="")
    for m in ("max", "p999", "mean"):
        assert got[m] <= tol[m], f"{key}: {m} {got[m]:.3f} bf16 ulps > {tol[m]:.3f} (twice the reference's own noise)"


def check_image(enc: VisionEncoder, j: int) -> tuple[ProcessedImage, torch.Tensor]:
    """Golden image j through `enc`: its ViT features and aligner rows each within the reference's
    noise. Returns (the processed image, the aligner rows)."""
    g = load("vision")
    image = process_image(png(j), vl_config())
    feats = enc.features([image.patches], [image.grid])
    assert_within_noise(feats, g[f"image{j}.vit"], f"image{j}.vit")
    (rows,) = enc.align(feats, [image.grid])
    assert_within_noise(rows, g[f"image{j}.aligner"], f"image{j}.aligner")
    return image, rows
