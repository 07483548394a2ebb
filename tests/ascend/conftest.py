"""The ascend backend in CI: the test-only torch_npu shim (tests/ascend/shim) + Triton kernels through
the Triton interpreter, on CPU tensors. Nothing here runs real torch_npu or the AscendC kernels."""

import os
import sys

import pytest

# As tests/conformance: must be set before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

SHIM_DIR = os.path.join(os.path.dirname(__file__), "shim")

# transformers caches (lru_cache) whether torch_npu is present; were it first asked while the shim is
# importable it would answer yes for the rest of the process and reach for NPU kernels the shim does
# not have. Ask it now, before any shim exists, so it keeps this machine's true answer (no).
try:
    from transformers.utils.import_utils import is_torch_npu_available

    assert not is_torch_npu_available() and not is_torch_npu_available(check_device=True)
except ImportError:
    pass


@pytest.fixture(scope="module", autouse=True)
def torch_npu_shim():
    """Make `import torch_npu` resolve to the shim (and torch.npu exist) for one test module, then undo
    it, so tests elsewhere in the same pytest process see a machine without torch_npu."""
    import torch

    had_npu = hasattr(torch, "npu")
    saved = sys.modules.pop("torch_npu", None)
    sys.path.insert(0, SHIM_DIR)
    import torch_npu

    torch_npu.install()
    torch_npu.npu.available = True
    try:
        yield torch_npu
    finally:
        torch_npu.uninstall()
        sys.path.remove(SHIM_DIR)
        sys.modules.pop("torch_npu", None)
        if saved is not None:
            sys.modules["torch_npu"] = saved
        assert hasattr(torch, "npu") == had_npu
