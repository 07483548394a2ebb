"""Safetensors checkpoint loading: the tensors a model names, FP8/FP4 dequantized to float32.

The model says which tensors it reads (`checkpoint_tensors`: its own names, shapes, dtypes) and
where a checkpoint tensor named otherwise goes (`checkpoint_name`: upstream names, per-expert
tensors that fill one expert's slice of a fused stack). Each name is resolved on its own, so one
checkpoint may mix spellings.
"""
from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from deepinfer.models.base import Slot, TensorSpec

__all__ = ["CheckpointError", "load_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor, expected vs found."""


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

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
}


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data begins."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def mapped_tensor(path: Path, name: str) -> torch.Tensor:
    """A tensor of a safetensors file, memory-mapped, not read: its pages come from the file when a
    row is touched (copy-on-write, so the tensor is writable without ever writing the file)."""
    header, base = _header(path)
    entry = header[name]
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(f"{name}: stored dtype {entry['dtype']} cannot be memory-mapped here")
    begin, end = entry["data_offsets"]
    if end == begin:
        return torch.empty(entry["shape"], dtype=dtype)
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=base + begin, shape=(end - begin,))
    return torch.from_numpy(raw).view(dtype).view(entry["shape"])


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


def _resolve(name: str, expected, names) -> Slot | None:
    if name in expected:
        return name, None
    return names.checkpoint_name(name) if names is not None else None


def _pair_scales(names, expected, model_names) -> dict[str, str]:
    """weight name -> its scale's name: HF `<name>_scale_inv`, upstream `X.scale` for `X.weight`.
    A `.scale` that is itself a model tensor (HF `attn_hc.scale`) is not a quantization scale."""
    pairs = {}
    for n in names:
        if n.endswith("_scale_inv"):
            w = n.removesuffix("_scale_inv")
        elif n.endswith(".scale") and _resolve(n, expected, model_names) is None:
            w = n.removesuffix(".scale") + ".weight"
        else:
            continue
        if w not in names:
            raise CheckpointError(f"scale tensor {n} has no weight {w} in the checkpoint")
        pairs[w] = n
    return pairs


# ---------------------------------------------------------------------------------- entry

def load_checkpoint(model_dir: str | os.PathLike, expected: dict[str, TensorSpec], names=None, *,
                    keep_prefixes=()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Returns (weights, extra). `weights` has exactly the keys of `expected` (the model's names),
    each float32 (int64 for integer tables) with the expected shape; fused expert stacks [E, N, K]
    are assembled from per-expert tensors where the checkpoint has those. `names` (the model class)
    resolves other spellings: `checkpoint_name(name) -> Slot | None` and, for error messages,
    `checkpoint_source(name, part) -> str | None`. `extra` holds the tensors whose names start with
    one of keep_prefixes (e.g. upstream `mtp.*` drafter stages), dequantized to float32, unrenamed."""
    model_dir = Path(model_dir)
    where = _weight_map(model_dir)
    block = _block_size(model_dir)
    scales = _pair_scales(where.keys(), expected, names)
    scale_names = set(scales.values())

    weights: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    source: dict[tuple[str, int | None, int | None], str] = {}  # (model name, expert, half) -> checkpoint name
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
            slot = _resolve(name, expected, names)
            if slot is None or slot[0] not in expected:
                raise CheckpointError(f"unexpected tensor {name} in {where[name].name}: not part of the model")
            hf, part = slot
            if expected[hf].mapped:  # left in the file: a view of its pages, in the stored dtype
                t = mapped_tensor(where[name], name)
                if t.dtype != expected[hf].dtype:
                    raise CheckpointError(f"{name}: expected stored dtype {expected[hf].dtype}, found {t.dtype}")
                _check_shape(name, tuple(t.shape), expected[hf].shape)
                source[(hf, None, None)] = name
                weights[hf] = t
                continue
            key = (hf, *(part or (None, None)))
            if key in source or (hf, None, None) in source or (part is None and hf in weights):
                raise CheckpointError(f"{name}: {hf} is also loaded from {source.get(key, 'another tensor')}")
            source[key] = name
            shape, dtype = expected[hf].shape, expected[hf].dtype
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

    _check_complete(expected, weights, source, names)
    return weights, extra


def _check_shape(name: str, found: tuple[int, ...], want: tuple[int, ...]) -> None:
    if found != tuple(want):
        raise CheckpointError(f"{name}: expected shape {tuple(want)}, found {found}")


def _check_complete(expected, weights, source, names) -> None:
    describe = getattr(names, "checkpoint_source", lambda name, part=None: None)
    for hf, spec in expected.items():
        if hf not in weights:
            up = describe(hf)
            raise CheckpointError(f"missing tensor {hf}" + (f" (upstream name {up})" if up else ""))
        if (hf, None, None) in source:
            continue
        # built from per-expert tensors: every slice must have come
        halves = {half for (name, _, half) in source if name == hf}
        halves = {0, 1} if halves & {0, 1} else {None}  # a gate/up stack needs both halves of every expert
        for j in range(spec.shape[0]):
            for half in sorted(halves, key=str):
                if (hf, j, half) not in source:
                    part = describe(hf, (j, half)) or f"expert {j}"
                    raise CheckpointError(f"missing tensor {part} (for {hf})")
