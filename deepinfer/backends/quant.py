"""Quantized weights: a checkpoint's packed values and block scales as one object the ops take.

The loader returns a `QuantizedWeight` for every tensor a checkpoint stores quantized, and the weight
ops of backends/base.py (linear, grouped_linear, swiglu_mlp, moe_experts) take it wherever they take
a float weight. Backends keep it as loaded (`prepare_weight` may move it to the device, never widen
it) and widen one block at a time in registers; `dequantize()` is the reference every kernel is
tested against (backends/reference.py computes with it).

    value[..., n, k] = decode(data)[..., n, k] * scale[..., n // block[0], k // block[1]]

| format   | data                                        | block     | scales            | used by                   |
|----------|---------------------------------------------|-----------|-------------------|---------------------------|
| FP8      | float8_e4m3fn [..., N, K]                   | (128, 128)| float32 or ue8m0  | V3, V4 dense weights      |
|          |                                             | (32, 32)  | ue8m0             | V4.1 dense weights        |
| FP4      | uint8 [..., N, K/2]: e2m1 codes, two a byte,| (1, 32)   | ue8m0             | V4, V4.1 routed experts   |
|          | element 2i in the low nibble of byte i      |           |                   |                           |

Scales are [..., ceil(N / block[0]), ceil(K / block[1])] (edge tiles may be partial): float32, or
ue8m0 (E8M0: an exponent only, 2^(e - 127)) held as its bytes (uint8; a checkpoint's
float8_e8m0fnu is viewed as uint8). Leading dims (an [E, N, K] stack of experts) are allowed.

Activations. `act` says how the GEMM quantizes its input when that is part of the model's own
numerics (DeepSeek-V4.1: every GEMM with a quantized weight first quantizes its input to e4m3 per
1 x 32 group with power-of-two scales, `ActQuant(32)`); every backend then applies it
(`act_quant` below is the reference). `act=None` (V3, V4) is weight-only: the cpu backend computes
with float32 activations, so a quantized model's tokens equal those of its weights dequantized; an
FP8 tensor-core GEMM (nvidia) may still quantize activations per 1 x block[1] group as its own
business, within the bound its tests state.

Fusing along N (`QuantizedWeight.cat`, `rows`): a part boundary that is not on a block edge
refines the row block to the gcd of the boundaries (scales repeated, values exact), so
projections fuse whatever their sizes; the scale bytes grow, the weight bytes do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FP8", "FP4", "ActQuant", "QuantizedWeight", "Weight", "act_quant", "quantize_fp8", "quantize_fp4",
           "e8m0_to_float", "fuse_rows", "cat_rows", "with_act", "stack", "scale_weight", "widen", "E2M1_VALUES", "FP8_MAX", "FP4_MAX"]

FP8 = "fp8_e4m3"
FP4 = "fp4_e2m1"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
FP4_GROUP = 32  # inputs per FP4 scale
# e2m1 by 4-bit code: bit 3 is the sign, bits 0-2 index the magnitude
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
_AMAX_FLOOR = 1e-4  # DeepSeek's act_quant guard: an all-zero group gets a finite scale


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """ue8m0 exponent bytes (uint8) -> float32 2^(e - 127); float32 scales pass through."""
    if s.dtype == torch.uint8:
        return torch.exp2(s.float() - 127)
    return s.float()


@dataclass(frozen=True, slots=True)
class ActQuant:
    """Activation quantization that is part of a model's numerics: the input of a GEMM is quantized
    to e4m3 per 1 x `block` group along K, scale max(amax, 1e-4) / 448 (`pow2`: rounded up to a
    power of two as DeepSeek's fast_round_scale, amax * float32(1/448) then ceil(log2)), and the
    GEMM multiplies the dequantized values."""

    block: int
    pow2: bool = True


def act_quant(x: torch.Tensor, act: ActQuant) -> torch.Tensor:
    """x [..., K] -> float32 [..., K]: x quantized per `act` and dequantized (the reference). A
    last, partial group of K is its own group."""
    k = x.shape[-1]
    pad = -k % act.block
    xg = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, act.block))
    amax = xg.abs().amax(-1, keepdim=True).clamp(min=_AMAX_FLOOR)
    if act.pow2:  # 2^ceil(log2(amax * (1/448))) from the float32 bits, exactly as DeepSeek's kernels
        # a Python scalar multiplies a float32 tensor as float32(1/448); a tensor made here would be a
        # host value inside a captured step (core/graphs.py) and a host-to-device copy per call
        bits = (amax * (1 / FP8_MAX)).view(torch.int32)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        s = (exp << 23).view(torch.float32)
    else:
        s = amax / FP8_MAX
    q = (xg / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).flatten(-2)[..., :k]


@dataclass(frozen=True, eq=False, slots=True)
class QuantizedWeight:
    """A quantized [..., N, K] weight (module doc): packed `data`, `scale` per `block` tile,
    `format` FP8 or FP4, and the model's activation quantization `act` (None: weight-only)."""

    data: torch.Tensor
    scale: torch.Tensor
    format: str
    block: tuple[int, int]
    act: ActQuant | None = None

    def __post_init__(self) -> None:
        data, scale = self.data, self.scale
        if scale.dtype == torch.float8_e8m0fnu:
            object.__setattr__(self, "scale", scale := scale.view(torch.uint8))
        if self.format == FP4 and data.dtype != torch.uint8 and data.element_size() == 1:
            object.__setattr__(self, "data", data := data.view(torch.uint8))  # int8 / float4_e2m1fn_x2 on disk
        want = {FP8: torch.float8_e4m3fn, FP4: torch.uint8}.get(self.format)
        if want is None:
            raise ValueError(f"unknown quantized format {self.format!r}: expected {FP8!r} or {FP4!r}")
        if data.dtype != want or data.dim() < 2:
            raise ValueError(f"{self.format} data must be {want} [..., N, K{'/2' if self.format == FP4 else ''}], "
                             f"got {data.dtype} {tuple(data.shape)}")
        if scale.dtype not in (torch.float32, torch.uint8):
            raise ValueError(f"scales must be float32 or ue8m0 (float8_e8m0fnu / uint8 exponent bytes), got {scale.dtype}")
        b0, b1 = self.block
        if b0 < 1 or b1 < 1 or (self.format == FP4 and b1 % 2):
            raise ValueError(f"block {self.block} must be positive (an even K block for {FP4})")
        if tuple(scale.shape) != self.grid:
            raise ValueError(f"{self.format} weight {tuple(self.shape)} with {b0}x{b1} blocks expects scale shape "
                             f"{self.grid}, found {tuple(scale.shape)}")

    # ---------------------------------------------------------------- what it is
    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] shape (FP4 holds K/2 bytes per row)."""
        *lead, n, k = self.data.shape
        return (*lead, n, 2 * k if self.format == FP4 else k)

    @property
    def grid(self) -> tuple[int, ...]:
        *lead, n, k = self.shape
        return (*lead, _cdiv(n, self.block[0]), _cdiv(k, self.block[1]))

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype of the values (float8_e4m3fn, or uint8 for packed FP4)."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dim(self) -> int:
        return self.data.dim()

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return True  # real-valued, like a float weight (integer tables are the other kind)

    def __repr__(self) -> str:
        scale = "ue8m0" if self.scale.dtype == torch.uint8 else "float32"
        return (f"QuantizedWeight({self.format}, shape={self.shape}, block={self.block}, {scale} scales"
                f"{f', act={self.act}' if self.act else ''}, device={self.device})")

    # ---------------------------------------------------------------- the reference
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[..., N, K] values in `dtype` (float32 is exact)."""
        *_, n, k = self.shape
        b0, b1 = self.block
        if self.format == FP8:
            vals = self.data.float()
        else:
            u = self.data.long()
            vals = torch.stack([E2M1_VALUES.to(self.device)[u & 0xF], E2M1_VALUES.to(self.device)[u >> 4]], -1).flatten(-2)
        s = e8m0_to_float(self.scale).repeat_interleave(b0, -2)[..., :n, :].repeat_interleave(b1, -1)[..., :k]
        return (vals * s).to(dtype)

    # ---------------------------------------------------------------- moving and reshaping
    def _with(self, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> "QuantizedWeight":
        return QuantizedWeight(data, scale, self.format, block or self.block, self.act)

    def to(self, device) -> "QuantizedWeight":
        return self._with(self.data.to(device), self.scale.to(device))

    def contiguous(self) -> "QuantizedWeight":
        return self._with(self.data.contiguous(), self.scale.contiguous())

    def __getitem__(self, index) -> "QuantizedWeight":
        """Index the leading (expert) dims, e.g. `stack[ids]` for some experts of an [E, N, K] stack."""
        if self.data.dim() < 3:
            raise IndexError("only the leading dims of a stacked [..., N, K] quantized weight can be indexed")
        return self._with(self.data[index], self.scale[index])

    def gather_rows(self, ids: torch.Tensor) -> "QuantizedWeight":
        """Rows `ids` of a 2-D weight as an [len(ids), K] weight (an embedding lookup)."""
        return QuantizedWeight(self.data[ids], self.scale[ids // self.block[0]], self.format, (1, self.block[1]),
                               self.act)

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Rows [start, stop) along N (a start off the block edge refines the row block)."""
        w = self.refine(math.gcd(self.block[0], start))
        b0 = w.block[0]
        return self._with(self.data[..., start:stop, :], w.scale[..., start // b0:_cdiv(stop, b0), :].contiguous(),
                          w.block)

    def reorder_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """Rows in the order `index` (a permutation of N), exact: the row block becomes the largest
        divisor b of block[0] such that each new b-row block comes from one old block, whose scales
        it takes along."""
        n = self.shape[-2]
        for b in (b for b in range(self.block[0], 0, -1) if self.block[0] % b == 0):
            src = index // b
            first = src[::b]  # the old block of each new one
            if torch.equal(src, first.repeat_interleave(b)[:n]):
                w = self.refine(b)
                return self._with(self.data[..., index, :], w.scale[..., first, :].contiguous(), w.block)
        raise AssertionError("unreachable: b = 1 always holds")

    def refine(self, b0: int) -> "QuantizedWeight":
        """The same values on a row block b0 that divides block[0] (each row of scales repeated)."""
        if self.block[0] % b0:
            raise ValueError(f"refine: row block {b0} does not divide {self.block[0]}")
        if b0 == self.block[0]:
            return self
        n = self.shape[-2]
        scale = self.scale.repeat_interleave(self.block[0] // b0, -2)[..., :_cdiv(n, b0), :]
        return self._with(self.data, scale.contiguous(), (b0, self.block[1]))

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Concatenate along N (fused projections). Parts must share format, K, column block,
        scale kind and `act`; the row block becomes the gcd of it and every part boundary."""
        first = parts[0]
        for p in parts[1:]:
            if (p.format, p.shape[:-2], p.shape[-1], p.block[1], p.scale.dtype, p.act) != \
                    (first.format, first.shape[:-2], first.shape[-1], first.block[1], first.scale.dtype, first.act):
                raise ValueError(f"cannot concatenate {p!r} to {first!r}: format, K, column block, scale kind and act "
                                 "must agree")
        offsets = [0]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + p.shape[-2])
        b0 = math.gcd(*[p.block[0] for p in parts], *offsets)
        scale = torch.cat([p.refine(b0).scale for p in parts], dim=-2)
        return QuantizedWeight(torch.cat([p.data for p in parts], dim=-2), scale, first.format,
                               (b0, first.block[1]), first.act)

    def scaled(self, factor: float) -> "QuantizedWeight":
        """The weight times a power of two (exact: only the scales change)."""
        m, e = math.frexp(factor)
        if m != 0.5:
            raise ValueError(f"scaled: {factor} is not a power of two")
        if self.scale.dtype == torch.uint8:
            return self._with(self.data, (self.scale.int() + (e - 1)).clamp(0, 254).to(torch.uint8))
        return self._with(self.data, self.scale * factor)


# ------------------------------------------------------------------------ quantizers (tests, synthetic checkpoints)

def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128), ue8m0: bool = False,
                 act: ActQuant | None = None) -> QuantizedWeight:
    """[..., N, K] float -> FP8 with one scale per block tile: amax / 448 (ue8m0: rounded up to a
    power of two, as DeepSeek's checkpoints)."""
    *lead, n, k = w.shape
    b0, b1 = block
    rb, cb = _cdiv(n, b0), _cdiv(k, b1)
    tiled = torch.nn.functional.pad(w.float(), (0, cb * b1 - k, 0, rb * b0 - n)).view(*lead, rb, b0, cb, b1)
    s = tiled.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
    if ue8m0:
        s = _pow2_ceil(s)
    q = (tiled / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    data = q.view(*lead, rb * b0, cb * b1)[..., :n, :k].contiguous()
    scale = s.to(torch.float8_e8m0fnu).view(torch.uint8) if ue8m0 else s
    return QuantizedWeight(data, scale, FP8, block, act)


def quantize_fp4(w: torch.Tensor, act: ActQuant | None = None) -> QuantizedWeight:
    """[..., N, K] float (K even) -> FP4 e2m1 with one power-of-two scale per 32 inputs (amax / 6
    rounded up; a last partial group of its own), codes rounded to the nearest e2m1 value (ties to
    the even code)."""
    *lead, n, k = w.shape
    if k % 2:
        raise ValueError(f"quantize_fp4: K={k} must be even (two values a byte)")
    g = torch.nn.functional.pad(w.float(), (0, -k % FP4_GROUP)).unflatten(-1, (-1, FP4_GROUP))
    s = _pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -120) / FP4_MAX)
    x = (g / s).clamp(-FP4_MAX, FP4_MAX)
    grid = E2M1_VALUES[:8]
    dist = (x.abs().unsqueeze(-1) - grid).abs()
    # nearest magnitude; at a tie the even code (the argmin over reversed-parity preference)
    mag = (dist + (torch.arange(8) % 2) * 1e-7).argmin(-1)
    code = (mag | (torch.signbit(x).long() << 3)).flatten(-2)[..., :k]
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scale = s.squeeze(-1).to(torch.float8_e8m0fnu).view(torch.uint8)
    return QuantizedWeight(packed, scale, FP4, (1, FP4_GROUP), act)


