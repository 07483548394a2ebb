"""The host-side glue around the AscendC kernels (deepinfer/backends/ascend/ascendc.py), without the
kernels: the schemas csrc/ascendc/op_host/register.cpp defines are registered here with CPU
implementations written from the documented op contracts, and the glue's results are compared with the
cpu reference. The AscendC kernels themselves are not compiled or run anywhere in CI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from deepinfer.backends.ascend import ascendc
from deepinfer.backends.cpu import ops as ref

REGISTER = Path(__file__).resolve().parents[2] / "csrc" / "ascendc" / "op_host" / "register.cpp"


def _compress_windows(kv, gate):
    return (kv * gate.softmax(dim=1)).sum(dim=1)


def _mhc_sinkhorn(logits, n, eps, iters):
    comb = logits.view(-1, n, n).softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.fixture
def fake_kernels():
    schemas = re.findall(r'm\.def\("([^"]+)"\)', REGISTER.read_text())
    assert {s.split("(")[0] for s in schemas} == {"compress_windows", "mhc_sinkhorn"}
    lib = torch.library.Library("deepinfer_ascend", "DEF")
    for schema in schemas:
        lib.define(schema)
    lib.impl("compress_windows", _compress_windows, "CPU")
    lib.impl("mhc_sinkhorn", _mhc_sinkhorn, "CPU")
    yield
    lib._destroy()


def test_glue_matches_reference(fake_kernels):
    assert ascendc._registered()
    gen = torch.Generator().manual_seed(21)
    kv, gate = torch.randn(6, 8, 40, generator=gen), torch.randn(6, 8, 40, generator=gen)
    gate[:, 0] = float("-inf")
    assert torch.allclose(ascendc.compress_windows(kv, gate), ref.compress_windows(kv, gate), rtol=0, atol=1e-6)
    t, n, d = 7, 4, 24
    args = (torch.randn(t, n, d, generator=gen), torch.randn((2 + n) * n, n * d, generator=gen) * 0.1,
            torch.randn((2 + n) * n, generator=gen) * 0.2, torch.rand(3, generator=gen), 1e-6, 1e-6, 20)
    hc_pre = ascendc.make_hc_pre(ref.rms_norm, ref.linear)
    for out, expected in zip(hc_pre(*args), ref.hc_pre(*args)):
        assert out.shape == expected.shape
        assert torch.allclose(out, expected, rtol=0, atol=1e-6)


def test_load_without_a_built_library_is_false(monkeypatch, tmp_path):
    """No library (no CANN at install time): load() says so and the backend keeps its Triton kernels."""
    monkeypatch.setattr(ascendc, "LIBRARY", str(tmp_path / "libdeepinfer_ascendc.so"))
    monkeypatch.setattr(ascendc, "_loaded", None)
    assert ascendc.load() is False
