"""Shared helpers of the op conformance tests (nvidia and ascend vs the cpu reference)."""

from __future__ import annotations

import torch

from deepinfer.backends import get_accelerator
from deepinfer.backends import reference as ref


def poisoned(name: str):
    """Generator for a module fixture: the backend, with every kernel output allocated as NaN so an
    element a kernel fails to write shows up as a mismatch."""
    from deepinfer.backends.triton import alloc

    acc = get_accelerator(name)
    alloc.poison = True
    yield acc
    alloc.poison = False


def seeded(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0xFFFFFFFF)


def randn(generator, *shape, scale=1.0):
    return torch.randn(*shape, generator=generator) * scale


def indices(generator, t, k, pool, frac_invalid=0.3):
    idx = torch.randint(0, pool, (t, k), generator=generator)
    idx[torch.rand(t, k, generator=generator) < frac_invalid] = -1
    return idx


def to_device(acc, *tensors):
    return [t.to(acc.device) if isinstance(t, torch.Tensor) else t for t in tensors]


def run(acc, op, *args):
    """(backend result, cpu reference result) of one op on the same inputs."""
    return getattr(acc, op)(*to_device(acc, *args)), getattr(ref, op)(*args)


def assert_close(op: str, out, expected, tol: float) -> None:
    """max |out - expected| <= tol * max |expected|, no NaN (unwritten elements), same shape."""
    out = out.cpu()
    assert out.shape == expected.shape, f"{op}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert not out.isnan().any(), f"{op}: NaN in output (an element the kernel did not write?)"
    if out.numel() == 0:
        return
    err, scale = float((out - expected).abs().max()), float(expected.abs().max())
    print(f"\n{op}: max rel err {err / max(scale, 1e-30):.2e} (tol {tol:.0e})", end="")
    assert err <= tol * scale, f"{op}: max abs err {err:.2e} > {tol} x max|ref| = {tol * scale:.2e}"


FUSED_OPS = ("hc_pre_norm", "hc_post_pre_norm", "rms_norm_rope", "swiglu_mlp", "compress_entries")


def fused_op_inputs(op: str, t: int) -> tuple:
    """Inputs of the fused sequences (models/deepseek_v4/fused.py; swiglu_mlp: base.py) for t tokens (t windows for
    compress_entries): a backend's version against the cpu reference, like every other op."""
    gen = seeded(40, t, FUSED_OPS.index(op))
    n, d = 4, 48
    hc = (randn(gen, (2 + n) * n, n * d, scale=0.1), randn(gen, (2 + n) * n, scale=0.2), torch.rand(3, generator=gen),
          1e-6, 1e-6, 20)
    streams = randn(gen, t, n, d)
    if op == "hc_pre_norm":
        return (streams, *hc, randn(gen, d))
    if op == "hc_post_pre_norm":
        return (randn(gen, t, d), streams, torch.rand(t, n, generator=gen) * 2, torch.rand(t, n, n, generator=gen),
                *hc, randn(gen, d))
    if op == "rms_norm_rope":
        return randn(gen, t, 3, 32, scale=3.0), randn(gen, 32), 1e-6, randn(gen, t, 4), randn(gen, t, 4)
    if op == "swiglu_mlp":
        return randn(gen, t, d), randn(gen, 2 * 24, d, scale=0.2), randn(gen, d, 24, scale=0.2), 7.0
    # a CSA compressor (rate 4, overlapping windows of 8 staged rows), the first window's previous half absent
    rate, dim = 4, 32
    rows = torch.randint(0, 60, (t, 2 * rate), generator=gen)
    rows[0, :rate] = -1
    return (randn(gen, 60, 4 * dim), rows, randn(gen, rate, 2 * dim), True, randn(gen, dim), 1e-6,
            randn(gen, t, 4), randn(gen, t, 4))


def check_fused(acc, op: str, t: int, tol: float) -> None:
    """A fused sequence on a backend (DeepSeek-V4's composite over its ops, or its own kernel;
    swiglu_mlp: base.py's) against the same on the cpu reference ops: every output."""
    from deepinfer.backends.cpu import CpuAccelerator
    from deepinfer.models.deepseek_v4 import fused

    args = fused_op_inputs(op, t)
    if op == "swiglu_mlp":  # an Accelerator op (with a default composite)
        out, expected = run(acc, op, *args)
    else:
        out, expected = getattr(fused, op)(acc, *to_device(acc, *args)), getattr(fused, op)(CpuAccelerator(), *args)
    out, expected = (out, expected) if isinstance(expected, tuple) else ((out,), (expected,))
    for o, e in zip(out, expected, strict=True):
        assert_close(op, o, e, tol)
