"""Another build of deepinfer, side by side in the same benchmark run: a git ref's files exported
(once, under the system's temp dir) and a function of these benchmark scripts run in a
subprocess whose `deepinfer` is that build. The measuring code is this checkout's, the engine
the ref's: the comparison is between builds, under the same conditions and in the same run.

    from baseline import call
    result = call("main", "throughput", "run_deepinfer", model_dir, prompts, new_tokens)

The ref's C++ kernels compile on its first use into its own cache directory (~30 s, once).
Arguments and results travel as JSON.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def worktree(ref: str) -> tuple[str, str]:
    """(path, commit) of `ref`'s files, exported once under the temp dir (git archive: the
    repository's own worktree list is left alone)."""
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", ref + "^{commit}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    path = os.path.join(tempfile.gettempdir(), f"deepinfer-baseline-{commit[:12]}")
    if not os.path.exists(os.path.join(path, "deepinfer", "__init__.py")):
        partial = tempfile.mkdtemp(prefix=f"deepinfer-baseline-{commit[:12]}-", dir=tempfile.gettempdir())
        archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", commit], check=True,
                                 capture_output=True).stdout
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(partial, filter="data")
        os.replace(partial, path)  # whole or not at all: an interrupted export is not mistaken for a build
    return path, commit


def call(ref: str | None, module: str, function: str, *args):
    """`module.function(*args)` (a module of benchmarks/) with deepinfer from `ref`, or from this checkout
    where `ref` is None (a fresh process for this build too: e.g. cells of a benchmark that leave state
    behind in their process run alike for both builds); its JSON result."""
    path, commit = worktree(ref) if ref is not None else (REPO, None)
    code = ("import json, sys\n"
            f"sys.path[:0] = [{path!r}, {HERE!r}]\n"
            "import deepinfer\n"
            f"assert deepinfer.__file__.startswith({path!r}), deepinfer.__file__\n"
            f"from {module} import {function}\n"
            "args = json.loads(sys.stdin.read())\n"
            f"print('\\n@@result@@' + json.dumps({function}(*args)))\n")
    env = dict(os.environ, PYTHONPATH=path)
    if commit is not None:  # the ref's kernels build into their own cache
        env["XDG_CACHE_HOME"] = os.path.join(tempfile.gettempdir(), f"deepinfer-baseline-cache-{commit[:12]}")
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(list(args)), capture_output=True, text=True,
                          env=env, cwd=path)
    if done.returncode != 0 or "@@result@@" not in done.stdout:
        raise RuntimeError(f"{module}.{function} at {ref or 'this checkout'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.rsplit("@@result@@", 1)[1])


def describe(ref: str) -> str:
    """`ref` and its commit, for tables and JSON."""
    return f"{ref} ({worktree(ref)[1][:12]})"
