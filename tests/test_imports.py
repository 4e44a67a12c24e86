"""Import boundaries between the project packages, read from the source with `ast` (docs/architecture.md).

Arrows (a part may import itself and what its arrow names, no other project part):

    models                      -> (nothing)
    inference.decoding          -> models
    inference.measure           -> inference.decoding, models
    inference.measure.pipeline  -> training, data, models, inference.decoding, inference.measure
    inference.evaluation        -> inference.decoding, models
    inference                   -> inference.*, models    (its top-level modules: `python -m` entry points only)
    data                        -> models, inference (but inference.measure.pipeline)
    training                    -> models, inference (but inference.measure.pipeline), data

A part is a top-level package, one of the three subpackages of `inference/`, or `inference/measure/pipeline/`
(what measures the training pipeline: its benchmarks and studies). Nothing outside `training/`,
`inference/measure/pipeline/` and `tests/` imports `training`, and nothing but the pipeline itself, the entry
points at the top of `inference/` and `tests/` imports `inference.measure.pipeline`. The toy world is one
package, `models/toy/`: code outside it imports `models.toy` (its public names), never one of its submodules.
`models` and `inference` never import the training stack (lightning, deepspeed, webdataset), anywhere in a file:
module level, inside functions, under `if TYPE_CHECKING:`, or through `importlib.import_module("...")`
with a literal name; `inference.measure.pipeline`, which measures that stack, is the one exception. Inference
users need no training stack, which a test also checks at run time by importing every module but the pipeline's
and its entry points. No two project modules import each other, directly or around a circle (type-only and
function-level imports included). No `inference/` module is above 500 lines (the decode-cost issue).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "inference", "data", "training")
INFERENCE_PARTS = ("decoding", "measure", "measure.pipeline", "evaluation")
"""The subpackages of `inference/` that are parts of their own for the arrows (the deepest one a module is in)."""
PIPELINE = "inference.measure.pipeline"
"""What measures the training pipeline: it imports the training stack, so only its entry points import it."""
PIPELINE_IMPORTERS = frozenset({PIPELINE, "inference"})
"""The parts that may import the pipeline: itself and the entry points at the top of `inference/` (and tests)."""
ALLOWED: dict[str, frozenset[str]] = {
    "models": frozenset({"models"}),
    "inference.decoding": frozenset({"models", "inference.decoding"}),
    "inference.measure": frozenset({"models", "inference.decoding", "inference.measure"}),
    PIPELINE: frozenset({"training", "data", "models", "inference.decoding", "inference.measure", PIPELINE}),
    "inference.evaluation": frozenset({"models", "inference.decoding", "inference.evaluation"}),
    "inference": frozenset({"models", "inference"}),
    "data": frozenset({"models", "inference", "data"}),
    "training": frozenset(PACKAGES),
}
"""Parts each part may import (itself included); a package's name allows every part inside it (`inference`:
its subpackages too). `inference` itself is its top-level modules, the `python -m` entry points."""
OUTSIDE_ALLOWED = frozenset({"models", "inference", "data"})
"""Project packages a Python file outside the four packages and tests/ may import: all but training (and the
pipeline's measurements, which import it)."""
TRAINING_STACK = ("lightning", "pytorch_lightning", "deepspeed", "webdataset")
NO_TRAINING_STACK = ("models", "inference")
TRAINING_STACK_EXEMPT = frozenset({PIPELINE})
"""The one part inside NO_TRAINING_STACK that imports the training stack: it measures it."""
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


def part_of(module: str) -> str:
    """The part a dotted module name belongs to: `inference.decoding.tree` -> `inference.decoding`,
    `inference.measure.pipeline.data_bench` -> `inference.measure.pipeline`, `inference.bench` -> `inference`,
    `models.toy.world` -> `models`, `torch.nn` -> `torch`."""
    parts = module.split(".")
    if parts[0] == "inference":
        for depth in (3, 2):  # the deepest part first: inference.measure.pipeline inside inference.measure
            if len(parts) >= depth and ".".join(parts[1:depth]) in INFERENCE_PARTS:
                return ".".join(parts[:depth])
    return parts[0]


def module_name(relative_path: str) -> str:
    """`inference/decoding/tree.py` -> `inference.decoding.tree`; a package's `__init__.py` is the package."""
    parts = Path(relative_path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, relative_path: str) -> str:
    """The dotted module a `from ... import` names, a relative one placed by the file's folder.

    Relative imports never leave the file's own top-level package (`from ..x import y` in `models/a.py`
    is `models.x`)."""
    if not node.level:
        return node.module or ""
    folder = list(Path(relative_path).parts[:-1])
    base = folder[: max(1, len(folder) - (node.level - 1))]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(source: str, relative_path: str) -> list[tuple[int, str]]:
    """(line, part) of every import anywhere in the file, relative imports resolved (`part_of`).

    `relative_path` is the file's path from the repository root (`inference/measure/bench.py`); it places
    relative imports (`from ..x import y` in `data/sub/a.py` is `data`). `from inference import decoding`
    imports the part `inference.decoding`.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=relative_path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, part_of(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, relative_path)
            parts = dict.fromkeys(part_of(f"{base}.{alias.name}") for alias in node.names)
            found += [(node.lineno, part) for part in parts]
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node)) is not None:
            found.append((node.lineno, part_of(name.lstrip("."))))
    return sorted(found, key=lambda item: item[0])  # in line order (the walk goes breadth first)


def boundary_violations(source: str, relative_path: str) -> list[str]:
    """`path:line: message` for every import of the file that breaks an arrow; [] when it keeps them all."""
    importer = part_of(module_name(relative_path))
    package = importer.split(".")[0]
    allowed = ALLOWED.get(importer, OUTSIDE_ALLOWED)
    label = importer if importer in ALLOWED else "a file outside the packages"
    problems = []
    for line, part in imported_modules(source, relative_path):
        where = f"{relative_path}:{line}"
        top = part.split(".")[0]
        if top in PACKAGES and part not in allowed and top not in allowed:
            problems.append(f"{where}: {label} may not import {part}")
        elif part == PIPELINE and importer not in PIPELINE_IMPORTERS:
            problems.append(f"{where}: {label} may not import {part} (only its entry points in inference/ do)")
        if package in NO_TRAINING_STACK and importer not in TRAINING_STACK_EXEMPT and top in TRAINING_STACK:
            problems.append(f"{where}: {package} may not import the training stack ({top})")
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


def test_the_checker_sees_the_inner_arrows_of_inference():
    """Inside `inference/` each subpackage is a part: the decoder may not import what measures or evaluates it."""
    source = (
        "from models.target import ImageTarget\n"
        "from inference.decoding.tree import Tree\n"
        "def run():\n"
        "    from inference.measure import bench\n"
        "from ..evaluation.scoring import fid\n"
        "from inference import evaluation, decoding\n"
        "import inference.bench\n"
    )
    assert boundary_violations(source, "inference/decoding/x.py") == [
        "inference/decoding/x.py:4: inference.decoding may not import inference.measure",
        "inference/decoding/x.py:5: inference.decoding may not import inference.evaluation",
        "inference/decoding/x.py:6: inference.decoding may not import inference.evaluation",
        "inference/decoding/x.py:7: inference.decoding may not import inference",
    ]
    assert boundary_violations(source, "inference/measure/x.py") == [
        "inference/measure/x.py:5: inference.measure may not import inference.evaluation",
        "inference/measure/x.py:6: inference.measure may not import inference.evaluation",
        "inference/measure/x.py:7: inference.measure may not import inference",
    ]
    assert boundary_violations(source, "inference/evaluation/x.py") == [
        "inference/evaluation/x.py:4: inference.evaluation may not import inference.measure",
        "inference/evaluation/x.py:7: inference.evaluation may not import inference",
    ]
    # an entry point at the top of inference/ calls its subpackage; data and training may import any part
    assert boundary_violations("from inference.measure.bench import main\n", "inference/bench.py") == []
    assert boundary_violations("from inference.evaluation.scoring import fid\n", "data/x.py") == []
    assert imported_modules("from . import tree\nfrom .. import measure\n", "inference/decoding/x.py") == [
        (1, "inference.decoding"),
        (2, "inference.measure"),
    ]


def test_the_checker_keeps_the_pipeline_measurements_apart():
    """`inference.measure.pipeline` may import the training side and the training stack; nothing else in
    `inference/` may, and nothing but itself and its entry points imports it."""
    source = (
        "import lightning\n"
        "from training.system import DrafterSystem\n"
        "from data.drafter_data import DrafterDataModule\n"
        "from inference.measure.provenance import provenance\n"
        "from inference.evaluation.scoring import fid\n"
        "from . import data_bench\n"
    )
    assert boundary_violations(source, "inference/measure/pipeline/x.py") == [
        "inference/measure/pipeline/x.py:5: inference.measure.pipeline may not import inference.evaluation"
    ]
    assert part_of("inference.measure.pipeline.data_bench") == PIPELINE
    assert imported_modules("from inference.measure import pipeline\n", "inference/measure/x.py") == [(1, PIPELINE)]
    assert boundary_violations(source, "inference/measure/x.py") == [
        "inference/measure/x.py:1: inference may not import the training stack (lightning)",
        "inference/measure/x.py:2: inference.measure may not import training",
        "inference/measure/x.py:3: inference.measure may not import data",
        "inference/measure/x.py:5: inference.measure may not import inference.evaluation",
    ]
    uses = "from inference.measure.pipeline.data_bench import write_synthetic\n"
    for importer in ("inference/measure/x.py", "inference/decoding/x.py", "inference/evaluation/x.py"):
        part = part_of(module_name(importer))
        assert boundary_violations(uses, importer) == [f"{importer}:1: {part} may not import {PIPELINE}"], importer
    for importer in ("data/x.py", "training/x.py", "scripts/tool.py"):  # may import inference, not the pipeline
        assert len(problems := boundary_violations(uses, importer)) == 1, importer
        assert problems[0].endswith(f"may not import {PIPELINE} (only its entry points in inference/ do)")
    assert boundary_violations("from inference.measure.pipeline.data_bench import main\n", "inference/x.py") == []


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
    found = {part_of(module_name(f.relative_to(ROOT).as_posix())) for f in files}
    for part in ALLOWED:  # the walk found every part (an empty walk would pass vacuously)
        assert part in found, f"no Python files found in {part.replace('.', '/')}/"
    problems = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        problems += boundary_violations(path.read_text(encoding="utf-8"), relative)
    assert not problems, "import arrows broken (see docs/architecture.md):\n" + "\n".join(problems)


def test_the_top_of_inference_holds_entry_points_only():
    """`inference/NAME.py` only keeps `python -m inference.NAME` working: it imports `main` from the module
    of the same name in one of the parts of `inference/`, and the code lives there."""
    tops = sorted(p for p in (ROOT / "inference").glob("*.py") if p.name != "__init__.py")
    assert tops, "no entry points found at the top of inference/"
    for path in tops:
        body = ast.parse(path.read_text(encoding="utf-8")).body
        imports = [(n.module, [a.name for a in n.names]) for n in body if isinstance(n, ast.ImportFrom)]
        assert imports in ([(f"inference.{part}.{path.stem}", ["main"])] for part in INFERENCE_PARTS), (path, imports)
        assert len(body) == 3, f"{path}: a docstring, the import and `if __name__ == '__main__': main()` only"


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Project module -> the project modules it imports, from {repository path: source}.

    Every import in the file counts: module level, under `if TYPE_CHECKING:` (a circle of type-only imports
    is still two modules that need each other) and inside functions (a deferred import only hides one).
    `from a.b import c` is the module `a.b.c` when that is a project module, else `a.b`; `import a.b.c` is
    the deepest of `a.b.c`, `a.b`, `a` that is one. A package is its `__init__.py`.
    """
    modules = {module_name(path) for path in sources}

    def deepest(name: str) -> str | None:
        parts = name.split(".")
        return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in modules), None)

    graph: dict[str, set[str]] = {}
    for path, source in sources.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(source, filename=path)):
            if isinstance(node, ast.Import):
                targets |= {deepest(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, path)
                targets |= {deepest(f"{base}.{alias.name}") for alias in node.names}
        graph[module_name(path)] = {t for t in targets if t is not None} - {module_name(path)}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other around a circle (strongly connected, two or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(groups)


def test_the_cycle_checker_sees_a_type_only_circle():
    """The cycle test must be able to fail: a pair joined by a TYPE_CHECKING import, a relative pair."""
    sources = {
        "models/a.py": "from models.b import B\n",
        "models/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from models.a import A\n",
        "models/c.py": "from models.a import A\n",  # imports into the circle, is not part of it
        "inference/decoding/x.py": "from . import y\n",
        "inference/decoding/y.py": "def f():\n    from .x import g\n",
        "inference/decoding/__init__.py": '"""A package."""\n',
    }
    graph = import_graph(sources)
    assert graph["models.c"] == {"models.a"} and graph["inference.decoding"] == set()
    assert import_cycles(graph) == [["inference.decoding.x", "inference.decoding.y"], ["models.a", "models.b"]]
    assert import_cycles(import_graph({"models/a.py": "import models.b\n", "models/b.py": "import torch\n"})) == []


def test_no_project_modules_import_each_other():
    """models.eagle and models.eagle_layers did (the layers' config type): both now read models.drafter_config."""
    sources = {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    graph = import_graph(sources)
    assert graph["models.eagle"] >= {"models.drafter_config", "models.eagle_layers"}  # the graph sees real imports
    cycles = import_cycles(graph)
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(group) for group in cycles)


def pipeline_entry_points() -> list[str]:
    """The modules at the top of `inference/` that run a pipeline measurement (`python -m inference.data_bench`)."""
    found = []
    for path in sorted((ROOT / "inference").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        if any(part_of(m) == PIPELINE for m in modules):
            found.append(f"inference.{path.stem}")
    return found


def test_models_and_inference_import_without_the_training_stack():
    """Every module of `models` and `inference` but the pipeline's measurements (and their entry points)."""
    skipped = pipeline_entry_points()
    assert "inference.data_bench" in skipped, skipped  # the skip list sees the entry points
    code = (
        "import sys, importlib, pkgutil\n"
        "import models, inference\n"
        "imported = []\n"
        "for package in (models, inference):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        f"        if info.name.startswith({PIPELINE + '.'!r}) or info.name in {skipped!r}:\n"
        "            continue\n"
        "        importlib.import_module(info.name)\n"
        "        imported.append(info.name)\n"
        f"print(sorted(m for m in {TRAINING_STACK!r} if m in sys.modules), len(imported))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    stack, count = result.stdout.split("]")
    assert stack == "[" and int(count) > 50, result.stdout


MAX_INFERENCE_FILE_LINES = 500
"""The decode-cost issue's bound on an `inference/` module: a file above it holds two concerns."""


def test_no_inference_module_is_above_500_lines():
    files = sorted((ROOT / "inference").rglob("*.py"))
    assert len(files) > 10, "inference/ has no modules to measure"
    long = {
        f.name: n for f in files if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_INFERENCE_FILE_LINES
    }
    assert not long, f"inference/ modules above {MAX_INFERENCE_FILE_LINES} lines (split them by concern): {long}"
