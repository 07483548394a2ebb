"""DeepSeek-V4.1's vision encoder on accelerator ops: a ViT over each image's patch grid (2-D rotary
positions, bidirectional attention, SwiGLU MLPs, pre-norm RMSNorm) and the aligner, which merges each
downsample_ratio x downsample_ratio group of patch features into one language-model embedding (a GELU
MLP). `encode` returns, per image, the embeddings of its whole prompt span: the learned start, new-line
and end vectors around the aligner's rows (image_processor.py lays the span out).

Checkpoint names and shapes are the reference's (`vision.*`, `aligner.*`, `image_{start,end,newline}`;
dense weights with biases, stored bf16, norm weights fp32); `checkpoint_tensors` lists them.

RoPE. The reference rotates channel i of a head with channel i + head_dim/2 (two halves), by the patch's
row for the first head_dim/4 pairs and by its column for the rest. The accelerator's rope op turns
adjacent pairs (2i, 2i + 1), so the q and k rows of `wqkv` are permuted at load to put channel
i + head_dim/2 next to channel i: attention scores are dot products of q and k, unchanged when both are
permuted alike (v and the output are not permuted).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepinfer.backends.base import Accelerator
from deepinfer.models.base import TensorSpec
from deepinfer.models.deepseek_v41.image_processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImageGrid
from deepinfer.models.deepseek_v41.numerics import bf16
from deepinfer.models.deepseek_v41.vision_config import NORM_EPS, VisionConfig

PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
_NO_LIMIT = math.inf  # the ViT's SwiGLU is unclamped (the text model's experts clamp)


def checkpoint_tensors(cfg: VisionConfig) -> dict[str, TensorSpec]:
    """Every tensor of the vision tower, aligner and span markers, by the checkpoint's names."""
    d, inter, p, r, out = (cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.downsample_ratio,
                           cfg.text_hidden_size)
    shapes = {"vision.patch_embed.proj.weight": (d, 3 * p * p), "vision.patch_embed.proj.bias": (d,)}
    for b in range(cfg.num_hidden_layers):
        q = f"vision.blocks.{b}."
        shapes.update({q + "norm1.weight": (d,), q + "attn.wqkv.weight": (3 * d, d), q + "attn.wqkv.bias": (3 * d,),
                       q + "attn.wo.weight": (d, d), q + "attn.wo.bias": (d,), q + "norm2.weight": (d,),
                       q + "mlp.w1.weight": (2 * inter, d), q + "mlp.w2.weight": (d, inter)})
    shapes.update({"vision.norm.weight": (d,), "aligner.w1.weight": (out, d * r * r), "aligner.w1.bias": (out,),
                   "aligner.w2.weight": (out, out), "aligner.w2.bias": (out,), "image_start": (out,),
                   "image_end": (out,), "image_newline": (out,)})
    return {name: TensorSpec(shape) for name, shape in shapes.items()}


def pair_halves(head_dim: int) -> torch.Tensor:
    """The channel order that puts channel i + head_dim/2 right after channel i: [0, h, 1, h + 1, ...]."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def rope_tables(grid: ImageGrid, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [vit_h * vit_w, head_dim / 2] in reading order: pair j < head_dim/4 turns by the patch's
    row times theta^(-4j/head_dim), pair head_dim/4 + j by its column times the same frequency."""
    dim = cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows = torch.arange(grid.vit_h).repeat_interleave(grid.vit_w).float()
    cols = torch.arange(grid.vit_w).repeat(grid.vit_h).float()
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=1)
    return angles.cos(), angles.sin()


def merge_patches(x: torch.Tensor, grid: ImageGrid, ratio: int) -> torch.Tensor:
    """The aligner's downsample: patch features [vit_h * vit_w, C] -> [llm_h * llm_w, C * ratio^2], each
    row the ratio x ratio block of patches (zero-padded at the bottom / right edge), channel-major
    (c, block row, block column): torch's unfold order, which the aligner's first weight expects."""
    c = x.shape[-1]
    x = x.view(grid.vit_h, grid.vit_w, c)
    x = F.pad(x, (0, 0, 0, grid.llm_w * ratio - grid.vit_w, 0, grid.llm_h * ratio - grid.vit_h))
    x = x.view(grid.llm_h, ratio, grid.llm_w, ratio, c).permute(0, 2, 4, 1, 3)
    return x.reshape(grid.llm_h * grid.llm_w, c * ratio * ratio)


