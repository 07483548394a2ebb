"""Safetensors checkpoint loading for DeepSeek-V4: any naming, FP8/FP4 dequantized to float32.

Three spellings of the same tensors reach us: HF state_dict names (what the model graph uses),
DeepSeek's original names, and what transformers 5.x `save_pretrained` writes -- the conversion
mapping run backwards, i.e. original inner names under a `model.` prefix
(`model.layers.0.attn.wq_a.weight`, per-expert w1/w2/w3) beside `model.embed_tokens.weight` and
`head.weight`. So each name is resolved on its own (`_resolve`) rather than per checkpoint.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["CheckpointError", "load_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor, expected vs found."""


# Upstream (DeepSeek inference/model.py) name -> HF name: the renames of transformers'
# `conversion_mapping.py` ("deepseek_v4" entry), written out per tensor. Layer entries are
# relative to `layers.{i}.` / `model.layers.{i}.`. Note the HF module tree nests the indexer
# inside the compressor (`attn.indexer.*` -> `self_attn.compressor.indexer.*`).
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    # transformers' save_pretrained reverses the `.norm.` -> `.kv_norm.` rename into this name
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# Routed experts are per expert upstream; HF fuses them: gate_up_proj[j] = cat([w1, w3]), down_proj[j] = w2.
_EXPERT_PARTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")

# A destination: (HF name, None) for a whole tensor, (HF name, (expert, half)) for a slice of a
# fused expert tensor, where half is 0/1 for the gate/up rows of gate_up_proj and None for down_proj.
Slot = tuple[str, tuple[int, int | None] | None]


def upstream_to_hf(name: str) -> Slot | None:
    """Where an upstream-named tensor goes in HF naming; None if it has no HF counterpart."""
    if name in _TOP_RENAMES:
        return _TOP_RENAMES[name], None
    if not (m := _LAYER_RE.fullmatch(name)):
        return None
    layer, rest = m.groups()
    if rest in _LAYER_RENAMES:
        return f"model.layers.{layer}.{_LAYER_RENAMES[rest]}", None
    if e := _EXPERT_RE.fullmatch(rest):
        fused, half = _EXPERT_PARTS[e.group(2)]
        return f"model.layers.{layer}.mlp.experts.{fused}", (int(e.group(1)), half)
    return None


# ---------------------------------------------------------------------------------- dequant

# E2M1: bit 3 is the sign, bits 0-2 index the magnitude.
_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
_FP4_GROUP = 32  # one scale per 32 consecutive input elements
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4 = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_f32(s: torch.Tensor) -> torch.Tensor:
    # ue8m0 holds only an exponent: 2^(e-127). Some checkpoints store those bytes as raw uint8.
    if s.dtype == torch.uint8:
        return torch.exp2(s.float() - 127)
    return s.float()


def _expand(s: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    return s.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]


