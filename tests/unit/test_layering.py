"""The house's layering rules, checked on the source: the engine (core/) knows models only
through their interface and backends only through base.py; a backend imports no engine, model or
other backend; nothing replaces methods on live objects."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "deepinfer"
BACKENDS = ("cpu", "nvidia", "ascend")
# packages every backend may use: the interface (base.py and its quantized weight type, quant.py), the
# reference ops, the shared Triton kernels, the registry package itself (its errors), and the env reader
SHARED = ("deepinfer.backends.base", "deepinfer.backends.quant", "deepinfer.backends.reference",
          "deepinfer.backends.triton", "deepinfer.envs")


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in out if m.startswith("deepinfer")]


def _files(sub: str) -> list[pathlib.Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


def test_backends_import_no_engine_model_or_other_backend():
    bad = []
    for path in _files("backends"):
        rel = path.relative_to(PACKAGE / "backends").parts
        if rel == ("__init__.py",):  # the registry: it builds the backend the environment names
            continue
        own = f"deepinfer.backends.{rel[0]}" if rel[0] in BACKENDS else None
        for module in _imports(path):
            if module.startswith(("deepinfer.core", "deepinfer.models", "deepinfer.parallel", "deepinfer.llm",
                                  "deepinfer.entrypoints")):
                bad.append((str(path), module))
            for other in BACKENDS:
                name = f"deepinfer.backends.{other}"
                if (module == name or module.startswith(name + ".")) and name != own:
                    bad.append((str(path), module))
    assert not bad, bad


def test_the_engine_knows_models_and_backends_only_by_their_interfaces():
    bad = []
    for path in _files("core"):
        for module in _imports(path):
            if module.startswith("deepinfer.models.") and not module.startswith(
                    ("deepinfer.models.base", "deepinfer.models.registry")):
                bad.append((str(path), module))
            if module.startswith("deepinfer.backends.") and not module.startswith(SHARED[:2]):
                bad.append((str(path), module))
    assert not bad, bad


def test_models_import_no_core_module():
    """A family reads the model contract (models/base.py: cache spec, step inputs, bucket sizes) and the
    accelerator interface (backends/base.py and its quantized weights), never the engine's modules:
    everything it needs of the engine is declared in models/base.py."""
    bad = [(str(path), module) for path in _files("models") for module in _imports(path)
           if module.startswith(("deepinfer.core", "deepinfer.parallel", "deepinfer.entrypoints", "deepinfer.llm"))
           or module.startswith("deepinfer.backends.") and not module.startswith(SHARED[:2])]
    assert not bad, bad


def test_core_reaches_model_packages_only_through_the_registry():
    """core/ names no family: the registry (models/registry.py) maps a checkpoint to its family's
    classes, and only the engine asks it."""
    bad, asks = [], []
    for path in _files("core"):
        for module in _imports(path):
            if module.startswith("deepinfer.models") and module.split(".")[:3] not in (
                    ["deepinfer", "models", "base"], ["deepinfer", "models", "registry"]):
                bad.append((str(path), module))
            if module.startswith("deepinfer.models.registry"):
                asks.append(path.relative_to(PACKAGE).as_posix())
    assert not bad, bad
    assert set(asks) == {"core/engine.py"}, asks


def test_only_the_model_runner_touches_step_graphs():
    """The model runner (core/model_runner.py) is the one place that chooses eager, record or replay:
    the engine loop, the speculative decoder and everything else in the package never import the
    step graphs (backends compile what core/graphs.py recorded through their own modules)."""
    bad = [(str(path), module) for path in sorted(PACKAGE.rglob("*.py")) for module in _imports(path)
           if module.startswith("deepinfer.core.graphs") and path != PACKAGE / "core" / "model_runner.py"]
    assert not bad, bad


def test_no_method_is_replaced_on_a_live_object():
    """No `obj.method = ...` of a function or lambda on anything but self, and no setattr except on
    a class defined in the same module (ops assigned to backend classes)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id not in {"self", "cls"} | classes
                            and (isinstance(node.value, ast.Lambda)
                                 or isinstance(node.value, ast.Name) and node.value.id in functions)):
                        bad.append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                obj = node.args[0] if node.args else None
                if not (isinstance(obj, ast.Name) and obj.id in classes):
                    bad.append(f"{path}:{node.lineno}")
    assert not bad, bad


def test_only_envs_reads_the_environment():
    """envs.py is the one module of the package that reads (or writes) environment variables, its own
    DEEPINFER_* ones and those other programs own (torchrun's RANK / WORLD_SIZE / LOCAL_RANK /
    MASTER_ADDR, TRITON_INTERPRET, XDG_CACHE_HOME): os.environ, os.environb, os.getenv, os.putenv,
    os.unsetenv, under any name they are imported as."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in names for a in node.names):
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} from os import")
    assert not bad, bad
