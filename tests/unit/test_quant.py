"""deepinfer.backends.quant: the quantized weight type, its reference dequantization, fusing along N,
the quantizers and the activation quantization every backend applies when a model asks for it."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.quant import (FP4, FP8, ActQuant, QuantizedWeight, act_quant, quantize_fp4, quantize_fp8)


def test_fp8_dequantize_is_value_times_its_tile_scale():
    """Independent of the implementation: each element against its own tile's scale, partial edge tiles."""
    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(130, 257, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=gen) + 0.5
    w = QuantizedWeight(data, scale, FP8, (128, 128))
    out = w.dequantize()
    for n, k in [(0, 0), (127, 127), (128, 128), (129, 256), (5, 200)]:
        assert out[n, k] == data[n, k].float() * scale[n // 128, k // 128]
    assert w.shape == (130, 257) and w.nbytes == 130 * 257 + 6 * 4


def test_fp4_packing_even_element_in_low_nibble_and_e8m0_scales():
    codes = torch.tensor([[1, 15, 7, 8] + [0] * 28])  # 0.5, -6, 6, -0
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    w = QuantizedWeight(packed.view(torch.int8), torch.tensor([[128]], dtype=torch.uint8), FP4, (1, 32))
    assert w.data.dtype == torch.uint8 and w.shape == (1, 32)
    assert w.dequantize()[0, :4].tolist() == [1.0, -12.0, 12.0, -0.0]  # times 2^(128-127)
    e8m0 = torch.tensor([[0.25]]).to(torch.float8_e8m0fnu)
    assert QuantizedWeight(packed, e8m0, FP4, (1, 32)).dequantize()[0, 0] == 0.125


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantizers_round_within_the_format_step(ue8m0):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 70, 96, generator=gen)
    q = quantize_fp8(w, (32, 32), ue8m0=ue8m0)
    # e4m3: 3 mantissa bits, so |err| <= 2^-4 |w| for normals, plus half the subnormal step below
    s = q.dequantize() / q.data.float().where(q.data.float() != 0, torch.ones(1))
    assert ((q.dequantize() - w).abs() <= w.abs() * 2 ** -4 + s.abs() * 2 ** -10 + 1e-7).all()
    f = quantize_fp4(w)
    # e2m1 steps are 0.5 up to 2, 1 up to 4, 2 up to 6 (in scale units): |err| <= max(s/4, |w|/4)
    scale = torch.exp2(f.scale.float() - 127).repeat_interleave(32, -1)
    assert ((f.dequantize() - w).abs() <= torch.maximum(scale / 4, w.abs() / 4) + 1e-7).all()
    assert f.data.shape == (3, 70, 48) and f.scale.shape == (3, 70, 3)


def test_cat_and_rows_are_exact_off_the_block_edges():
    gen = torch.Generator().manual_seed(2)
    parts = [quantize_fp8(torch.randn(n, 300, generator=gen)) for n in (40, 100, 130)]
    fused = QuantizedWeight.cat(parts)
    assert fused.block == (4, 128)  # gcd of 128 and the boundaries 40, 140
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    aligned = QuantizedWeight.cat([quantize_fp8(torch.randn(128, 64, generator=gen)) for _ in range(2)])
    assert aligned.block == (128, 128) and aligned.scale.shape == (2, 1)  # no scale bytes added
    sl = fused.rows(45, 200)
    assert torch.equal(sl.dequantize(), fused.dequantize()[45:200])
    experts = quantize_fp4(torch.randn(4, 8, 64, generator=gen))
    assert torch.equal(experts[torch.tensor([3, 1])].dequantize(), experts.dequantize()[[3, 1]])
    with pytest.raises(ValueError, match="cannot concatenate"):
        QuantizedWeight.cat([parts[0], quantize_fp8(torch.randn(8, 300), ue8m0=True)])


@pytest.mark.parametrize("ue8m0", [False, True])
def test_reorder_rows_is_exact_and_keeps_what_blocks_it_can(ue8m0):
    """Rows reordered (V3's rotate_half rope rows): the same values in the new order; a permutation
    inside the row blocks keeps the block, one across them refines it only as far as it must."""
    w = quantize_fp8(torch.randn(256, 96, generator=torch.Generator().manual_seed(3)), (128, 32), ue8m0=ue8m0)
    inside = torch.cat([torch.arange(128).flip(0), torch.arange(128, 256)])  # within each 128-row block
    swapped = torch.cat([torch.arange(128, 256), torch.arange(128)])  # whole blocks trade places
    shifted = (torch.arange(256) + 16) % 256  # every 128, 64 or 32-row block straddles two: 16
    for index, block in ((inside, 128), (swapped, 128), (shifted, 16)):
        r = w.reorder_rows(index)
        assert torch.equal(r.dequantize(), w.dequantize()[index])
        assert r.block == (block, 32)
        assert r.data.dtype == torch.float8_e4m3fn


def test_scaled_by_a_power_of_two_changes_only_scales():
    gen = torch.Generator().manual_seed(3)
    for q in (quantize_fp8(torch.randn(50, 60, generator=gen)), quantize_fp8(torch.randn(50, 60, generator=gen), ue8m0=True)):
        assert torch.equal(q.scaled(0.125).dequantize(), q.dequantize() * 0.125)
        assert q.scaled(0.125).data is q.data
    with pytest.raises(ValueError, match="power of two"):
        q.scaled(0.3)


@pytest.mark.parametrize("bad,match", [
    (dict(data=torch.zeros(4, 8)), "float8_e4m3fn"),
    (dict(scale=torch.ones(2, 1)), "expects scale shape"),
    (dict(scale=torch.ones(1, 1, dtype=torch.float16)), "float32 or ue8m0"),
    (dict(format="int4"), "unknown quantized format"),
])
def test_invalid_weights_are_refused(bad, match):
    args = dict(data=torch.zeros(4, 8).to(torch.float8_e4m3fn), scale=torch.ones(1, 1), format=FP8, block=(128, 128))
    with pytest.raises(ValueError, match=match):
        QuantizedWeight(**(args | bad))


def test_act_quant_groups_and_power_of_two_scales():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 80, generator=gen) * torch.logspace(-2, 2, 80)  # groups of very different size
    y = act_quant(x, ActQuant(32))
    for g in range(3):  # 32, 32 and a partial 16
        xs, ys = x[:, 32 * g:32 * g + 32], y[:, 32 * g:32 * g + 32]
        amax = xs.abs().amax(-1, keepdim=True)
        s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
        # every value is an e4m3 value times its group's power-of-two scale, within e4m3's rounding
        assert torch.equal((ys / s).to(torch.float8_e4m3fn).float() * s, ys)
        assert ((ys - xs).abs() <= xs.abs() * 2 ** -4 + s * 2 ** -9).all()
    plain = act_quant(x, ActQuant(32, pow2=False))
    assert not torch.equal(plain, y) and (plain - x).abs().max() < (x.abs().max() * 2 ** -4)
