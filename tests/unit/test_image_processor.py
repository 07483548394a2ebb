"""DeepSeek-V4.1's image input without the reference: the vision_config parser, and each bad input
(bytes that are no image, a path that does not exist, a decompression bomb, placeholders and images that
do not pair up, images for a checkpoint without a vision tower) giving an error that names it and the fix.
The decisions themselves are checked against the reference in tests/oracle/test_v41_vision.py."""

from __future__ import annotations

import io

import pytest
import torch

from deepinfer.models.base import ConfigError
from deepinfer.models.deepseek_v41.image_processor import ImageError, plan_grid, process_image
from deepinfer.models.deepseek_v41.multimodal import expand_prompt
from deepinfer.models.deepseek_v41.vision import pair_halves
from deepinfer.models.deepseek_v41.vision_config import VisionConfig

RELEASED = {"image_token_id": 129264, "vision_config": {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
    "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
    "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None}}
TINY = VisionConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=8, patch_size=4,
                    max_image_tokens=40, min_pixels=1024, image_token_id=7, text_hidden_size=8)


def png(w: int, h: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (w, h), color=(10, 200, 30) if mode == "RGB" else 128).save(buf, "PNG")
    return buf.getvalue()


def test_released_vision_config_parses():
    cfg = VisionConfig.from_dict(RELEASED, 5120)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (32, 1024, 16)
    assert cfg.intermediate_size == 2816
    assert (cfg.patch_size, cfg.downsample_ratio, cfg.max_image_tokens, cfg.min_pixels) == (14, 3, 1024, 295936)
    assert cfg.max_wh_ratio is None and cfg.image_token_id == 129264 and cfg.text_hidden_size == 5120
    assert (cfg.head_dim, cfg.rope_dim) == (64, 32)
    assert VisionConfig.from_dict({}, 64) is None  # text only
    assert VisionConfig.from_dict({"vision_config": {"num_hidden_layers": 0}}, 64) is None


@pytest.mark.parametrize("change,match", [
    ({"patch_size": "14"}, "'patch_size' must be a positive int"),
    ({"hidden_size": 0}, "'hidden_size' must be a positive int"),
    ({"num_attention_heads": 3}, "head size divisible by 4"),
    ({"max_image_tokens": 3}, "at least 4 positions"),
])
def test_bad_vision_config_names_the_key(change, match):
    data = {**RELEASED, "vision_config": {**RELEASED["vision_config"], **change}}
    with pytest.raises(ConfigError, match=match):
        VisionConfig.from_dict(data, 5120, source="cfg.json")
    with pytest.raises(ConfigError, match="'image_token_id' must be a token id"):
        VisionConfig.from_dict({**RELEASED, "image_token_id": "x"}, 5120)


@pytest.mark.parametrize("data,match", [
    (b"", r"image is empty \(0 bytes\)"),
    (b"GIF89a but not really an image", "is not an image Pillow can decode"),
    (png(40, 40)[:60], "cannot be decoded"),  # a truncated PNG
    (12, "is a int; give a PIL.Image, encoded bytes or a file path"),
    ("/no/such/image.png", "no file at '/no/such/image.png'"),
])
def test_undecodable_inputs_say_what_and_how_to_fix(data, match):
    with pytest.raises(ImageError, match=match):
        process_image(data, TINY)


def test_decompression_bomb_is_refused(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow refuses images over twice this
    with pytest.raises(ImageError, match="too large to decode safely"):
        process_image(png(40, 40), TINY)


def test_grid_needs_an_area():
    with pytest.raises(ImageError, match="has no area"):
        plan_grid(0, 10, TINY)


def test_every_grid_fits_the_budget():
    for w in (1, 3, 17, 100, 999, 40000):
        for h in (1, 5, 64, 1000, 40000):
            grid = plan_grid(w, h, TINY)
            assert 4 <= grid.num_tokens <= TINY.max_image_tokens and grid.vit_h >= 1 and grid.vit_w >= 1


def test_prompt_expansion_errors():
    image = png(30, 20)
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\) .* but multi_modal_data has 2 image\(s\)"):
        expand_prompt([1, 7, 2], {"image": [image, image]}, TINY)
    with pytest.raises(ValueError, match=r"has 2 image placeholder\(s\) .* has 1 image"):
        expand_prompt([7, 1, 7], {"image": image}, TINY)
    with pytest.raises(ValueError, match=r"multi_modal_data has \['audio'\]: DeepSeek-V4.1 takes images only"):
        expand_prompt([1, 7], {"image": image, "audio": b"x"}, TINY)
    with pytest.raises(ValueError, match="must be a dict"):
        expand_prompt([1, 7], [image], TINY)
    with pytest.raises(ValueError, match="no vision tower"):
        expand_prompt([1, 7], {"image": image}, None)
    with pytest.raises(ValueError, match="multi_modal_data image 1 is empty"):
        expand_prompt([7, 7], {"image": [image, b""]}, TINY)


def test_prompt_expansion_lays_out_spans():
    wide, tall = png(60, 20), png(10, 50, "L")
    prompt = expand_prompt([1, 7, 2, 3, 7], {"image": [wide, tall]}, TINY)
    first, second = prompt.items
    assert first.offset == 1 and second.offset == 1 + first.length + 2
    assert prompt.prompt_token_ids == [1] + [7] * first.length + [2, 3] + [7] * second.length
    assert first.length == first.data.grid.num_tokens and first.digest != second.digest
    assert expand_prompt([1, 2], {}, TINY).items == []


def test_rope_pairing_permutation():
    assert pair_halves(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    x = torch.arange(8)
    # channel i and i + 4 (the reference's halves) sit side by side after the permutation
    assert x[pair_halves(8)].view(4, 2).tolist() == [[i, i + 4] for i in range(4)]
