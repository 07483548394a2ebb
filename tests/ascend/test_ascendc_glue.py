"""The host-side glue around the AscendC kernels (deepinfer/backends/ascend/ascendc.py), without the
kernels: the schemas csrc/ascendc/op_host/register.cpp defines are registered here with CPU stand-ins
that record what the glue hands them and return arbitrary (seeded) values, so the test checks what
the glue itself computes: the kernels' input contract (dtype, contiguity, the Sinkhorn's logits) and
everything hc_pre derives around the kernel. Stand-ins that re-implemented the kernels' formulas
would only compare the reference with itself. The AscendC kernels are not compiled or run anywhere
in CI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from deepinfer.backends.ascend import ascendc
from deepinfer.backends import reference as ref

REGISTER = Path(__file__).resolve().parents[2] / "csrc" / "ascendc" / "op_host" / "register.cpp"


@pytest.fixture
def fake_kernels():
    """Registers the schemas; yields the list of (op, inputs, output) calls the stand-ins received."""
    schemas = re.findall(r'm\.def\("([^"]+)"\)', REGISTER.read_text())
    assert {s.split("(")[0] for s in schemas} == {"compress_windows", "mhc_sinkhorn"}
    calls = []
    gen = torch.Generator().manual_seed(5)

    def compress_windows(kv, gate):
        out = torch.randn(kv.shape[0], kv.shape[2], generator=gen)
        calls.append(("compress_windows", (kv, gate), out))
        return out

    def mhc_sinkhorn(logits, n, eps, iters):
        out = torch.rand(logits.shape[0], n, n, generator=gen)
        calls.append(("mhc_sinkhorn", (logits, n, eps, iters), out))
        return out

    lib = torch.library.Library("deepinfer_ascend", "DEF")
    for schema in schemas:
        lib.define(schema)
    lib.impl("compress_windows", compress_windows, "CPU")
    lib.impl("mhc_sinkhorn", mhc_sinkhorn, "CPU")
    yield calls
    lib._destroy()


def test_compress_windows_hands_the_kernel_float32_contiguous_inputs(fake_kernels):
    assert ascendc._registered()
    gen = torch.Generator().manual_seed(21)
    kv = torch.randn(6, 40, 8, generator=gen).to(torch.bfloat16).transpose(1, 2)  # bf16, not contiguous
    gate = torch.randn(6, 8, 40, generator=gen).to(torch.bfloat16)
    out = ascendc.compress_windows(kv, gate)
    (op, (kv_in, gate_in), kernel_out), = fake_kernels
    assert op == "compress_windows"
    for given, passed in ((kv, kv_in), (gate, gate_in)):
        assert passed.dtype == torch.float32 and passed.is_contiguous()
        assert torch.equal(passed, given.float())
    assert torch.equal(out, kernel_out)


def test_hc_pre_glue_around_the_sinkhorn_kernel(fake_kernels):
    """The mix GEMM, gates and collapse are the glue's own arithmetic: equal to the reference hc_pre;
    the kernel gets the comb logits of its contract ([T, n*n] float32, scaled and biased) and its
    output is returned as comb unchanged."""
    gen = torch.Generator().manual_seed(22)
    t, n, d = 7, 4, 24
    args = (torch.randn(t, n, d, generator=gen), torch.randn((2 + n) * n, n * d, generator=gen) * 0.1,
            torch.randn((2 + n) * n, generator=gen) * 0.2, torch.rand(3, generator=gen), 1e-6, 1e-6, 20)
    streams, fn, base, scale = args[:4]
    collapsed, post, comb = ascendc.hc_pre(ref.rms_norm, ref.linear, *args)
    ref_collapsed, ref_post, _ = ref.hc_pre(*args)
    torch.testing.assert_close(collapsed, ref_collapsed, rtol=0, atol=1e-6)
    torch.testing.assert_close(post, ref_post, rtol=0, atol=1e-6)
    (op, (logits, n_in, eps, iters), kernel_out), = fake_kernels
    assert (op, n_in, eps, iters) == ("mhc_sinkhorn", n, 1e-6, 20)
    mix = ref.linear(ref.rms_norm(streams.reshape(t, n * d), None, 1e-6), fn)
    expected_logits = mix[:, 2 * n:] * scale[2] + base[2 * n:]
    assert logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape == (t, n * n)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-6)
    assert torch.equal(comb, kernel_out.view(t, n, n))


def test_load_without_a_built_library_is_false(monkeypatch, tmp_path):
    """No library (no CANN at install time): load() says so and the backend keeps its Triton kernels."""
    monkeypatch.setattr(ascendc, "LIBRARY", str(tmp_path / "libdeepinfer_ascendc.so"))
    monkeypatch.setattr(ascendc, "_loaded", None)
    assert ascendc.load() is False
