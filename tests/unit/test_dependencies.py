"""Every third-party module the package and its tests import comes from a distribution pyproject.toml
names (a dependency or an extra), by the installed distributions' own record of the modules they
provide: a fresh venv built as the README says has them. Import names that differ from their
distribution's (`zmq` from pyzmq, `PIL` from pillow, `yaml`, ...) are resolved, not guessed."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# not pyproject's to name: torch_npu is Ascend's own install (it must never enter a test venv), triton
# the README's test command installs (pinned to the torch wheel); both imported behind guards
OPTIONAL = {"torch_npu", "triton"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _named() -> set[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    specs = list(project["dependencies"]) + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {_canonical(re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0]) for s in specs}


def _top_level_imports(root: str) -> set[str]:
    found = set()
    for base, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            with open(os.path.join(base, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found


def _local() -> set[str]:
    """The repository's own modules: the tests' helpers and the scripts of benchmarks/ and tools/ they import."""
    out = {"deepinfer", "conftest"}
    for root in ("tests", "benchmarks", "tools"):
        for base, dirs, files in os.walk(os.path.join(REPO, root)):
            out |= {n[:-3] for n in files if n.endswith(".py")} | set(dirs)
    return out


def test_every_third_party_import_comes_from_a_named_distribution():
    provided = importlib.metadata.packages_distributions()
    named = _named() | {"deepinfer"}
    modules = (_top_level_imports(os.path.join(REPO, "deepinfer")) | _top_level_imports(os.path.join(REPO, "tests")))
    modules -= set(sys.stdlib_module_names) | _local() | OPTIONAL | {"__future__"}
    unnamed = {}
    for module in sorted(modules):
        dists = {_canonical(d) for d in provided.get(module, [])}
        if not dists & named:
            unnamed[module] = sorted(dists) or "not installed"
    assert not unnamed, f"imported but not from a distribution pyproject.toml names: {unnamed}"
    assert "pyzmq" in {_canonical(d) for d in provided["zmq"]}  # `zmq` is pyzmq's, a core dependency
