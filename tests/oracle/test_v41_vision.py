"""deepinfer's DeepSeek-V4.1 image input against DeepSeek's reference, through the goldens
(tests/goldens/v41: vision.safetensors / vision.json, the mini6vl checkpoint; README "Image input"):
grid plans and span layouts exactly, patches bit for bit, the prompt's expansion exactly, and the vision
encoder (ViT + aligner, on the cpu backend) within twice the reference's own bf16 noise on the same
images (noise.json: vision.vision, the fp32 and reordered probes). The other backends' encoders are held to
the same bound in tests/conformance/test_nvidia_vision.py and tests/ascend/test_ascend_vision.py."""

from __future__ import annotations

import io

import pytest
import torch

from deepinfer.backends import get_accelerator
from deepinfer.core.tokenizer import Tokenizer
from deepinfer.models.deepseek_v41.image_processor import IMAGE, IMAGE_NEW_LINE, plan_grid, process_image
from deepinfer.models.deepseek_v41.multimodal import expand_prompt
from deepinfer.models.deepseek_v41.vision_config import VisionConfig
from v41_goldens import load
from v41_vision import IMAGES, VL_DIR, check_image, encoder, png, stored_tensors, vl_config


def settings_config(settings: dict) -> VisionConfig:
    """A VisionConfig from the reference ModelArgs fields the golden's grid tables were planned with."""
    return VisionConfig(num_hidden_layers=1, patch_size=settings["vision_patch_size"],
                        downsample_ratio=settings["vision_downsample_ratio"],
                        max_image_tokens=settings["vision_max_n_token"], min_pixels=settings["vision_min_pixels"],
                        max_wh_ratio=settings["vision_max_wh_ratio"])


@pytest.mark.parametrize("name", ["released", "released_wh2", "released_small"])
def test_grid_plans_match_the_reference(name):
    g = load("vision")
    cfg = settings_config(g.meta["grids"][name])
    for row in g[f"grids.{name}"].tolist():
        grid = plan_grid(row[0], row[1], cfg)
        got = [grid.llm_h, grid.llm_w, grid.height, grid.width, grid.vit_h, grid.vit_w, int(grid.stretch)]
        assert got == row[2:], f"{row[0]} x {row[1]} px: {got} != reference {row[2:]}"
        assert grid.num_tokens <= cfg.max_image_tokens


@pytest.mark.parametrize("j", IMAGES)
def test_images_become_the_reference_patches_and_span(j):
    g = load("vision")
    meta = g.meta["images"][j]
    image = process_image(png(j), vl_config())
    assert [image.grid.vit_h, image.grid.vit_w] == meta["vit_grid"]
    assert image.grid.span_types() == g[f"image{j}.types"].tolist()
    assert torch.equal(image.patches.to(torch.bfloat16), g[f"image{j}.patches"].flatten(1))  # [N, 3, p, p] there
    assert torch.equal(image.patches.to(torch.bfloat16).float(), image.patches)  # bf16 values, as the reference


def test_pil_images_and_paths_give_the_same_patches(tmp_path):
    from PIL import Image

    cfg = vl_config()
    from_bytes = process_image(png(1), cfg)
    path = tmp_path / "image1.png"
    path.write_bytes(png(1))
    for source in (Image.open(io.BytesIO(png(1))), path, str(path)):
        image = process_image(source, cfg)
        assert image.digest == from_bytes.digest and torch.equal(image.patches, from_bytes.patches)
    assert process_image(png(0), cfg).digest != from_bytes.digest


def test_prompt_expands_like_the_reference():
    g = load("vision")
    tokenizer = Tokenizer(VL_DIR, bos_token_id=0)
    ids = tokenizer.encode(g.meta["prompt_text"])
    assert ids.count(g.meta["image_token_id"]) == 2
    prompt = expand_prompt(ids, {"image": [png(0), png(1)]}, vl_config())
    assert prompt.prompt_token_ids == g["prompt.ids"].tolist()
    types = torch.full((len(prompt.prompt_token_ids),), -1)
    for item, meta in zip(prompt.items, g.meta["images"], strict=True):
        assert (item.offset, item.length) == (meta["start"], meta["span"])
        types[item.offset:item.end] = torch.tensor(item.data.grid.span_types())
    assert torch.equal(types, g["prompt.token_types"])


@pytest.fixture(scope="module")
def cpu_encoder():
    return encoder(get_accelerator("cpu"))


@pytest.mark.parametrize("j", IMAGES)
def test_vision_encoder_matches_the_reference(cpu_encoder, j):
    enc, stored = cpu_encoder, stored_tensors()
    image, rows = check_image(enc, j)
    (span,) = enc.encode([image.patches], [image.grid])
    types = torch.tensor(image.grid.span_types())
    assert torch.equal(span[types == IMAGE], rows)
    assert torch.equal(span[0], stored["image_start"].float()) and torch.equal(span[-1], stored["image_end"].float())
    assert torch.equal(span[types == IMAGE_NEW_LINE], stored["image_newline"].float().expand(image.grid.llm_h, -1))


def test_images_encoded_together_equal_each_alone(cpu_encoder):
    """One encoder pass over both images: attention stays within each image's patches."""
    enc = cpu_encoder
    images = [process_image(png(j), vl_config()) for j in IMAGES]
    together = enc.encode([im.patches for im in images], [im.grid for im in images])
    for image, out in zip(images, together):
        (alone,) = enc.encode([image.patches], [image.grid])
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuts", [(0, 102), (0, 30, 61, 89, *range(90, 103))], ids=["prefill", "chunks + decode"])
def test_engram_hashes_skip_image_spans(cuts):
    """Engram's hash ids of the two-image prompt equal the reference's exactly: span positions are DEAD in
    the class history, so no n-gram spans or crosses an image; also with chunks that cut the spans and a
    decode tail whose look-back reaches the second image through the cache."""
    from deepinfer.models.base import StepInput
    from v41_goldens import VL_CONFIG
    from v41_models import model, new_cache

    g = load("vision")
    ids, image = g["prompt.ids"], g["prompt.token_types"] >= 0
    m = model(VL_CONFIG)
    cache = new_cache(m)
    slot = cache.allocate_slot()
    cache.grow(slot, len(ids))
    got = []
    for a, b in zip(cuts, cuts[1:]):
        meta = m.prepare(StepInput(ids[a:b], torch.tensor([slot]), torch.tensor([a]), torch.tensor([b - a])), cache)
        got.append(m._engram_hashes(meta, image[a:b]))
    assert torch.equal(torch.cat(got), g["prompt.engram.hash_ids"])