class VisionEncoder:
    """The ViT + aligner + span markers, holding their weights as the accelerator stores them."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor], accel: Accelerator):
        self.cfg, self.accel = cfg, accel
        d, hd = cfg.hidden_size, cfg.head_dim
        # q and k rows (each [heads, head_dim]) in rope-pair order; v rows as stored
        order = pair_halves(hd)
        heads = torch.arange(cfg.num_attention_heads)[:, None] * hd
        qk = (heads + order).flatten()
        rows = torch.cat([qk, qk + d, torch.arange(2 * d, 3 * d)])
        self.w = {}
        for name in checkpoint_tensors(cfg):
            t = weights.pop(name)
            if name.endswith("attn.wqkv.weight") or name.endswith("attn.wqkv.bias"):
                t = t[rows]
            self.w[name] = accel.prepare_weight(t.contiguous())

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A bf16 projection with its bias (one rounding at the end, as the reference's nn.Linear)."""
        return bf16(self.accel.linear(x, self.w[name + ".weight"]) + self.w[name + ".bias"])

    @torch.inference_mode()
    def encode(self, patches: list[torch.Tensor], grids: list[ImageGrid]) -> list[torch.Tensor]:
        """Span embeddings [grid.num_tokens, text hidden] float32 of each image (patches [vit_h *
        vit_w, 3 p^2] from image_processor), all images through the ViT in one pass."""
        feats = self.features(patches, grids)
        rows = self.align(feats, grids)
        return [self.span(r, g) for r, g in zip(rows, grids)]

    def features(self, patches: list[torch.Tensor], grids: list[ImageGrid]) -> torch.Tensor:
        """The ViT: final-normed patch features [sum of patches, vision hidden], images back to back."""
        cfg, ops, w = self.cfg, self.accel, self.w
        dev = ops.device
        lens = [g.num_patches for g in grids]
        tables = [rope_tables(g, cfg) for g in grids]
        cos = torch.cat([c for c, _ in tables]).to(dev)
        sin = torch.cat([s for _, s in tables]).to(dev)
        x = self.linear(torch.cat(patches).to(dev, torch.float32), "vision.patch_embed.proj")
        n, heads, hd = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        for b in range(cfg.num_hidden_layers):
            p = f"vision.blocks.{b}."
            h = bf16(ops.rms_norm(x, w[p + "norm1.weight"], NORM_EPS))
            q, k, v = self.linear(h, p + "attn.wqkv").view(n, 3, heads, hd).unbind(1)
            q, k = bf16(ops.rope(q, cos, sin)), bf16(ops.rope(k, cos, sin))
            o = bf16(ops.dense_attention(q, k, v, lens, hd ** -0.5))
            x = bf16(x + self.linear(o.reshape(n, heads * hd), p + "attn.wo"))
            h = bf16(ops.rms_norm(x, w[p + "norm2.weight"], NORM_EPS))
            gate, up = bf16(ops.linear(h, w[p + "mlp.w1.weight"])).chunk(2, dim=-1)
            mid = bf16(ops.swiglu(gate, up, _NO_LIMIT))
            x = bf16(x + bf16(ops.linear(mid, w[p + "mlp.w2.weight"])))
        return bf16(ops.rms_norm(x, w["vision.norm.weight"], NORM_EPS))

    def align(self, feats: torch.Tensor, grids: list[ImageGrid]) -> list[torch.Tensor]:
        """The aligner: per image, [llm_h * llm_w, text hidden] embeddings in reading order."""
        r = self.cfg.downsample_ratio
        merged, start = [], 0
        for g in grids:
            merged.append(merge_patches(feats[start:start + g.num_patches], g, r))
            start += g.num_patches
        y = self.linear(bf16(F.gelu(self.linear(torch.cat(merged), "aligner.w1"))), "aligner.w2")
        return list(y.split([g.llm_h * g.llm_w for g in grids]))

    def span(self, rows: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        """The span's embeddings: markers from the checkpoint's learned vectors, IMAGE slots the rows."""
        types = torch.tensor(grid.span_types(), device=rows.device)
        out = torch.empty(len(types), rows.shape[-1], dtype=torch.float32, device=rows.device)
        out[types == IMAGE] = rows
        for kind, name in ((IMAGE_START, "image_start"), (IMAGE_NEW_LINE, "image_newline"), (IMAGE_END, "image_end")):
            out[types == kind] = self.w[name]
        return out
