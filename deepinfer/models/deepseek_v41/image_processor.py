"""DeepSeek-V4.1's image preprocessing: decode an image, choose its patch grid within the token
budget, resize or pad it to that grid, normalise it into ViT patches, and lay out its span of prompt
positions. Decisions follow DeepSeek's reference `inference/image_processor.py` exactly (the goldens in
tests/goldens/v41/vision* hold its grids, layouts and patches).

An image of W x H pixels becomes a `vit_h x vit_w` grid of `patch_size` pixel patches; the aligner
merges `downsample_ratio`^2 neighbouring patches into one language-model token, so the model sees a
`llm_h x llm_w` token grid, laid out row by row as

    [IMAGE_START] ([IMAGE] * llm_w [IMAGE_NEW_LINE]) * llm_h [IMAGE_END]

Every position of the span carries `image_token_id`; the markers get learned embeddings and the IMAGE
positions the aligner's rows in reading order.

Grid choice:
1. An image wider than `max_wh_ratio` x its height is planned as if it were that wide (and later
   stretched into the grid rather than padded).
2. An image of fewer than `min_pixels` pixels is planned scaled up (aspect kept) to about that many.
3. Each side is rounded up to whole patches. If the span would exceed `max_image_tokens` positions, the
   largest aspect-preserving size that fits is taken instead (a single row or column for extreme aspect
   ratios).
The image is then fitted into the grid's pixel size: stretched when it was squeezed in step 1, else
scaled to fit (aspect kept, Pillow's bicubic) and centred on grey (127, 127, 127). Pixels are scaled to
[-1, 1] and rounded to bfloat16, as the reference feeds its bf16 ViT.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.deepseek_v41.vision_config import VisionConfig

# the span's position types (the reference's token types); TEXT positions are not part of a span
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)
PAD_COLOR = (127, 127, 127)


class ImageError(ValueError):
    """An image the processor cannot take: the message names the input and the fix."""


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """Where an image of a given size goes: its pixel size after resizing, the ViT's patch grid, the
    aligner's token grid, and whether it is stretched (squeezed by max_wh_ratio) or padded."""

    height: int
    width: int
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int
    stretch: bool

    @property
    def num_tokens(self) -> int:
        """Prompt positions of the span: the token rows, a new line after each, start and end."""
        return span_length(self.llm_h, self.llm_w)

    @property
    def num_patches(self) -> int:
        return self.vit_h * self.vit_w

    def span_types(self) -> list[int]:
        row = [IMAGE] * self.llm_w + [IMAGE_NEW_LINE]
        return [IMAGE_START] + row * self.llm_h + [IMAGE_END]


def span_length(llm_h: int, llm_w: int) -> int:
    return llm_h * (llm_w + 1) + 2