def dequant_fp8(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """[..., N, K] fp8 * scales over block[0] x block[1] tiles (last tiles may be partial)."""
    *lead, n, k = w.shape
    grid = (*lead, _cdiv(n, block[0]), _cdiv(k, block[1]))
    if tuple(s.shape) == grid:
        return w.float() * _expand(_scale_f32(s), block, n, k)
    # A fused gate_up_proj whose halves were quantized separately (w1, w3 upstream) has one
    # tile grid per half: transformers allocates these with `min_sf_out=2`.
    half = (*lead, 2 * _cdiv(n // 2, block[0]), grid[-1])
    if n % 2 == 0 and tuple(s.shape) == half:
        return torch.cat([dequant_fp8(wh, sh, block, name) for wh, sh in zip(w.chunk(2, -2), s.chunk(2, -2))], -2)
    raise CheckpointError(f"{name}: fp8 weight {tuple(w.shape)} with {block[0]}x{block[1]} blocks expects "
                          f"scale shape {grid}, found {tuple(s.shape)}")


def dequant_fp4(w: torch.Tensor, s: torch.Tensor, name: str) -> torch.Tensor:
    """[..., N, K/2] packed e2m1 -> [..., N, K] float32, times one scale per 32 inputs.

    Element 2i is the low nibble of byte i and 2i+1 the high nibble, as in DeepSeek's
    V4 checkpoints and transformers' `Fp8Dequantize._unpack_fp4` (integrations/finegrained_fp8.py)."""
    *lead, n, k2 = w.shape
    k = 2 * k2
    if tuple(s.shape) != (*lead, n, _cdiv(k, _FP4_GROUP)):
        raise CheckpointError(f"{name}: fp4 weight {tuple(w.shape)} (packed, {k} inputs) expects scale shape "
                              f"{(*lead, n, _cdiv(k, _FP4_GROUP))}, found {tuple(s.shape)}")
    u = w.view(torch.uint8).long()
    vals = torch.stack([_E2M1[u & 0xF], _E2M1[u >> 4]], -1).flatten(-2)
    return vals * _scale_f32(s).repeat_interleave(_FP4_GROUP, -1)[..., :k]


def _to_float32(name: str, t: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> torch.Tensor:
    if scale is not None:
        if t.dtype in _FP8:
            return dequant_fp8(t, scale, block, name)
        if t.dtype in _FP4:
            return dequant_fp4(t, scale, name)
        raise CheckpointError(f"{name}: has a scale tensor but dtype {t.dtype} (expected float8_e4m3fn or packed fp4)")
    if t.dtype in _FP8:
        raise CheckpointError(f"{name}: quantized {t.dtype} weight found without its scale tensor")
    if not t.is_floating_point():
        raise CheckpointError(f"{name}: expected a floating-point tensor, found dtype {t.dtype}")
    return t.float()


def _convert(name: str, t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
             block: tuple[int, int]) -> torch.Tensor:
    if dtype.is_floating_point:
        return _to_float32(name, t, scale, block).to(dtype)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or scale is not None:
        raise CheckpointError(f"{name}: expected an integer table ({dtype}), found dtype {t.dtype}")
    return t.to(dtype)


# ---------------------------------------------------------------------------------- files

def _weight_map(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file, from the shard index or the headers of the *.safetensors files."""
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        files = {f: model_dir / f for f in set(weight_map.values())}
        for name, f in weight_map.items():
            if not files[f].is_file():
                raise CheckpointError(f"{index}: tensor {name} is mapped to {f}, which does not exist in {model_dir}")
        return {name: files[f] for name, f in weight_map.items()}
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"no checkpoint in {model_dir}: looked for model.safetensors.index.json "
                              "or *.safetensors (e.g. model.safetensors)")
    out = {}
    for p in paths:
        with safe_open(p, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), p))
    return out


def _block_size(model_dir: Path) -> tuple[int, int]:
    cfg = model_dir / "config.json"
    qcfg = (json.loads(cfg.read_text()).get("quantization_config") or {}) if cfg.exists() else {}
    b0, b1 = qcfg.get("weight_block_size") or (128, 128)
    return int(b0), int(b1)


def _resolve(name: str, expected) -> Slot | None:
    if name in expected:
        return name, None
    return upstream_to_hf(name.removeprefix("model."))


def _pair_scales(names, expected) -> dict[str, str]:
    """weight name -> its scale's name: HF `<name>_scale_inv`, upstream `X.scale` for `X.weight`.
    A `.scale` that is itself a model tensor (HF `attn_hc.scale`) is not a quantization scale."""
    pairs = {}
    for n in names:
        if n.endswith("_scale_inv"):
            w = n.removesuffix("_scale_inv")
        elif n.endswith(".scale") and _resolve(n, expected) is None:
            w = n.removesuffix(".scale") + ".weight"
        else:
            continue
        if w not in names:
            raise CheckpointError(f"scale tensor {n} has no weight {w} in the checkpoint")
        pairs[w] = n
    return pairs


# ---------------------------------------------------------------------------------- entry

def load_checkpoint(model_dir: str | os.PathLike, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], *,
                    keep_prefixes=("mtp.",)) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Returns (weights, extra). `weights` has exactly the keys of `expected` (HF naming, as
    `DeepseekV4ForCausalLM.state_dict()` names them, e.g. 'model.layers.0.self_attn.q_a_proj.weight',
    'model.layers.3.mlp.experts.gate_up_proj' [E, 2I, D], 'model.layers.0.mlp.gate.tid2eid' [V, k] int64,
    'lm_head.weight'), each float32 (int64 for integer tables) with the expected shape. `extra` holds the
    tensors whose names start with one of keep_prefixes (upstream `mtp.*` drafter stages, kept dequantized
    to float32 in upstream naming, for a later speculative-decoding feature)."""
    model_dir = Path(model_dir)
    where = _weight_map(model_dir)
    block = _block_size(model_dir)
    scales = _pair_scales(where.keys(), expected)
    scale_names = set(scales.values())

    weights: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    source: dict[tuple[str, int | None, int | None], str] = {}  # (hf, expert, half) -> checkpoint name
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, framework="pt")) for p in dict.fromkeys(where.values())}

        def read(name: str) -> torch.Tensor:
            return handles[where[name]].get_tensor(name)

        # File by file, so each shard is read once, front to back.
        for name in sorted(where.keys() - scale_names, key=lambda n: (str(where[n]), n)):
            scale = read(scales[name]) if name in scales else None
            if name.startswith(tuple(keep_prefixes)):
                t = read(name)
                int_table = not t.is_floating_point() and scale is None
                extra[name] = _convert(name, t, scale, torch.int64 if int_table else torch.float32, block)
                continue
            slot = _resolve(name, expected)
            if slot is None or slot[0] not in expected:
                raise CheckpointError(f"unexpected tensor {name} in {where[name].name}: not part of the model")
            hf, part = slot
            key = (hf, *(part or (None, None)))
            if key in source or (hf, None, None) in source or (part is None and hf in weights):
                raise CheckpointError(f"{name}: {hf} is also loaded from {source.get(key, 'another tensor')}")
            source[key] = name
            shape, dtype = expected[hf]
            t = _convert(name, read(name), scale, dtype, block)
            if part is None:
                _check_shape(name, tuple(t.shape), shape)
                weights[hf] = t
                continue
            # One expert's slice of the fused [E, 2I, D] / [E, D, I] tensor, filled in place.
            j, half = part
            if j >= shape[0]:
                raise CheckpointError(f"unexpected tensor {name}: expert {j}, but the model has {shape[0]} experts")
            rows = shape[1] // 2 if half is not None else shape[1]
            _check_shape(name, tuple(t.shape), (rows, shape[2]))
            if hf not in weights:
                weights[hf] = torch.empty(shape, dtype=dtype)
            lo = (half or 0) * rows
            weights[hf][j, lo: lo + rows] = t

    _check_complete(expected, weights, source)
    return weights, extra


def _check_shape(name: str, found: tuple[int, ...], want: tuple[int, ...]) -> None:
    if found != tuple(want):
        raise CheckpointError(f"{name}: expected shape {tuple(want)}, found {found}")


def _check_complete(expected, weights, source) -> None:
    for hf, (shape, _) in expected.items():
        if hf not in weights:
            up = hf_to_upstream(hf)
            raise CheckpointError(f"missing tensor {hf}" + (f" (upstream name {up})" if up else ""))
        if (hf, None, None) in source:
            continue
        layer = hf.split(".")[2]  # built from per-expert tensors: every slice must have come
        for w, (fused, half) in _EXPERT_PARTS.items():
            for j in range(shape[0]):
                if hf.endswith(fused) and (hf, j, half) not in source:
                    raise CheckpointError(f"missing tensor layers.{layer}.ffn.experts.{j}.{w}.weight (for {hf})")


def hf_to_upstream(hf: str) -> str | None:
    """Inverse of `upstream_to_hf` for whole tensors (fused experts have no single upstream name)."""
    if up := next((u for u, h in _TOP_RENAMES.items() if h == hf), None):
        return up
    if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf):
        rest = next((u for u, h in _LAYER_RENAMES.items() if h == m.group(2)), None)
        return rest and f"layers.{m.group(1)}.{rest}"
    return None
