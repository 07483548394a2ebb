"""csrc/cuda: the extension compiles and links for sm_90a + sm_100a, its bindings behave, and the
loader declines cleanly where it cannot run. Running the kernel needs an H100/B200-class GPU:
the numerical check against the cpu reference lives with the GPU benchmarks."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc is not installed: csrc/cuda cannot be compiled")


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    """Builds the module with csrc/cuda/build.sh (the command setup.py runs) and imports it; importing
    needs no GPU since cudart is linked statically and the driver is opened on first use."""
    path = tmp_path_factory.mktemp("cuda") / ("deepinfer_cuda" + sysconfig.get_config_var("EXT_SUFFIX"))
    proc = subprocess.run(["bash", str(ROOT / "csrc/cuda/build.sh"), "--out", str(path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spec = importlib.util.spec_from_file_location("deepinfer_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@needs_nvcc
def test_extension_compiles_links_and_imports(ext):
    assert callable(ext.sparse_decode_attention)


@pytest.mark.slow
@needs_nvcc
def test_bindings_validate_before_touching_the_device(ext):
    args = (0, 0, 0, 0, 0, 0, 4, 64, 8, 0.125)
    ext.sparse_decode_attention(*args, "bfloat16", 0)  # no tokens: nothing to launch, no error
    with pytest.raises(ValueError, match="kv_dtype"):
        ext.sparse_decode_attention(*args, "float16", 0)
    with pytest.raises(RuntimeError, match="head_dim"):
        ext.sparse_decode_attention(1, 1, 1, 1, 1, 2, 4, 4096, 8, 0.125, "float32", 0)


@pytest.mark.slow
@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path without a GPU")
def test_launch_without_gpu_is_an_error_not_a_crash(ext):
    with pytest.raises(RuntimeError, match="sparse_decode_attention: "):
        ext.sparse_decode_attention(16, 16, 16, 16, 16, 2, 4, 64, 8, 0.125, "bfloat16", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_loader_returns_none_without_gpu():
    pytest.importorskip("triton", reason="the nvidia backend package needs triton")
    from deepinfer.backends.nvidia import cuda_ext

    assert cuda_ext.load() is None
    with pytest.raises(RuntimeError, match="not available"):
        cuda_ext.sparse_decode_attention(torch.zeros(1, 1, 8), torch.zeros(4, 8), torch.zeros(1, 2, dtype=torch.long),
                                         torch.zeros(1), 0.5)
