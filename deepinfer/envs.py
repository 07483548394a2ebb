"""Every DEEPINFER_* environment variable: name, default, parser and validation; and the few
variables other programs own that deepinfer reads (torchrun's, Triton's, the XDG cache directory).

This is the only module that reads the environment (tests/unit/test_layering.py checks the
package's source). Values are read at call time (not import time) so tests and long-lived
processes can change them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


class EnvError(ValueError):
    """An environment variable holds a value that cannot be used."""


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean; set it to 1 or 0")


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None


def _float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a number") from None


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise EnvError(f"{name}={raw!r} is not one of {', '.join(choices)}")
        return value

    return parse


def _str(name: str, raw: str) -> str:
    return raw


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str, str], Any]
    doc: str

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        return self.parse(self.name, raw)


_VARS = [
    EnvVar("DEEPINFER_ACCELERATOR", "auto", _choice("auto", "cpu", "nvidia", "ascend"),
           "cpu, nvidia or ascend; unset = auto (nvidia if CUDA is usable, else ascend, else cpu)"),
    EnvVar("DEEPINFER_BATCH_INVARIANT", False, _bool,
           "1: batch-invariant kernels (results independent of batch composition); not on ascend"),
    EnvVar("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", None, _bool,
           "overlap CPU scheduling with device execution; unset = the backend's choice (on for nvidia/ascend, "
           "off on cpu, where the model itself runs on the host and the two threads contend for the GIL)"),
    EnvVar("DEEPINFER_USE_NEXTN_DECODE", None, _int,
           "maximum draft length; 0 disables speculative decoding; unset = the backend's choice (5 on "
           "nvidia/ascend, 0 on cpu, where drafting measured slower than plain steps)"),
    EnvVar("DEEPINFER_ENABLE_MTP_VARLEN", True, _bool,
           "DSpark confidence-scheduled (variable) verification length; 0 = fixed"),
    EnvVar("DEEPINFER_MAX_BACKTRACKING_TOKENS", 0, _int,
           "rollback margin kept in the window rings (effective value: max(this, NEXTN+1))"),
    EnvVar("DEEPINFER_DECODE_PERF_CACHE_DIR", "", _str,
           "where the verify-length planner keeps its step-cost profile"),
    EnvVar("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact", _choice("off", "mask", "compact"),
           "window-state rebuild after a prefix-cache hit or preemption (core/prefix_replay.py): "
           "off (exact), mask (slow check), compact (bounded replay)"),
    EnvVar("DEEPINFER_CED_PREFILL_MODE", None, _choice("off", "mask", "compact"),
           "DeepSeek-V4.1's CED split of a long prefill chunk: compact (decoder layers run on the chunk's last "
           "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS rows), mask (every row, the same masking: a check), off (exact); "
           "unset = the value of DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"),
    EnvVar("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", 140, _int,
           "replayed suffix; must be >= sliding window + max backtracking (checked at start-up)"),
    EnvVar("DEEPINFER_XGRAMMAR_TIMEOUT", 30.0, _float, "grammar compile timeout in seconds"),
    EnvVar("DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES", 512 * 1024 * 1024, _int, "grammar compile cache size"),
    EnvVar("DEEPINFER_XGRAMMAR_DISABLE_CACHE", False, _bool, "disable the grammar compile cache"),
    EnvVar("DEEPINFER_HF_MODEL_DIR", "", _str, "local checkpoint used when LLM(model=None)"),
    EnvVar("DEEPINFER_CPU_KERNELS", True, _bool,
           "cpu backend: fused C++ kernels for the hot ops (compiled on first use); 0 = reference ops only"),
    EnvVar("DEEPINFER_ENFORCE_EAGER", False, _bool,
           "1: run every step op by op (no recorded and replayed decode steps: the cpu tape, CUDA graphs)"),
    EnvVar("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", 8, _int,
           "nvidia: decode batches are padded up to the next captured size, 1, 2, 4 and then multiples of "
           "this up to max_num_seqs (one CUDA graph per size); 0 = capture every batch size as it comes"),
    EnvVar("DEEPINFER_MULTI_STEP_DECODE", 8, _int,
           "greedy decode steps per call when every running request decodes greedily and none waits "
           "(multi-step scheduling: planning, the replayed step and its argmax per step, scheduling and "
           "post-processing once per call); 1 = one step per call"),
    EnvVar("DEEPINFER_CPU_THREADS", 0, _int,
           "intra-op threads of the cpu backend; 0 = 1 for small models (hidden <= 1024), else all cores, "
           "and a replayed step's calls each take 1 or all cores by their measured time; N = N everywhere"),
]
VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str) -> Any:
    """Parsed value of a DEEPINFER_* variable (its default when unset)."""
    return VARS[name].get()


def accelerator() -> str:
    return get("DEEPINFER_ACCELERATOR")


def batch_invariant() -> bool:
    return get("DEEPINFER_BATCH_INVARIANT")


def zero_overhead_scheduling(default: bool) -> bool:
    """DEEPINFER_ZERO_OVERHEAD_SCHEDULING when set, else `default` (the accelerator's
    `overlap_scheduling`)."""
    value = get("DEEPINFER_ZERO_OVERHEAD_SCHEDULING")
    return default if value is None else value


def nextn_decode(default: int = 5) -> int:
    """DEEPINFER_USE_NEXTN_DECODE when set, else `default` (5 where the accelerator drafts by default,
    0 where it does not). The rollback margin below uses the default 5 when unset: a margin check
    that does not depend on the backend."""
    value = get("DEEPINFER_USE_NEXTN_DECODE")
    if value is None:
        return default
    if value < 0:
        raise EnvError(f"DEEPINFER_USE_NEXTN_DECODE={value} must be >= 0 (0 disables drafting)")
    return value


def ced_prefill_mode() -> str:
    """DEEPINFER_CED_PREFILL_MODE when set, else the prefix-cache replay's mode (the two are the same
    bounded-tail approximation, and before the CED split had its own variable it followed that one)."""
    value = get("DEEPINFER_CED_PREFILL_MODE")
    return get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE") if value is None else value


def mtp_varlen() -> bool:
    return get("DEEPINFER_ENABLE_MTP_VARLEN")


def max_backtracking_tokens() -> int:
    """Tokens the window rings keep beyond the sliding window so drafts can be rolled back."""
    value = get("DEEPINFER_MAX_BACKTRACKING_TOKENS")
    if value < 0:
        raise EnvError(f"DEEPINFER_MAX_BACKTRACKING_TOKENS={value} must be >= 0")
    return max(value, nextn_decode() + 1)


# ---------------------------------------------------------------- variables other programs own
# torchrun (and every env:// launcher) sets these for each process it starts
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launcher_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise EnvError(f"{name} is not set: start the process with torchrun (it sets {', '.join(TORCHRUN_VARS)})")
    return _int(name, raw)


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_VARS)


def torchrun_rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as the launcher set them."""
    return _launcher_int("RANK"), _launcher_int("WORLD_SIZE")


def torchrun_local_rank() -> int:
    """This process's rank on its machine: LOCAL_RANK, else RANK (one machine)."""
    return _launcher_int("LOCAL_RANK" if "LOCAL_RANK" in os.environ else "RANK")


def torchrun_local_world_size(default: int) -> int:
    """Processes on this machine: LOCAL_WORLD_SIZE under torchrun, else `default`."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    return default if raw is None else _int("LOCAL_WORLD_SIZE", raw)


def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run through its interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def cache_root() -> str:
    """The user's cache directory: XDG_CACHE_HOME, else ~/.cache."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def default_ucx_settings(tcp: bool, devices: str) -> None:
    """UCX's settings for NIXL's agent (kv/transfer.py), where the user has not set them: over TCP,
    UCX_MODULES=^ib, since UCX's InfiniBand modules, once loaded, bring a libnl whose exit-time
    destructor crashes the process (SIGSEGV after a clean shutdown) on hosts without RDMA, and TCP or
    shared memory need none of them; `devices` (--disaggregation-ib-device) as UCX_NET_DEVICES."""
    if tcp:
        os.environ.setdefault("UCX_MODULES", "^ib")
    if devices:
        os.environ.setdefault("UCX_NET_DEVICES", devices)
