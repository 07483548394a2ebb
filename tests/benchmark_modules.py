"""Importing benchmarks/ scripts in a test without leaving them behind for other tests.

benchmarks/ and tests/ both hold a `heldout.py` (and may share other names): a test that put
benchmarks/ on sys.path and imported a script left benchmarks' module in sys.modules, and the next
test on that xdist worker to `from heldout import ...` got it and failed (seen in CI).
"""

from __future__ import annotations

import contextlib
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@contextlib.contextmanager
def benchmarks_importable():
    """benchmarks/ first on sys.path inside the block, with any module of the same name as one of its
    scripts set aside; after it, sys.path and those modules as they were, the scripts' modules gone."""
    names = {entry[:-3] for entry in os.listdir(BENCHMARKS) if entry.endswith(".py")}
    saved_path = list(sys.path)
    shadowed = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sys.path.insert(0, BENCHMARKS)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(shadowed)
