"""Loader and host-side glue for the csrc/ascendc kernels (torch.ops.deepinfer_ascend.*).

setup.py builds them only when DEEPINFER_ACCELERATOR=ascend and ASCEND_HOME_PATH points to a CANN
toolkit; the library lands beside this file as `libdeepinfer_ascendc.so`. Without it (every machine
without CANN, CI included) the backend uses the Triton kernels for these two ops instead.

Op contracts (the C++ schemas in csrc/ascendc/op_host/*.cpp):
- compress_windows(Tensor kv, Tensor gate) -> Tensor: kv, gate float32 [W, L, D] contiguous -> [W, D],
  exactly the Accelerator op.
- mhc_sinkhorn(Tensor logits, int n, float eps, int iters) -> Tensor: logits float32 [T, n*n] (already
  scaled and biased) -> comb [T, n, n]: row softmax + eps, one column normalisation, then (iters-1) x
  (row, column), each dividing by sum + eps (the Sinkhorn part of hc_pre).
"""

from __future__ import annotations

import os

import torch

LIBRARY = os.path.join(os.path.dirname(__file__), "libdeepinfer_ascendc.so")
_loaded: bool | None = None


def load() -> bool:
    """True when the AscendC ops are registered (built library loaded, or registered by someone else)."""
    global _loaded
    if _loaded is None:
        if not _registered() and os.path.exists(LIBRARY):
            torch.ops.load_library(LIBRARY)
        _loaded = _registered()
    return _loaded


def _registered() -> bool:
    try:
        torch.ops.deepinfer_ascend.compress_windows  # noqa: B018 (raises when absent)
        torch.ops.deepinfer_ascend.mhc_sinkhorn  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return torch.ops.deepinfer_ascend.compress_windows(kv.float().contiguous(), gate.float().contiguous())


def hc_pre(rms_norm, linear, streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """hc_pre with the Sinkhorn on the AscendC kernel; the mix GEMM and the gates run on the given ops."""
    t, n, d = streams.shape
    mix = linear(rms_norm(streams.reshape(t, n * d), None, norm_eps), fn)
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = (comb_w * scale[2] + comb_b).float().contiguous()
    comb = torch.ops.deepinfer_ascend.mhc_sinkhorn(logits, n, float(hc_eps), int(sinkhorn_iters))
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=-2)
    return collapsed, post, comb.view(t, n, n)
