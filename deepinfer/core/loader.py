"""Safetensors checkpoint loading: the tensors a model names, in the formats the checkpoint stores.

The model says which tensors it reads (`checkpoint_tensors`: its own names, shapes, dtypes, and
which are weights kept as stored) and where a checkpoint tensor named otherwise goes
(`checkpoint_name`: upstream names, per-expert tensors that fill one expert's slice of a fused
stack). Each name is resolved on its own, so one checkpoint may mix spellings.

Formats. A weight the model keeps as stored (TensorSpec.stored) stays what the file holds: bf16
stays bf16, an FP8 e4m3 weight with block scales or a packed FP4 e2m1 weight with per-32 scales
becomes a backends.quant.QuantizedWeight (nothing is widened at load). Every other tensor is
converted to its spec's dtype (dequantized if the file stores it quantized). FP8 block size:
config.json's quantization_config.weight_block_size, default 128x128.

Memory. Whole tensors are views of their file's mapping (safetensors' default): a page becomes
resident when it is touched and is counted once. Per-expert tensors are copied into their stack,
so they are read (pread(2)) instead: a slice read through the mapping would stay resident beside
its copy for as long as any other tensor keeps the file mapped (a layer's shard holds both), which
had the process hold ~1.9x the files of such a checkpoint. (Reading costs one more copy: an 850 MB
checkpoint loads in 0.35 s instead of 0.33 s (medians, warm page cache, two cores); a second mapping
unmapped after each file measured the same.)
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from deepinfer.backends.quant import FP4, FP4_GROUP, FP8, QuantizedWeight
from deepinfer.models.base import Destination, TensorSpec

__all__ = ["CheckpointError", "load_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor, expected vs found."""


# ---------------------------------------------------------------------------------- formats

_FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d)
Weight = torch.Tensor | QuantizedWeight


