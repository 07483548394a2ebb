"""Ascend backend: torch_npu fused ops, AscendC kernels, triton-ascend kernels.

Lands with its own issue; until then this backend refuses clearly.
Batch invariance and deterministic sampling are NVIDIA-only: this backend
declares both False.
"""

from __future__ import annotations

from deepinfer.backends.base import Accelerator


class AscendAccelerator(Accelerator):
    name = "ascend"
    dist_backend = "hccl"
    batch_invariant = False
    deterministic_sampling = False

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError(
            "the ascend backend is not implemented yet; set DEEPINFER_ACCELERATOR=cpu")
