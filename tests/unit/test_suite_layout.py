"""The suite's test directories are not packages, so pytest imports each test file by its basename:
two files with one name in different directories stop the whole run at collection ("import file
mismatch"), as happened when two branches each added a test_kv_events.py."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique():
    seen = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