def _quantized(name: str, t: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> QuantizedWeight:
    """A weight with a scale tensor as the QuantizedWeight it is; CheckpointError naming it if the
    pair is not a format deepinfer runs."""
    if t.dtype == torch.float8_e4m3fn:
        fmt, blk = FP8, block
    elif t.dtype in _FP4_DTYPES:
        fmt, blk = FP4, (1, FP4_GROUP)
    else:
        raise CheckpointError(f"{name}: has a scale tensor but dtype {t.dtype} (expected float8_e4m3fn, or packed "
                              "fp4 e2m1 as int8 / uint8 / float4_e2m1fn_x2)")
    try:
        return QuantizedWeight(t, scale, fmt, blk)
    except ValueError as e:
        *lead, n, k = t.shape
        # A fused gate_up_proj whose halves were quantized separately (w1, w3 upstream) has one
        # tile grid per half: transformers allocates these with `min_sf_out=2`.
        half = (*lead, 2 * -(-(n // 2) // blk[0]), -(-k // blk[1]))
        if fmt == FP8 and n % 2 == 0 and tuple(scale.shape) == half:
            return QuantizedWeight.cat([QuantizedWeight(th, sh, fmt, blk)
                                        for th, sh in zip(t.chunk(2, -2), scale.chunk(2, -2))])
        raise CheckpointError(f"{name}: {e}") from None


def _convert(name: str, t: torch.Tensor, scale: torch.Tensor | None, spec: TensorSpec,
             block: tuple[int, int]) -> Weight:
    """The checkpoint tensor as the model holds it (module doc)."""
    if not spec.dtype.is_floating_point:  # an integer table
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or scale is not None:
            raise CheckpointError(f"{name}: expected an integer table ({spec.dtype}), found dtype {t.dtype}")
        return t.to(spec.dtype)
    if scale is not None:
        q = _quantized(name, t, scale, block)
        return q if spec.stored or spec.experts else q.dequantize(spec.dtype)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"{name}: quantized {t.dtype} weight found without its scale tensor")
    if not t.is_floating_point():
        packed = " (packed FP4 needs its scale tensor: .scale or _scale_inv)" if t.dtype in _FP4_DTYPES else ""
        raise CheckpointError(f"{name}: expected a floating-point tensor, found dtype {t.dtype}{packed}")
    if (spec.stored or spec.experts) and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return t
    return t.to(spec.dtype if not (spec.stored or spec.experts) else torch.float32)


def _extra(name: str, t: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> Weight:
    """A kept-aside tensor (no spec): integer tables as int64, quantized weights as they are,
    matrices in their stored float dtype, vectors in float32."""
    if not t.is_floating_point() and scale is None:
        return _convert(name, t, None, TensorSpec((), torch.int64), block)
    return _convert(name, t, scale, TensorSpec((), stored=t.dim() >= 2), block)


class _ExpertStack:
    """An [E, N, K] stack filled one expert's slice at a time from per-expert tensors (upstream
    w1 / w3 / w2), plain or quantized: every slice must be stored alike. Gate/up halves of an FP8
    stack whose half is off the block edge get a refined row block (QuantizedWeight.cat)."""

    def __init__(self, name: str, shape: tuple[int, ...], first: Weight, halves: bool):
        self.shape, self.rows = shape, shape[1] // 2 if halves else shape[1]
        self.kind = self._kind(first)
        if isinstance(first, QuantizedWeight):
            b0 = math.gcd(first.block[0], self.rows) if halves else first.block[0]
            self.block = (b0, first.block[1])
            kbytes = first.data.shape[-1]
            self.data = torch.empty(shape[0], shape[1], kbytes, dtype=first.data.dtype)
            grid = (shape[0], -(-shape[1] // b0), -(-shape[2] // self.block[1]))
            self.scale = torch.empty(grid, dtype=first.scale.dtype)
        else:
            self.data = torch.empty(shape, dtype=first.dtype)

    @staticmethod
    def _kind(t: Weight) -> tuple:
        if isinstance(t, QuantizedWeight):
            return t.format, t.block, t.scale.dtype
        return ("plain", t.dtype)

    @staticmethod
    def _describe(kind: tuple) -> str:
        if kind[0] == "plain":
            return str(kind[1]).removeprefix("torch.")
        return f"{kind[0]} {kind[1][0]}x{kind[1][1]} with {str(kind[2]).removeprefix('torch.')} scales"

    def put(self, name: str, j: int, half: int | None, t: Weight) -> None:
        if self._kind(t) != self.kind:
            raise CheckpointError(f"{name}: stored as {self._describe(self._kind(t))}, the stack's other experts "
                                  f"as {self._describe(self.kind)}: one stack needs one format")
        lo = (half or 0) * self.rows
        if isinstance(t, QuantizedWeight):
            b0 = self.block[0]
            t = t.refine(b0)
            self.data[j, lo:lo + self.rows] = t.data
            self.scale[j, lo // b0:lo // b0 + t.scale.shape[0]] = t.scale
        else:
            self.data[j, lo:lo + self.rows] = t

    def result(self) -> Weight:
        if self.kind[0] == "plain":
            return self.data
        return QuantizedWeight(self.data, self.scale, self.kind[0], self.block)


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
    # A step reads a few scattered rows: no read-around. Without this hint each row a lookup faults in
    # brings read_ahead_kb of the file into the page cache (8 MB here) and maps ~64 KB around it
    # (measured on a cold 4.4 GB Engram table: ~70 KB resident per row touched, 4.4 KB with the hint).
    if hasattr(mmap, "MADV_RANDOM") and hasattr(raw, "_mmap") and raw._mmap is not None:
        raw._mmap.madvise(mmap.MADV_RANDOM)
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


def _resolve(name: str, expected, names) -> Destination | None:
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
                    keep_prefixes=(), skip_prefixes=(), subset: bool = False) -> tuple[dict[str, Weight], dict[str, Weight]]:
    """Returns (weights, extra). `weights` has exactly the keys of `expected` (the model's names),
    each with the expected shape, in the format the module doc describes; fused expert stacks
    [E, N, K] are assembled from per-expert tensors where the checkpoint has those. `names` (the
    model class) resolves other spellings: `checkpoint_name(name) -> Destination | None` and, for error
    messages, `checkpoint_source(name, part) -> str | None`. `extra` holds the tensors whose names
    start with one of keep_prefixes (e.g. upstream `mtp.*` drafter stages), unrenamed: quantized
    weights as they are, matrices in their stored dtype, vectors float32, integer tables int64.
    Tensors whose names start with one of skip_prefixes (and their scales) are not read. `subset`:
    `expected` is a part of the checkpoint (an encoder worker's tower), the other tensors are not read."""
    model_dir = Path(model_dir)
    where = _weight_map(model_dir)
    block = _block_size(model_dir)
    scales = _pair_scales(where.keys(), expected, names)
    scale_names = set(scales.values())

    weights: dict[str, Weight] = {}
    stacks: dict[str, _ExpertStack] = {}
    extra: dict[str, Weight] = {}
    source: dict[tuple[str, int | None, int | None], str] = {}  # (model name, expert, half) -> checkpoint name
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, framework="pt")) for p in dict.fromkeys(where.values())}
        readers: dict[Path, safe_open] = {}

        def read(name: str, copied: bool = False) -> torch.Tensor:
            """A view of the file's mapping, or, `copied` (an expert's slice, copied into its stack),
            read into memory of its own (module doc: Memory)."""
            path = where[name]
            if not copied:
                return handles[path].get_tensor(name)
            if path not in readers:
                readers[path] = stack.enter_context(safe_open(path, framework="pt", backend="pread"))
            return readers[path].get_tensor(name)

        # File by file, so each shard is read once, front to back.
        for name in sorted(where.keys() - scale_names, key=lambda n: (str(where[n]), n)):
            if skip_prefixes and name.startswith(tuple(skip_prefixes)):
                continue
            if name.startswith(tuple(keep_prefixes)):
                extra[name] = _extra(name, read(name), read(scales[name]) if name in scales else None, block)
                continue
            slot = _resolve(name, expected, names)
            if subset and (slot is None or slot[0] not in expected):
                continue
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
            if key in source or (hf, None, None) in source or (part is None and (hf in weights or hf in stacks)):
                raise CheckpointError(f"{name}: {hf} is also loaded from {source.get(key, 'another tensor')}")
            source[key] = name
            spec = expected[hf]
            copied = part is not None
            scale = read(scales[name], copied) if name in scales else None
            t = _convert(name, read(name, copied), scale, spec, block)
            if part is None:
                _check_shape(name, tuple(t.shape), spec.shape)
                weights[hf] = t
                continue
            # One expert's slice of the fused [E, 2I, D] / [E, D, I] tensor, filled in place.
            j, half = part
            if j >= spec.shape[0]:
                raise CheckpointError(f"unexpected tensor {name}: expert {j}, but the model has {spec.shape[0]} experts")
            rows = spec.shape[1] // 2 if half is not None else spec.shape[1]
            _check_shape(name, tuple(t.shape), (rows, spec.shape[2]))
            if hf not in stacks:
                stacks[hf] = _ExpertStack(name, spec.shape, t, half is not None)
            stacks[hf].put(name, j, half, t)
    weights.update({hf: s.result() for hf, s in stacks.items()})
    _check_complete(expected, weights, source, names)
    return weights, extra


def _check_shape(name: str, found: tuple[int, ...], want: tuple[int, ...]) -> None:
    if found != tuple(want):
        raise CheckpointError(f"{name}: expected shape {tuple(want)}, found {found}")


def _check_complete(expected, weights, source, names) -> None:
    describe = names.checkpoint_source if names is not None else lambda name, part=None: None
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