# ------------------------------------------------------------------------ weights of either kind

Weight = torch.Tensor | QuantizedWeight


def _storage(w: Weight) -> tuple:
    """What two weights must share to be concatenated along N."""
    if isinstance(w, QuantizedWeight):
        return (w.format, w.shape[-1], w.block[1], w.scale.dtype, w.act)
    return ("plain", w.shape[-1], w.dtype)


def fuse_rows(parts: list[Weight]) -> list[Weight]:
    """Weights [N_i, K] concatenated along N wherever consecutive ones are stored alike (plain
    tensors of one dtype, or quantized ones `QuantizedWeight.cat` takes): the runs in order, one
    GEMM each. A checkpoint that stores a model's fused projections alike gives one."""
    runs: list[list[Weight]] = []
    for p in parts:
        if runs and _storage(runs[-1][-1]) == _storage(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return [QuantizedWeight.cat(r) if isinstance(r[0], QuantizedWeight) else torch.cat(r) for r in runs]


def cat_rows(parts: list[Weight], what: str) -> Weight:
    """Weights [N_i, K] as one [sum N_i, K] in their storage (fuse_rows), which needs them stored
    alike; a ValueError naming `what` otherwise (e.g. an FP8 w1 beside a bf16 w3)."""
    fused = fuse_rows(parts)
    if len(fused) != 1:
        raise ValueError(f"{what}: the parts are stored differently ({', '.join(map(_describe, parts))}); "
                         "fusing them needs one storage")
    return fused[0]


def _describe(w: Weight) -> str:
    return repr(w) if isinstance(w, QuantizedWeight) else f"{w.dtype} {tuple(w.shape)}"


def with_act(w: Weight, act: ActQuant) -> Weight:
    """An FP8 weight carrying the model's activation quantization `act` (every backend's weight ops
    then quantize its inputs first); other weights as they are."""
    if isinstance(w, QuantizedWeight) and w.format == FP8:
        return QuantizedWeight(w.data, w.scale, w.format, w.block, act)
    return w


def stack(parts: list[Weight]) -> Weight:
    """[N, K] weights stored alike -> an [E, N, K] stack (experts)."""
    if isinstance(parts[0], QuantizedWeight):
        first = parts[0]
        if any(_storage(p) != _storage(first) or p.block != first.block or p.shape != first.shape for p in parts):
            raise ValueError(f"stack: experts stored unlike {first!r}")
        return QuantizedWeight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]),
                               first.format, first.block, first.act)
    return torch.stack(parts)


def reorder_rows(w: Weight, index: torch.Tensor) -> Weight:
    """w's rows in the order `index` (a permutation), in w's own storage."""
    return w.reorder_rows(index) if isinstance(w, QuantizedWeight) else w[..., index, :]


def widen(w: Weight) -> torch.Tensor:
    """A weight of either kind as float32 (the reference's view of it)."""
    return w.dequantize() if isinstance(w, QuantizedWeight) else w.float()


def scale_weight(w: Weight, factor: float) -> Weight:
    """w * factor for a power of two `factor`, exact, in w's own storage."""
    if isinstance(w, QuantizedWeight):
        return w.scaled(factor)
    if math.frexp(factor)[0] != 0.5:
        raise ValueError(f"scale_weight: {factor} is not a power of two")
    return w * factor
