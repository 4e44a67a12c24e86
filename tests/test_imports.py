"""Import boundaries between the project packages, read from the source with `ast` (docs/architecture.md).

Arrows (a package may import itself and what its arrow names, no other project package):

    models    -> (nothing)
    inference -> models
    data      -> models, inference
    training  -> models, inference, data

Nothing outside `training/` and `tests/` imports `training`. The toy world is one package, `models/toy/`:
code outside it imports `models.toy` (its public names), never one of its submodules. `models` and
`inference` never import the training stack (lightning, deepspeed, webdataset), anywhere in a file:
module level, inside functions, under `if TYPE_CHECKING:`, or through `importlib.import_module("...")`
with a literal name. Inference
users need no training stack, which a test also checks at run time by importing every module. No `inference/`
module is above 500 lines (the decode-cost issue).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "inference", "data", "training")
ALLOWED: dict[str, frozenset[str]] = {
    "models": frozenset({"models"}),
    "inference": frozenset({"models", "inference"}),
    "data": frozenset({"models", "inference", "data"}),
    "training": frozenset(PACKAGES),
}
"""Project packages each package may import (itself included)."""
OUTSIDE_ALLOWED = frozenset({"models", "inference", "data"})
"""Project packages a Python file outside the four packages and tests/ may import: all but training."""
TRAINING_STACK = ("lightning", "pytorch_lightning", "deepspeed", "webdataset")
NO_TRAINING_STACK = ("models", "inference")
SKIPPED_DIRS = frozenset({"tests", "runs", "outputs", "build", "dist", "venv"})
"""Top-level folders that hold no project code the arrows govern (tests may import anything)."""
DYNAMIC_IMPORTERS = frozenset({"import_module", "__import__"})


def _dynamic_name(call: ast.Call) -> str | None:
    """The literal module name of `importlib.import_module("x")` / `__import__("x")`, else None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in DYNAMIC_IMPORTERS or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imported_modules(source: str, relative_path: str) -> list[tuple[int, str]]:
    """(line, top-level module) of every import anywhere in the file, relative imports resolved.

    `relative_path` is the file's path from the repository root (`inference/bench.py`); it places
    relative imports, which never leave the file's own top-level package (`from ..x import y` in
    `models/sub/a.py` is `models`).
    """
    folder = Path(relative_path).parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=relative_path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            relative_to = folder[0] if node.level and folder else ""
            found.append((node.lineno, relative_to or (node.module or "").split(".")[0]))
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node)) is not None:
            found.append((node.lineno, name.lstrip(".").split(".")[0]))
    return found


def boundary_violations(source: str, relative_path: str) -> list[str]:
    """`path:line: message` for every import of the file that breaks an arrow; [] when it keeps them all."""
    package = Path(relative_path).parts[0]
    allowed = ALLOWED.get(package, OUTSIDE_ALLOWED)
    label = package if package in ALLOWED else "a file outside the packages"
    problems = []
    for line, module in imported_modules(source, relative_path):
        where = f"{relative_path}:{line}"
        if module in PACKAGES and module not in allowed:
            problems.append(f"{where}: {label} may not import {module}")
        if package in NO_TRAINING_STACK and module in TRAINING_STACK:
            problems.append(f"{where}: {package} may not import the training stack ({module})")
    return problems


def toy_internal_imports(source: str, relative_path: str) -> list[str]:
    """`path:line: message` for every import of a `models.toy.<submodule>` from outside `models/toy/`."""
    if relative_path.startswith("models/toy/"):
        return []
    problems = []
    for node in ast.walk(ast.parse(source, filename=relative_path)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names if node.module == "models"]
        for name in names:
            if name.startswith("models.toy."):
                problems.append(
                    f"{relative_path}:{node.lineno}: imports the toy world's internal {name}; use models.toy"
                )
    return problems


def project_files() -> list[Path]:
    """Every Python file the arrows govern: the four packages and any other top-level folder or script."""
    files = sorted(ROOT.glob("*.py"))
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir()):
        name = folder.name
        if name.startswith((".", "_")) or name in SKIPPED_DIRS or name.endswith(".egg-info"):
            continue
        if (folder / "pyvenv.cfg").exists():
            continue
        files += sorted(folder.rglob("*.py"))
    return files


def test_the_checker_sees_function_level_and_relative_imports():
    """The checker must be able to fail: forbidden imports hidden inside functions are reported."""
    source = (
        "import torch\n"
        "from models.target import ImageTarget\n"
        "def run():\n"
        "    import lightning\n"
        "    from data.prompts import toy_prompts\n"
        "    def inner():\n"
        "        from training import fit\n"
        "class Holder:\n"
        "    def method(self):\n"
        "        import importlib\n"
        "        return importlib.import_module('webdataset')\n"
    )
    problems = boundary_violations(source, "inference/synthetic.py")
    assert problems == [
        "inference/synthetic.py:4: inference may not import the training stack (lightning)",
        "inference/synthetic.py:5: inference may not import data",
        "inference/synthetic.py:7: inference may not import training",
        "inference/synthetic.py:11: inference may not import the training stack (webdataset)",
    ], problems
    assert boundary_violations(source, "training/synthetic.py") == []  # training may import all of it
    # relative imports stay inside the file's own package: data.training here, not the training package
    assert imported_modules("def f():\n    from ..training import fit\n", "data/sub/synthetic.py") == [(2, "data")]
    assert boundary_violations("from . import toy_world\nimport inference\n", "models/synthetic.py") == [
        "models/synthetic.py:2: models may not import inference"
    ]
    assert boundary_violations("import training.fit\n", "scripts/tool.py") == [
        "scripts/tool.py:1: a file outside the packages may not import training"
    ]


def test_the_toy_checker_sees_submodule_imports():
    source = "from models.toy import ToyTarget\ndef f():\n    from models.toy.metrics import SceneReader\n"
    assert toy_internal_imports(source, "inference/synthetic.py") == [
        "inference/synthetic.py:3: imports the toy world's internal models.toy.metrics; use models.toy"
    ]
    assert toy_internal_imports(source, "models/toy/synthetic.py") == []


def test_no_module_outside_the_toy_package_imports_its_internals():
    problems = []
    for path in project_files():
        relative = path.relative_to(ROOT).as_posix()
        problems += toy_internal_imports(path.read_text(encoding="utf-8"), relative)
    assert not problems, "\n".join(problems)


def test_every_project_file_keeps_the_arrows():
    files = project_files()
    for package in PACKAGES:  # the walk found the packages (an empty walk would pass vacuously)
        assert any(f.relative_to(ROOT).parts[0] == package for f in files), f"no Python files found in {package}/"
    problems = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        problems += boundary_violations(path.read_text(encoding="utf-8"), relative)
    assert not problems, "import arrows broken (see docs/architecture.md):\n" + "\n".join(problems)


def test_models_and_inference_import_without_the_training_stack():
    code = (
        "import sys, importlib, pkgutil\n"
        "import models, inference\n"
        "for package in (models, inference):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        f"print(sorted(m for m in {TRAINING_STACK!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


MAX_INFERENCE_FILE_LINES = 500
"""The decode-cost issue's bound on an `inference/` module: a file above it holds two concerns."""


def test_no_inference_module_is_above_500_lines():
    files = sorted((ROOT / "inference").rglob("*.py"))
    assert len(files) > 10, "inference/ has no modules to measure"
    long = {
        f.name: n for f in files if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_INFERENCE_FILE_LINES
    }
    assert not long, f"inference/ modules above {MAX_INFERENCE_FILE_LINES} lines (split them by concern): {long}"