def token_grid(height_px: int, width_px: int, cfg: VisionConfig) -> tuple[int, int]:
    """The aligner's token grid for a pixel size: whole patches per side, merged downsample_ratio at a
    time (a partial group at the edge is zero-padded by the aligner, so it rounds up)."""
    p, r = cfg.patch_size, cfg.downsample_ratio
    return -(-(height_px // p) // r), -(-(width_px // p) // r)


def _fit_budget(height: float, width: float, cfg: VisionConfig) -> tuple[int, int]:
    """The largest aspect-preserving pixel size (whole patches) whose span fits max_image_tokens.

    With an aspect ratio a = h / w and a grid of w tokens a row, the span takes a w^2 + w + 2
    positions: w = sqrt((N - 2) / a + 1/4) - 1/2 fills it. Grids whose short side falls below one
    token collapse to a single column (tall) or row (wide) of the longest span that fits."""
    n, p = cfg.max_image_tokens, cfg.patch_size
    cell = p * cfg.downsample_ratio  # pixels per token side
    aspect = height / width
    cols = math.sqrt((n - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    if cols < 1.0:
        return (n - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (n - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, cfg: VisionConfig) -> ImageGrid:
    """The grid of an image of width x height pixels (a pure function of the size and the config)."""
    if width < 1 or height < 1:
        raise ImageError(f"an image of {width} x {height} pixels has no area")
    p = cfg.patch_size
    w, h = width, height
    stretch = cfg.max_wh_ratio is not None and width >= cfg.max_wh_ratio * height
    if cfg.max_wh_ratio is not None and w > h * cfg.max_wh_ratio:
        w = h * cfg.max_wh_ratio
    if w * h < cfg.min_pixels:
        up = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    best_h, best_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    llm_h, llm_w = token_grid(best_h, best_w, cfg)
    if span_length(llm_h, llm_w) > cfg.max_image_tokens:
        best_h, best_w = _fit_budget(h, w, cfg)
        llm_h, llm_w = token_grid(best_h, best_w, cfg)
    if span_length(llm_h, llm_w) > cfg.max_image_tokens or best_h < p or best_w < p:
        raise ImageError(f"an image of {width} x {height} pixels cannot be fitted into max_image_tokens="
                         f"{cfg.max_image_tokens} positions (grid {llm_h} x {llm_w})")
    return ImageGrid(best_h, best_w, best_h // p, best_w // p, llm_h, llm_w, stretch)


def decode_image(data, what: str = "image"):
    """A PIL image in RGB from a PIL image, encoded bytes (PNG, JPEG, ...) or a local file path (the
    offline API only: the server passes bytes). Alpha is dropped, not composited, as the reference
    does (`Image.convert("RGB")`)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, Image.Image):
        image = data
        try:
            image.load()
        except (OSError, ValueError) as exc:
            raise ImageError(f"{what}: the PIL image cannot be read ({exc})") from None
        return image.convert("RGB")
    if isinstance(data, (bytes, bytearray, memoryview)):
        if not len(data):
            raise ImageError(f"{what} is empty (0 bytes): give an encoded image (PNG, JPEG, WebP, ...)")
        source, name = io.BytesIO(bytes(data)), f"{what} ({len(data)} bytes)"
    elif isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if not os.path.isfile(path):
            raise ImageError(f"{what}: no file at {path!r}; give a PIL.Image, encoded bytes or an existing path")
        source, name = path, f"{what} ({path!r})"
    else:
        raise ImageError(f"{what} is a {type(data).__name__}; give a PIL.Image, encoded bytes or a file path")
    try:
        with Image.open(source) as opened:
            return opened.convert("RGB")
    except UnidentifiedImageError:
        raise ImageError(f"{name} is not an image Pillow can decode (PNG, JPEG, WebP, GIF, BMP, ...)") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{name} is too large to decode safely: {exc}") from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise ImageError(f"{name} cannot be decoded: {exc}") from None


def fit_to_grid(image, grid: ImageGrid):
    """The image at the grid's pixel size: stretched, or scaled into it and centred on grey."""
    from PIL import Image, ImageOps

    size = (grid.width, grid.height)
    if grid.stretch:
        return image.resize(size, Image.Resampling.BICUBIC)
    return ImageOps.pad(image, size, method=Image.Resampling.BICUBIC, color=PAD_COLOR)


def to_patches(image, grid: ImageGrid, patch_size: int) -> torch.Tensor:
    """RGB pixels in [-1, 1], rounded to bfloat16 as the reference's ViT input, cut into patches:
    [vit_h * vit_w, 3 * p * p] float32, rows in reading order, each patch channel-major (c, y, x)."""
    p = patch_size
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16).float()
    patches = pixels.reshape(3, grid.vit_h, p, grid.vit_w, p).permute(1, 3, 0, 2, 4)
    return patches.reshape(grid.num_patches, 3 * p * p).contiguous()


@dataclass(slots=True)
class ProcessedImage:
    """One image, ready for the encoder: its grid, patches and a digest of exactly what the encoder
    sees (the grid and the patch values), which keys it in the prefix cache."""

    grid: ImageGrid
    patches: torch.Tensor
    digest: bytes


def process_image(data, cfg: VisionConfig, what: str = "image") -> ProcessedImage:
    image = decode_image(data, what)
    try:
        grid = plan_grid(image.width, image.height, cfg)
    except ImageError as exc:
        raise ImageError(f"{what}: {exc}") from None
    patches = to_patches(fit_to_grid(image, grid), grid, cfg.patch_size)
    return ProcessedImage(grid, patches, image_digest(grid, patches))


def image_digest(grid: ImageGrid, patches: torch.Tensor) -> bytes:
    """The digest of what the encoder sees: the grid and the patch values."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.array([grid.vit_h, grid.vit_w, grid.llm_h, grid.llm_w], dtype=np.int64).tobytes())
    h.update(patches.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.digest()
