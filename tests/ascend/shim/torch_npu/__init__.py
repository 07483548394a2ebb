"""Test-only stand-in for `torch_npu`: the subset of torch_npu the ascend backend calls, in plain torch.

Never packaged and never on sys.path outside tests/ascend (its conftest puts it there per test module
and takes it away afterwards). It runs on CPU tensors, so the backend's device is cpu under this shim
(`DEEPINFER_REFERENCE_SHIM` tells the backend so). Each op follows the Ascend PyTorch API reference
for argument order, layouts and defaults (hiascend.com, "torch_npu.<op>" pages, PyTorch 7.0.0 / 6.0.0
editions) and rejects the argument combinations the reference describes but the shim does not model,
so a backend change that starts relying on them fails here instead of passing silently.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

DEEPINFER_REFERENCE_SHIM = True
__version__ = "0.0+deepinfer.shim"


# torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
# Ascend PyTorch API reference, "torch_npu.npu_rms_norm" (ptaoplist_000860, 7.0.0): y = x * rstd * gamma
# over the trailing dims gamma covers, rstd = 1/sqrt(mean(x^2) + eps); second output is rstd (float32,
# reduced dims kept as 1). dtypes float16/bfloat16/float32, gamma the same dtype as self.
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    if gamma.dtype != self.dtype:
        raise TypeError(f"npu_rms_norm: gamma dtype {gamma.dtype} != self dtype {self.dtype}")
    if not 1 <= gamma.dim() <= self.dim() or tuple(self.shape[-gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must be the trailing dims of "
                         f"{tuple(self.shape)}")
    dims = tuple(range(-gamma.dim(), 0))
    x = self.float()
    rstd = torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


# torch_npu.npu_swiglu(Tensor input, int dim=-1) -> Tensor
# Ascend PyTorch API reference, "(beta)torch_npu.npu_swiglu" (ptaoplist_000834, 6.0.0):
# out = swish(A) * B = A * sigmoid(A) * B, A the first and B the second half of input along dim;
# input must be contiguous, non-empty, and even along dim.
def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:  # noqa: A002 (the documented name)
    if not input.is_contiguous() or input.numel() == 0 or input.shape[dim] % 2:
        raise ValueError("npu_swiglu: input must be contiguous, non-empty and even along dim")
    a, b = input.chunk(2, dim=dim)
    return F.silu(a) * b


# torch_npu.npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
#     antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
#     activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=-1,
#     group_list_type=0, act_type=0, output_dtype=None) -> List[Tensor]
# Ascend PyTorch API reference, "torch_npu.npu_grouped_matmul" (ptaoplist_000524, 7.0.0): y_i = x_i @ weight_i
# (weight is [K, N] per group, or one 3-D [E, K, N] tensor); group_type=0 groups the M axis; group_list is
# a Tensor; group_list_type=0 means cumulative row ends, 1 means rows per group; split_item 2/3 returns
# one output tensor holding every group's rows in order. Modelled: the non-quantized single-x MoE case
# (x = [one 2-D tensor], weight = [one 3-D tensor], split_item 2 or 3, group_type 0), as vllm-ascend calls it.
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=-1,
                       group_list_type=0, act_type=0, output_dtype=None):
    unmodelled = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                  activation_quant_scale, activation_quant_offset, output_dtype)
    if any(a is not None for a in unmodelled) or act_type != 0:
        raise NotImplementedError("shim npu_grouped_matmul models the non-quantized case without bias only")
    if len(x) != 1 or len(weight) != 1 or x[0].dim() != 2 or weight[0].dim() != 3:
        raise NotImplementedError("shim npu_grouped_matmul models x=[2-D tensor], weight=[3-D [E, K, N] tensor]")
    if split_item not in (2, 3) or group_type != 0 or not isinstance(group_list, torch.Tensor):
        raise NotImplementedError("shim npu_grouped_matmul models split_item 2/3, group_type 0, Tensor group_list")
    a, w = x[0], weight[0]
    if group_list.numel() != w.shape[0] or a.shape[1] != w.shape[1]:
        raise ValueError(f"npu_grouped_matmul: x {tuple(a.shape)}, weight {tuple(w.shape)}, "
                         f"group_list of {group_list.numel()} do not agree")
    if group_list_type == 1:
        counts = group_list.tolist()
    elif group_list_type == 0:
        ends = group_list.tolist()
        counts = [e - s for s, e in zip([0] + ends[:-1], ends)]
    else:
        raise ValueError(f"npu_grouped_matmul: group_list_type {group_list_type} is not 0 or 1")
    if sum(counts) != a.shape[0]:
        raise ValueError(f"npu_grouped_matmul: group_list covers {sum(counts)} rows, x has {a.shape[0]}")
    out = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype, device=a.device)
    begin = 0
    for g, n in enumerate(counts):
        if n:
            out[begin:begin + n] = a[begin:begin + n] @ w[g]
        begin += n
    return [out]


# torch.npu after `import torch_npu` (torch_npu registers the "npu" device module): is_available,
# device_count, synchronize, mem_get_info (free, total) bytes. The shim simulates one visible device;
# tests flip `npu.available` to model a host without one.
class _NpuModule(types.ModuleType):
    available = True

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return 1 if self.available else 0

    def synchronize(self, device=None) -> None:
        return None

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return 4 << 30, 8 << 30


npu = _NpuModule("torch.npu")


def install() -> None:
    """What `import torch_npu` does to torch for the subset used: torch.npu appears."""
    torch.npu = npu


def uninstall() -> None:
    if getattr(torch, "npu", None) is npu:
        del torch.npu


install()
