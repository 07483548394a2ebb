"""NVIDIA backend: Triton kernels (+ the csrc/cuda extension when built).

The kernels land with their own issue; until then this backend refuses clearly
instead of silently running something else.
"""

from __future__ import annotations

from deepinfer.backends.base import Accelerator


class NvidiaAccelerator(Accelerator):
    name = "nvidia"
    dist_backend = "nccl"
    batch_invariant = True
    deterministic_sampling = True
    fp8_weights = True

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError(
            "the nvidia backend's Triton kernels are not implemented yet; "
            "set DEEPINFER_ACCELERATOR=cpu")
