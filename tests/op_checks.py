"""Shared helpers of the op conformance tests (nvidia and ascend vs the cpu reference)."""

from __future__ import annotations

import torch

from deepinfer.backends import get_accelerator
from deepinfer.backends.cpu import ops as ref


def poisoned(name: str):
    """Generator for a module fixture: the backend, with every kernel output allocated as NaN so an
    element a kernel fails to write shows up as a mismatch."""
    from deepinfer.backends.nvidia import alloc

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
