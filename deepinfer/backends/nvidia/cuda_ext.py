"""Loader of the csrc/cuda extension `deepinfer_cuda` (built by csrc/cuda/build.sh, or by setup.py
when DEEPINFER_ACCELERATOR=nvidia and nvcc is found). The C++ side is torch-free: tensors go in as
device pointers, the stream as an integer."""

from __future__ import annotations

import functools
import importlib

import torch

from deepinfer.backends.triton import alloc

# Compiled for sm_90a and sm_100a only (arch-specific cubins, no PTX): other GPUs cannot run it.
_CAPABILITIES = ((9, 0), (10, 0))


@functools.cache
def load():
    """The compiled module, or None when it is not built or no GPU it was compiled for is present."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() not in _CAPABILITIES:
        return None
    try:
        return importlib.import_module("deepinfer.backends.nvidia.deepinfer_cuda")
    except ImportError:
        return None


def sparse_decode_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Accelerator.sparse_attention on CUDA tensors: q [T, H, D], kv [P, D] (bf16 or fp32 storage),
    indices [T, K] (-1 = masked), sinks [H] -> [T, H, D] float32."""
    ext = load()
    if ext is None:
        raise RuntimeError("deepinfer_cuda is not available: build it with bash csrc/cuda/build.sh "
                           "(needs an sm_90 or sm_100 GPU to run)")
    t, h, d = q.shape
    if kv.dtype not in (torch.float32, torch.bfloat16):
        kv = kv.float()
    q, kv = q.float().contiguous(), kv.contiguous()
    indices, sinks = indices.to(torch.int64).contiguous(), sinks.float().contiguous()
    out = alloc.empty(t, h, d, dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        ext.sparse_decode_attention(q.data_ptr(), kv.data_ptr(), indices.data_ptr(), sinks.data_ptr(),
                                    out.data_ptr(), t, h, d, indices.shape[1], float(scale),
                                    str(kv.dtype).removeprefix("torch."), torch.cuda.current_stream().cuda_stream)
    return out
