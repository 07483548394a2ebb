"""Building a C++ extension into a shared directory, safe against builders that died.

torch's extension loader guards a build directory with a `lock` file that it creates and removes
itself (torch.utils.file_baton): a process killed while it holds it (a worker stopped during its
first compile, a timed-out run) leaves the file behind, and every later load of that directory
waits on it forever, with no message. A run that hung that way for its whole time limit is what
this module is for: the build runs under an flock on a file beside it, which the kernel releases
when its holder dies, so whoever holds the flock knows that no live process of ours is building,
and a `lock` file found then is a dead builder's and is removed.
"""

from __future__ import annotations

import fcntl
import os

_TORCH_BATON = "lock"  # the name torch.utils.cpp_extension gives its FileBaton in the build directory
_FLOCK = ".deepinfer_build.flock"


def load_extension(build_directory: str, **kwargs):
    """`torch.utils.cpp_extension.load(build_directory=..., **kwargs)`, clearing a dead builder's lock first."""
    from torch.utils import cpp_extension

    os.makedirs(build_directory, exist_ok=True)
    with open(os.path.join(build_directory, _FLOCK), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another process of ours building here: wait for it (it finishes or dies)
        try:
            stale = os.path.join(build_directory, _TORCH_BATON)
            if os.path.exists(stale):
                os.remove(stale)
            return cpp_extension.load(build_directory=build_directory, **kwargs)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
