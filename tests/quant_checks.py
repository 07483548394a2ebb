"""Shared cases of the quantized-weight op tests (cpu kernels, nvidia through the Triton interpreter,
ascend through the shim): every storage kind a weight op takes, and the per-element bounds the
formats imply.

Bounds. Decoding a stored weight is exact, so an op on it differs from float32 math on the
dequantized weight only by rounding order: |y - ref| <= 2 (K + 2) u sum_k |x_k w_k|, u = 2^-24
(the classic bound for a K-term float32 dot product, with a factor 2 of margin). An FP8 GEMM that
quantizes its activations to e4m3 (nvidia's dense path) adds each input's rounding:
|x_k - q_k| <= 2^-4 |x_k| (3 mantissa bits) + 2^-10 s (half the subnormal step of its group's scale s),
so |y - ref| <= sum_k |w_k| (2^-4 |x_k| + 2^-10 s_k) + the rounding term.
"""

from __future__ import annotations

import torch

from deepinfer.backends.quant import QuantizedWeight, quantize_fp4, quantize_fp8

U = 2.0 ** -24


def weight_kinds(w: torch.Tensor, fp4: bool = True) -> dict[str, object]:
    """A float [..., N, K] weight in every storage a weight op takes (same values where exact)."""
    n = w.shape[-2]
    out = {
        "bf16": w.bfloat16(),
        "f16": w.half(),
        "fp8_128_f32": quantize_fp8(w, (128, 128)),
        "fp8_32_ue8m0": quantize_fp8(w, (32, 32), ue8m0=True),
    }
    if w.dim() == 2 and n > 8:  # a fused projection off the block edge: row block refined
        cut = n // 3
        out["fp8_fused_rows"] = QuantizedWeight.cat([quantize_fp8(w[:cut], ue8m0=True), quantize_fp8(w[cut:], ue8m0=True)])
        # V4.1's 32x32 tiles fused off the block edge (shared expert w1 / w3 of an odd size): row block refined
        out["fp8_32_fused_rows"] = QuantizedWeight.cat([quantize_fp8(w[:cut], (32, 32), ue8m0=True),
                                                        quantize_fp8(w[cut:], (32, 32), ue8m0=True)])
    if fp4 and w.shape[-1] % 2 == 0:
        out["fp4_ue8m0"] = quantize_fp4(w)
        q = quantize_fp4(w)
        out["fp4_f32_scales"] = QuantizedWeight(q.data, torch.exp2(q.scale.float() - 127), q.format, q.block)
    return out


def moe_case(kind: str, t: int, e: int = 6, d: int = 64, i: int = 48, k: int = 2, seed: int = 8):
    """A routed-experts problem: tokens x [t, d], routing weights and expert ids [t, k] (distinct per
    token), and stored weights of `kind`: gate_up [e, 2i, d], down [e, d, i]."""
    gen = torch.Generator().manual_seed(seed)
    gu = weight_kinds(torch.randn(e, 2 * i, d, generator=gen) * 0.1)[kind]
    dn = weight_kinds(torch.randn(e, d, i, generator=gen) * 0.1)[kind]
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    return x, weights, ids, gu, dn


def widened(w) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantizedWeight) else w.float()


def dot_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-element rounding-order bound of x [T, K] @ w [N, K].T in float32 (module doc)."""
    k = x.shape[-1]
    return 2 * (k + 2) * U * (x.abs().float() @ w.abs().float().T) + 1e-30


def act_quant_bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element bound of an FP8 GEMM that quantizes x per 1 x block group (module doc)."""
    k = x.shape[-1]
    pad = -k % block
    amax = torch.nn.functional.pad(x.abs().float(), (0, pad)).unflatten(-1, (-1, block)).amax(-1).clamp(min=1e-4)
    s = (amax / 448).repeat_interleave(block, -1)[..., :k]
    per_input = 2 ** -4 * x.abs().float() + 2 ** -10 * s
    return per_input @ w.abs().float().T + dot_bound(x, w)


def assert_within(name: str, out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """Every element within its bound; returns the worst |error| / bound (printed with -s)."""
    out = out.cpu().float()
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not out.isnan().any(), f"{name}: NaN in output"
    ratio = float(((out - ref).abs() / bound).max()) if out.numel() else 0.0
    print(f"\n{name}: worst |err| / bound {ratio:.3f}", end="")
    assert ratio <= 1.0, f"{name}: error exceeds the per-element bound ({ratio:.2f}x)"
    return ratio


# ------------------------------------------------------------------ a model stored as V4-Flash stores it

# Dense projections V4-Flash ships in FP8 (128x128 ue8m0); its compressor / indexer kv, gate and head
# weights ship in bf16 (transformers' _keep_in_fp32_modules note), like the router, embedding and head.
FP8_DENSE = ("q_a_proj", "q_b_proj", "self_attn.kv_proj", "o_a_proj", "o_b_proj", "indexer.q_b_proj",
             "shared_experts")


def is_fp8_dense(name: str) -> bool:
    return any(p in name for p in FP8_DENSE) and ("compressor" not in name or "q_b_proj" in name)


def flash_layout(state: dict, specs: dict, block=(128, 128)) -> dict:
    """A float state dict stored as V4-Flash stores its weights: routed experts FP4 e2m1 (per-32
    ue8m0 scales), dense projections FP8 e4m3 (block ue8m0 scales), the other weights a weight op
    reads in bf16, everything else as given."""
    out = {}
    for name, spec in specs.items():
        t = state[name]
        if spec.experts:
            out[name] = quantize_fp4(t)
        elif spec.stored and is_fp8_dense(name):
            out[name] = quantize_fp8(t, block, ue8m0=True)
        elif spec.stored:
            out[name] = t.bfloat16()
        else:
            out[name] = t
    return out


def dequantized(weights: dict) -> dict:
    """The same values, every floating tensor float32 (what the quantized model must reproduce)."""
    return {k: widened(v) if isinstance(v, QuantizedWeight) or v.is_floating_point() else v for k, v in weights.items()}


def save_upstream(weights: dict, path, source) -> None:
    """Write `weights` (model names, as flash_layout returns) in DeepSeek's upstream naming: quantized
    tensors as `X.weight` + `X.scale` (e8m0), experts split into per-expert w1 / w3 / w2. `source`
    maps a model name to its upstream name (weights.checkpoint_source)."""
    import re

    from safetensors.torch import save_file

    out = {}

    def put(name: str, w) -> None:
        if isinstance(w, QuantizedWeight):
            out[name] = w.data.view(torch.int8) if w.format == "fp4_e2m1" else w.data
            out[name.removesuffix(".weight") + ".scale"] = w.scale.view(torch.float8_e8m0fnu)
        else:
            out[name] = w.contiguous()

    for name, w in weights.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if m is None:
            put(source(name), w)
            continue
        layer, kind = m.groups()
        for j in range(w.shape[0]):
            e = w[j] if isinstance(w, QuantizedWeight) else w[j]
            if kind == "gate_up_proj":
                half = e.shape[0] // 2
                put(f"layers.{layer}.ffn.experts.{j}.w1.weight", e.rows(0, half) if isinstance(e, QuantizedWeight) else e[:half])
                put(f"layers.{layer}.ffn.experts.{j}.w3.weight",
                    e.rows(half, 2 * half) if isinstance(e, QuantizedWeight) else e[half:])
            else:
                put(f"layers.{layer}.ffn.experts.{j}.w2.weight", e)
    out = {k: v.contiguous() for k, v in out.items()}
    save_file(out, str(path / "model.safetensors"))
