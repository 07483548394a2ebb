"""DeepSeek-V4.1's side of multimodal requests: a prompt's image placeholders expanded into image spans
(the model interface's `process_multimodal`), the spans' embeddings from the vision encoder
(`encode_multimodal`), and an image's encoder input shipped to an encoder worker (`pack_image`, then
`ImageEncoder.unpack` there: the grid and the patches, which are bfloat16 values, as bfloat16)."""

from __future__ import annotations

import torch

from deepinfer.models.base import MultimodalItem, MultimodalPrompt
from deepinfer.models.deepseek_v41.image_processor import ImageGrid, ProcessedImage, image_digest, process_image
from deepinfer.models.deepseek_v41.vision import VisionEncoder
from deepinfer.models.deepseek_v41.vision_config import IMAGE_PLACEHOLDER, VisionConfig

MODALITIES = ("image",)


def as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def expand_prompt(prompt_token_ids: list[int], data: dict, cfg: VisionConfig | None) -> MultimodalPrompt:
    """Each placeholder token (`cfg.image_token_id`) becomes its image's span, images taken in order."""
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': [...]}}, got {type(data).__name__}")
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise ValueError(f"multi_modal_data has {unknown}: DeepSeek-V4.1 takes images only ('image')")
    images = as_list(data["image"]) if data.get("image") is not None else []
    if cfg is None:
        if not images:
            return MultimodalPrompt(list(prompt_token_ids), [])
        raise ValueError("multi_modal_data has images, but this DeepSeek-V4.1 checkpoint has no vision tower "
                         "(its config.json has no vision_config): send text only, or use a checkpoint with one")
    placeholders = sum(t == cfg.image_token_id for t in prompt_token_ids)
    if placeholders != len(images):
        raise ValueError(f"the prompt has {placeholders} image placeholder(s) ({IMAGE_PLACEHOLDER} or <image>) but "
                         f"multi_modal_data has {len(images)} image(s): put one placeholder where each image goes")
    ids, items = [], []
    for tok in prompt_token_ids:
        if tok != cfg.image_token_id:
            ids.append(tok)
            continue
        k = len(items)
        image = process_image(images[k], cfg, what=f"multi_modal_data image {k}")  # ImageError is a ValueError
        span = image.grid.num_tokens
        items.append(MultimodalItem(len(ids), span, image.digest, image))
        ids += [cfg.image_token_id] * span
    return MultimodalPrompt(ids, items)


def encode_items(encoder: VisionEncoder, items: list[MultimodalItem]) -> list[torch.Tensor]:
    images: list[ProcessedImage] = [item.data for item in items]
    return encoder.encode([im.patches for im in images], [im.grid for im in images])


def pack_image(image: ProcessedImage) -> tuple[dict, bytes]:
    """(header, bytes) of an image's encoder input: its grid and digest, the patches as bfloat16."""
    g = image.grid
    header = {"grid": [g.height, g.width, g.vit_h, g.vit_w, g.llm_h, g.llm_w, g.stretch], "digest": image.digest.hex()}
    return header, image.patches.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


class ImageEncoder:
    """The vision tower alone (an encoder worker's model): images shipped by `pack_image` in, their
    span embeddings out."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor], accel):
        self.cfg = cfg
        self.vision = VisionEncoder(cfg, weights, accel)
        self.hidden_size = cfg.text_hidden_size

    def unpack(self, header: dict, payload: bytes) -> ProcessedImage:
        try:
            grid = ImageGrid(*(int(v) for v in header["grid"][:6]), bool(header["grid"][6]))
            digest = bytes.fromhex(header["digest"])
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"an image header needs grid (7 fields) and digest (hex), got {header!r}") from None
        width = 3 * self.cfg.patch_size ** 2
        if len(payload) != grid.num_patches * width * 2:
            raise ValueError(f"an image of {grid.num_patches} patches of {width} bfloat16 values takes "
                             f"{grid.num_patches * width * 2} bytes, got {len(payload)}")
        patches = torch.frombuffer(bytearray(payload), dtype=torch.int16).view(torch.bfloat16).float()
        patches = patches.view(grid.num_patches, width)
        if image_digest(grid, patches) != digest:
            raise ValueError("an image's patches do not match its digest: the bytes were damaged on the way")
        return ProcessedImage(grid, patches, digest)

    def encode(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        return self.vision.encode([im.patches for im in images], [im.grid for im in images])
