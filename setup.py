"""Metadata lives in pyproject.toml. This file only adds the CUDA extension (csrc/cuda, built by
csrc/cuda/build.sh with nvcc + pybind11, no torch) when DEEPINFER_ACCELERATOR=nvidia and nvcc is
on PATH; otherwise the package is pure Python and nothing is compiled."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class NvccBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        env = dict(os.environ, PYTHON=sys.executable)
        subprocess.run(["bash", str(ROOT / "csrc/cuda/build.sh"), "--out", str(target)], check=True, env=env)


def _cuda_extensions() -> list[Extension]:
    if os.environ.get("DEEPINFER_ACCELERATOR", "").strip().lower() != "nvidia" or shutil.which("nvcc") is None:
        return []
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc/cuda").glob("*.c*"))
    return [Extension("deepinfer.backends.nvidia.deepinfer_cuda", sources=sources)]


if os.environ.get("DEEPINFER_ACCELERATOR", "").strip().lower() == "ascend":
    # csrc/ascendc (AscendC kernels + torch bindings): built when ASCEND_HOME_PATH is a CANN toolkit,
    # else build.py says why not and the install stays pure Python (see csrc/ascendc/README.md)
    subprocess.run([sys.executable, str(ROOT / "csrc/ascendc/build.py")], check=True)
extensions = _cuda_extensions()
# setuptools' PEP 517 backend turns setup_requires into build requirements: pip puts pybind11 (headers
# only) into the isolated build environment, where build.sh's own pip fallback cannot reach.
setup(ext_modules=extensions, cmdclass={"build_ext": NvccBuild},
      setup_requires=["pybind11>=2.12"] if extensions else [])
