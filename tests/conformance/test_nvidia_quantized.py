"""The nvidia backend's weight ops on stored weights, through the Triton interpreter (conftest sets
TRITON_INTERPRET=1), against float32 math on the dequantized weight. Per-element bounds from the
formats (tests/quant_checks.py); K and N off the block edges; outputs poisoned with NaN.

| path                                   | reference                                   | bound                    |
|----------------------------------------|---------------------------------------------|--------------------------|
| linear / grouped_linear, FP8 weights   | act_quant(x) @ dequant(w).T (the same math) | float32 rounding order   |
|   (DeepSeek's FP8 GEMM, act per 1x128) | x @ dequant(w).T (weight-only)              | e4m3 rounding of x       |
| linear, bf16 / f16 weights             | x @ w.float().T                             | float32 rounding order   |
| moe_experts, FP4 / FP8 / bf16 stacks   | reference moe on the dequantized stacks     | 1e-5 x max|ref|          |
| moe_experts_bf16 (V4.1), every stack   | base.py's composite on the reference ops    | op_checks (measured: =)  |

The second FP8 row is the activation-quantization error docs/checkpoint-loading.md bounds: printed with -s
(`pytest -s tests/conformance/test_nvidia_quantized.py -k act_quant_error`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the nvidia backend's kernels cannot run")

from deepinfer.backends import reference as ref  # noqa: E402
from deepinfer.backends.quant import ActQuant, QuantizedWeight, act_quant, quantize_fp8  # noqa: E402
from op_checks import MOE_BF16_KINDS, assert_close, check_moe_experts_bf16, poisoned  # noqa: E402
from quant_checks import act_quant_bound, assert_within, dot_bound, moe_case, weight_kinds, widened  # noqa: E402

SHAPES = [(130, 258), (40, 96), (17, 40)]


@pytest.fixture(scope="module")
def nv():
    yield from poisoned("nvidia")


def _case(n, k, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1 * torch.logspace(0, -2, n)[:, None]
    return weight_kinds(w, fp4=False)[kind]


def _x(t, k, seed):
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-1, 1, k)


def _act_block(w: QuantizedWeight) -> ActQuant:
    return ActQuant(w.block[1], pow2=w.act.pow2 if w.act else False)


@pytest.mark.parametrize("kind", ["fp8_128_f32", "fp8_32_ue8m0", "fp8_fused_rows", "fp8_32_fused_rows"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("t", [1, 7])
def test_fp8_linear(nv, kind, n, k, t):
    w = _case(n, k, kind, n + k)
    x = _x(t, k, t)
    out = nv.linear(x.to(nv.device), w.to(nv.device))
    xq, wd = act_quant(x, _act_block(w)), widened(w)
    assert_within(f"fp8 linear {kind} T={t} N={n} K={k} (vs act-quantized)", out, xq @ wd.T, dot_bound(xq, wd))
    assert_within(f"fp8 linear {kind} T={t} N={n} K={k} (vs weight-only)", out, x @ wd.T,
                  act_quant_bound(x, wd, w.block[1]))


def test_fp8_linear_power_of_two_activation_scales(nv):
    """A weight whose model quantizes activations itself (V4.1's ActQuant(32)): the kernel's scales
    are the reference's powers of two, bit for bit, so only rounding order differs."""
    w = quantize_fp8(torch.randn(70, 96) * 0.1, (32, 32), ue8m0=True, act=ActQuant(32))
    x = _x(5, 96, 3)
    xq = act_quant(x, ActQuant(32))
    assert_within("fp8 linear pow2 act", nv.linear(x, w), xq @ w.dequantize().T, dot_bound(xq, w.dequantize()))


@pytest.mark.parametrize("kind", ["fp8_32_ue8m0", "fp8_32_fused_rows"])
def test_v41_weights_quantize_as_the_model_would(nv, kind):
    """DeepSeek-V4.1's FP8 GEMM (models/deepseek_v41/numerics.py): a stored 32x32 ue8m0 weight with
    ActQuant(32) on bf16 inputs equals the model quantizing the input itself (the reference's fp8_qdq,
    bit-exact to DeepSeek's act_quant) times the dequantized weight, up to rounding order."""
    from deepinfer.backends import reference
    from deepinfer.backends.quant import with_act

    w = with_act(_case(130, 96, kind, 12), ActQuant(32))
    x = (_x(5, 96, 4) * 0.1).bfloat16().float()
    xq, wd = reference.fp8_qdq(x, 32), widened(w)
    assert_within(f"v41 fp8 linear {kind}", nv.linear(x.to(nv.device), w.to(nv.device)), xq @ wd.T, dot_bound(xq, wd))


@pytest.mark.parametrize("kind", ["fp8_128_f32", "fp8_32_ue8m0", "bf16"])
def test_grouped_linear(nv, kind):
    g, n, k = 4, 24, 72
    w = _case(g * n, k, kind, 3)
    x = torch.randn(5, g, k, generator=torch.Generator().manual_seed(4))
    out = nv.grouped_linear(x, w)
    wd = widened(w).view(g, n, k)
    for gi in range(g):
        xi = act_quant(x[:, gi], _act_block(w)) if isinstance(w, QuantizedWeight) else x[:, gi]
        assert_within(f"grouped_linear {kind} group {gi}", out[:, gi], xi @ wd[gi].T, dot_bound(xi, wd[gi]))


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("t", [1, 7])
def test_plain_narrow_linear(nv, kind, t):
    w = _case(130, 258, kind, 5)
    x = _x(t, 258, 6)
    assert_within(f"linear {kind} T={t}", nv.linear(x, w), x @ widened(w).T, dot_bound(x, widened(w)))
    assert_close("embedding bf16", nv.embedding(torch.tensor([3, 0, 129]), w), w[[3, 0, 129]].float(), 0.0)


@pytest.mark.parametrize("kind", ["fp4_ue8m0", "fp4_f32_scales", "fp8_128_f32", "fp8_32_ue8m0", "bf16"])
@pytest.mark.parametrize("t", [1, 9])
def test_moe_experts(nv, kind, t):
    """Routed experts stay as stored (FP4 e2m1 two a byte, FP8 block-scaled, bf16): the MoE GEMMs
    widen each weight tile in registers."""
    x, weights, ids, gu, dn = moe_case(kind, t)
    out = nv.moe_experts(x, weights, ids, nv.prepare_weight(gu), nv.prepare_weight(dn), 7.0)
    assert_close(f"moe_experts {kind} T={t}", out, ref.moe_experts(x, weights, ids, widened(gu), widened(dn), 7.0),
                 1e-5)


@pytest.mark.parametrize("kind", MOE_BF16_KINDS)
@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("act_block", [0, 32])
def test_moe_experts_bf16(nv, kind, t, act_block):
    """DeepSeek-V4.1's routed experts (moe_experts_bf16): the MoE kernels with its rounding points and
    the fp8_qdq kernel, against base.py's composite (tests/op_checks.py: tolerance; measured equal)."""
    check_moe_experts_bf16(nv, kind, t, act_block)


def test_moe_tile_schedule_has_fixed_shapes(nv):
    """The MoE kernels' tile schedule is a function of the call's shapes only (no host read, no
    data-shaped op: a CUDA graph captures it, core/graphs.py records it), and covers every slot once:
    routings that hit 1 expert or all of them give the same tensor shapes."""
    from deepinfer.backends.triton.gemm import _tile_schedule

    shapes = set()
    for ids in (torch.zeros(40, dtype=torch.int64), torch.arange(40) % 8, torch.tensor([3] * 33 + [5] * 7)):
        expert, start, end = _tile_schedule(ids.sort().values, 8, 32)
        shapes.add((expert.shape, start.shape, end.shape))
        covered = torch.zeros(40, dtype=torch.int64)
        for e, a, b in zip(expert.tolist(), start.tolist(), end.tolist()):
            b = min(b, a + 32)  # a tile runs slots [start, start + 32) below its expert's end
            assert a == b or bool((ids.sort().values[a:b] == e).all())
            covered[a:b] += 1
        assert bool((covered == 1).all())
    assert len(shapes) == 1


def test_v41_experts_record_with_fixed_shapes(nv):
    """moe_experts_bf16 with FP8 inputs (and so fp8_qdq) on this backend reads nothing into Python and
    runs no data-shaped op: core/graphs.py records it, the precondition of capturing a V4.1 decode step
    in a CUDA graph (before: the experts were a host call, the tile schedule a unique_consecutive and
    fp8_qdq made a tensor per call)."""
    from deepinfer.core.graphs import record
    from op_checks import moe_bf16_case

    x, weights, ids, gu, dn = moe_bf16_case("fp4_ue8m0", 5)
    gu, dn = nv.prepare_weight(gu), nv.prepare_weight(dn)
    recording, failure, out = record(lambda: nv.moe_experts_bf16(x, weights, ids, gu, dn, 1.5, 32), [x, weights, ids])
    assert recording is not None, failure
    assert not out.isnan().any()


def test_act_quant_error(nv):
    """What DeepSeek's activation quantization costs on the nvidia FP8 path, measured against
    weight-only float32 math at a V4-like shape (docs/checkpoint-loading.md: activations quantized per 1x128)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(16, 1024, generator=gen)
    w = quantize_fp8(torch.randn(512, 1024, generator=gen) * 0.02, ue8m0=True)
    exact = x @ w.dequantize().T
    out = nv.linear(x, w)
    rel_max = float((out - exact).abs().max() / exact.abs().max())
    rel_rms = float((out - exact).square().mean().sqrt() / exact.square().mean().sqrt())
    print(f"\nFP8 activation quantization vs weight-only: max {rel_max:.4f}, rms {rel_rms:.4f} (relative)", end="")
    assert 1e-4 < rel_rms < 0.03 and rel_max < 0.06


@pytest.mark.slow
def test_v4_with_stored_weights_within_the_fp8_bound():
    """The tiny V4 stored as V4-Flash stores it (FP4 experts, FP8 dense projections, bf16 router /
    head) on the nvidia backend, whose dense FP8 GEMMs quantize activations (DeepSeek's numerics).
    The bound that quantization implies is measured on its definition, the cpu model whose FP8
    weights quantize their inputs the same way (ActQuant(128), float32 scales), against the
    weight-only float32 model: the nvidia logits must stay within 1.5x that effect (+1e-4 x
    max|logit|), and the greedy token must agree wherever the top-2 gap exceeds twice the nvidia
    deviation. On these random tiny models the effect is large (printed; routing and the indexer's
    top-k turn small changes into discrete ones); the op-level figure is test_act_quant_error's."""
    pytest.importorskip("transformers", reason="transformers builds the tiny models")
    from deepinfer.backends import get_accelerator
    from deepinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
    from model_runner import new_cache, run_schedule
    from quant_checks import dequantized, flash_layout
    from tiny_models import make_hf_model

    hf, hfc = make_hf_model("mixed_hc4_yarn", seed=5)
    cfg = DeepseekV4Config.from_dict(hfc.to_dict())
    stored = flash_layout(hf.state_dict(), DeepseekV4Model.checkpoint_tensors(cfg))
    act = {k: QuantizedWeight(v.data, v.scale, v.format, v.block, ActQuant(v.block[1], pow2=False))
           if isinstance(v, QuantizedWeight) and v.format == "fp8_e4m3" else v for k, v in stored.items()}
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen) for n in (40, 6)]
    steps = [[(0, 33), (1, 6)], [(0, 7)]]
    outs = {}
    for label, accel, weights in (("nvidia", "nvidia", stored), ("act_quant", "cpu", act),
                                  ("weight_only", "cpu", dequantized(stored))):
        model = DeepseekV4Model(cfg, dict(weights), get_accelerator(accel))
        outs[label] = [o.cpu() for o in run_schedule(model, new_cache(model), prompts, steps)]
    for seq, (nv, aq, wo) in enumerate(zip(outs["nvidia"], outs["act_quant"], outs["weight_only"])):
        scale = float(wo.abs().max())
        effect, total = float((aq - wo).abs().max()), float((nv - wo).abs().max())
        print(f"\nseq {seq}: activation quantization moves the cpu logits by {effect / scale:.2e} x max|logit|, "
              f"the nvidia FP8 path by {total / scale:.2e}", end="")
        assert total <= 1.5 * effect + 1e-4 * scale
        top2 = wo.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * total
        assert torch.equal(nv.argmax(-1)[clear], wo.argmax(-1)[clear])
