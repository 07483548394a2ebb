"""Backend registry: `get_accelerator()` picks the backend named by DEEPINFER_ACCELERATOR."""

from __future__ import annotations

import importlib.util

from deepinfer import envs
from deepinfer.backends.base import Accelerator


class AcceleratorUnavailable(RuntimeError):
    """The requested backend cannot run on this machine."""


def cuda_usable() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def triton_interpreter() -> bool:
    return envs.triton_interpreter()


def npu_usable() -> bool:
    # torch_npu is imported lazily: importing it without CANN breaks `import torch`.
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch
        import torch_npu  # noqa: F401

        return torch.npu.is_available() and torch.npu.device_count() > 0
    except Exception:  # a broken Ascend install is "not usable", explained by the error below
        return False


def _describe_machine() -> str:
    found = []
    found.append("CUDA GPU" if cuda_usable() else "no usable CUDA GPU")
    found.append("torch_npu with an NPU" if npu_usable() else "no usable torch_npu/NPU")
    found.append("TRITON_INTERPRET=1" if triton_interpreter() else "TRITON_INTERPRET unset")
    return ", ".join(found)


def _make(name: str) -> Accelerator:
    if name == "cpu":
        from deepinfer.backends import cpu

        return cpu.make()
    if name == "nvidia":
        if not (cuda_usable() or triton_interpreter()):
            raise AcceleratorUnavailable(
                f"DEEPINFER_ACCELERATOR=nvidia but this machine has {_describe_machine()}. "
                "Run on a machine with an NVIDIA GPU, set TRITON_INTERPRET=1 to run the Triton "
                "kernels on the CPU (slow, for testing), or set DEEPINFER_ACCELERATOR=cpu.")
        from deepinfer.backends.nvidia import NvidiaAccelerator

        return NvidiaAccelerator()
    if name == "ascend":
        from deepinfer.backends.ascend import AscendAccelerator

        return AscendAccelerator()
    raise AcceleratorUnavailable(f"unknown accelerator {name!r}; set DEEPINFER_ACCELERATOR to cpu, nvidia or ascend")


def get_accelerator(name: str | None = None) -> Accelerator:
    """The backend named by `name`, else by DEEPINFER_ACCELERATOR; auto = nvidia if CUDA is
    usable, else ascend if torch_npu is usable, else cpu."""
    try:
        choice = name or envs.accelerator()
    except envs.EnvError as exc:
        raise AcceleratorUnavailable(f"{exc}. Found: {_describe_machine()}.") from None
    if choice == "auto":
        choice = "nvidia" if cuda_usable() else "ascend" if npu_usable() else "cpu"
    return _make(choice)


__all__ = ["Accelerator", "AcceleratorUnavailable", "get_accelerator"]
