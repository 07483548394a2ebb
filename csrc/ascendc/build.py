"""Build csrc/ascendc into deepinfer/backends/ascend/libdeepinfer_ascendc.so (called by setup.py).

Builds only when DEEPINFER_ACCELERATOR=ascend and ASCEND_HOME_PATH points to a CANN toolkit; otherwise
prints why it did not and returns, leaving a pure-Python install whose ascend backend uses its Triton
kernels for compress_windows and hc_pre. A build that starts and fails is an error.
Options: DEEPINFER_ASCEND_SOC (default Ascend910B1, see `npu-smi info`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = HERE.parents[1] / "deepinfer" / "backends" / "ascend" / "libdeepinfer_ascendc.so"


def _why_not() -> str | None:
    if os.environ.get("DEEPINFER_ACCELERATOR", "").strip().lower() != "ascend":
        return "DEEPINFER_ACCELERATOR is not ascend"
    home = os.environ.get("ASCEND_HOME_PATH", "")
    if not home:
        return "ASCEND_HOME_PATH is unset (source <CANN>/set_env.sh to point it at a CANN toolkit)"
    if not any((Path(home) / sub / "tikcpp" / "ascendc_kernel_cmake").is_dir() for sub in ("compiler", "tools")):
        return f"ASCEND_HOME_PATH={home} is not a CANN toolkit (no compiler/tikcpp/ascendc_kernel_cmake)"
    if shutil.which("cmake") is None:
        return "cmake is not on PATH"
    return None


def main() -> int:
    reason = _why_not()
    if reason is not None:
        print(f"deepinfer: not building the AscendC kernels (csrc/ascendc): {reason}; the ascend backend "
              "will use its Triton kernels for compress_windows and hc_pre.", file=sys.stderr)
        return 0
    import torch
    import torch_npu

    build = HERE / "build"
    subprocess.run(["cmake", "-S", str(HERE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DASCEND_CANN_PACKAGE_PATH={os.environ['ASCEND_HOME_PATH']}",
                    f"-DSOC_VERSION={os.environ.get('DEEPINFER_ASCEND_SOC', 'Ascend910B1')}",
                    f"-DTORCH_CMAKE_PREFIX={torch.utils.cmake_prefix_path}",
                    f"-DTORCH_NPU_ROOT={os.path.dirname(torch_npu.__file__)}",
                    f"-DCXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1)], check=True)
    shutil.copy2(build / "libdeepinfer_ascendc.so", TARGET)
    print(f"deepinfer: built {TARGET}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
