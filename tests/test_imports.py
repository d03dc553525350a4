"""Imports follow the data flow: no cycle among jdp's modules, no module importing a layer above it,
nothing in the library (the benchmarks included) importing the CLI, user code (experiments, notebook)
using `jdp` only, and `import jdp` leaving out what only some calls need (matplotlib, the test helpers).

Read from the source with `ast` (nothing is imported), including imports inside functions; the last
check runs `import jdp` in a fresh interpreter.
"""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (layer, modules): a module may import modules of its own layer or a lower one. A name covers the
# module itself and everything under it, the most specific name winning (jdp.models.lenet over jdp.models).
LAYERS = (
    (0, ("jdp.errors", "jdp.types")),
    (1, ("jdp.runtime",)),
    (2, ("jdp.data", "jdp.plot")),
    (3, ("jdp.models",)),
    (4, ("jdp.parallel",)),
    (5, ("jdp.training",)),
    (6, ("jdp.testing", "jdp.flags")),  # jdp.flags: the flags the CLI and the benchmarks share
    (7, ("jdp.bench",)),
    (8, ("jdp.cli",)),  # jdp.cli.main included
    (9, ("jdp", "jdp.__main__")),  # "jdp" is jdp/__init__.py only
)
CLI_ENTRY_POINTS = ("jdp.__main__",)  # besides jdp/cli/ itself, the one module that may import the CLI


def is_cli(module: str) -> bool:
    """jdp.cli or anything under it: what only jdp/cli/ (and `python -m jdp`) may import."""
    return module == "jdp.cli" or module.startswith("jdp.cli.")


def layer_table() -> str:
    return "layers (a module may import its own layer or lower ones):\n" + "\n".join(
        f"  {layer}: {', '.join(names)}" for layer, names in LAYERS)


def layer_of(module: str) -> int | None:
    best = None
    for layer, names in LAYERS:
        for name in names:
            matches = module == name or (name != "jdp" and module.startswith(name + "."))
            if matches and (best is None or len(name) > len(best[1])):
                best = (layer, name)
    return None if best is None else best[0]


# ---------------------------------------------------------------------------------------------
# The import graph.


def module_files(package_dir: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file of the package at `package_dir` (`<pkg>/__init__.py` is `<pkg>`)."""
    package_dir = Path(package_dir)
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_package(modules: dict[str, Path], module: str) -> bool:
    return modules[module].name == "__init__.py"


def _known(modules: dict[str, Path], name: str) -> str:
    """The longest prefix of the dotted `name` that is one of `modules` (what the import executes last)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else name


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import in `path`, at any depth."""
    package = modules and next(iter(modules)).split(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    found.append((_known(modules, alias.name), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, up level - 1
                base = module.split(".") if _is_package(modules, module) else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != package:
                continue
            for alias in node.names:  # `from jdp import models` imports the module jdp.models
                child = f"{source}.{alias.name}"
                found.append((child if child in modules else _known(modules, source), node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.split(".")[0] == package):
            found.append((_known(modules, node.args[0].value), node.lineno))
    return found


def import_graph(package_dir: Path) -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    modules = module_files(package_dir)
    return modules, {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """One import cycle [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target, _ in graph.get(module, ()):
            if target == module:
                continue  # `from jdp.models import Model` inside jdp/models/__init__.py is not a cycle
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def package_problems(package_dir: Path) -> list[str]:
    """Every way the package at `package_dir` breaks the import rules, as readable lines."""
    modules, graph = import_graph(package_dir)
    problems = []
    for module in sorted(modules):
        if layer_of(module) is None:
            problems.append(f"{module} is in no layer: add it to LAYERS in tests/test_imports.py")
    for module, targets in sorted(graph.items()):
        rel = modules[module].relative_to(Path(package_dir).parent)
        for target, line in targets:
            have, want = layer_of(module), layer_of(target)
            if have is not None and want is not None and want > have:
                problems.append(f"{rel}:{line}: {module} (layer {have}) imports {target} (layer {want}), "
                                "against the data flow")
            if is_cli(target) and not is_cli(module) and module not in CLI_ENTRY_POINTS:
                problems.append(f"{rel}:{line}: {module} imports the CLI ({target}); only jdp/cli/ may")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    return problems


def assert_no_problems(problems: list[str]) -> None:
    assert not problems, "\n".join(["", *problems, "", layer_table()])


# ---------------------------------------------------------------------------------------------
# User code: experiments and the notebook use `import jdp` and the names of jdp.__all__ only.


def public_names(package_dir: Path) -> set[str]:
    tree = ast.parse((Path(package_dir) / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{package_dir}/__init__.py defines no literal __all__")


def notebook_code(path: Path) -> str:
    """The code cells, IPython magics and shell lines blanked (line numbers count from the first cell)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    lines = []
    for cell in cells:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        lines += ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    return "\n".join(lines) + "\n"


def user_code_problems(name: str, source: str, public: set[str]) -> list[str]:
    """How `source` reaches past `import jdp` and `jdp.__all__`: submodule imports, private names."""
    problems, aliases = [], set()
    tree = ast.parse(source, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "jdp":
                    aliases.add(alias.asname or "jdp")
                elif alias.name.startswith("jdp."):
                    problems.append(f"{name}:{node.lineno}: `import {alias.name}`: import `jdp` only")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jdp" and not node.level:
            if node.module != "jdp":
                problems.append(f"{name}:{node.lineno}: `from {node.module} import ...`: use `jdp` only")
                continue
            for alias in node.names:
                if alias.name not in public:
                    problems.append(f"{name}:{node.lineno}: `from jdp import {alias.name}`: not in jdp.__all__")
    for node in ast.walk(tree):  # jdp.training.loop.train would work too, as jdp imports it: not public
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr not in public):
            problems.append(f"{name}:{node.lineno}: `{node.value.id}.{node.attr}` is not in jdp.__all__")
    return problems


def user_problems(root: Path) -> list[str]:
    public = public_names(root / "jdp")
    problems = []
    for path in sorted((root / "experiments").glob("*.py")):
        problems += user_code_problems(str(path.relative_to(root)), path.read_text(), public)
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        problems += user_code_problems(str(path.relative_to(root)), notebook_code(path), public)
    return problems


# ---------------------------------------------------------------------------------------------
# The tests.


def test_every_module_is_parsed_and_placed():
    modules, graph = import_graph(ROOT / "jdp")
    assert {"jdp", "jdp.__main__", "jdp.errors", "jdp.cli.main", "jdp.cli.errors", "jdp.flags", "jdp.models.lenet",
            "jdp.training.loop"} <= set(modules)
    assert "jdp.cli.flags" not in modules  # the shared flags live below the CLI and the benchmarks: jdp.flags
    assert any(target == "jdp.models.lenet" for target, _ in graph["jdp.models"])  # `from jdp.models import lenet`
    assert any(target == "jdp.bench.allreduce" for target, _ in graph["jdp.cli.main"])  # inside a function


def test_jdp_imports_follow_the_data_flow_without_cycles():
    assert_no_problems(package_problems(ROOT / "jdp"))


def test_the_benchmarks_never_import_the_cli():
    modules, graph = import_graph(ROOT / "jdp")
    bench = [m for m in modules if m.startswith("jdp.bench.")]
    assert bench and all(any(t == "jdp.flags" for t, _ in graph[m]) for m in bench if m.split(".")[-1] in (
        "allreduce", "step", "train", "memory", "formulations"))
    assert [(m, t) for m in bench for t, _ in graph[m] if is_cli(t)] == []


def test_import_jdp_leaves_out_matplotlib_and_the_test_helpers():
    """`jdp.plot` and `jdp.testing` are imported on first use (jdp/__init__.py's `__getattr__`)."""
    code = ("import sys, jdp\n"
            "print(sorted(m for m in ('matplotlib', 'jdp.plot', 'jdp.testing', 'tqdm', 'flax', 'tensorflow_datasets')"
            " if m in sys.modules))\n"
            "assert jdp.plot.accuracy_per_epoch and jdp.testing.check_allreduce and 'plot' in dir(jdp)\n"
            "print('matplotlib' in sys.modules, 'jdp.testing' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True True"]


def test_experiments_and_notebook_use_only_the_public_api():
    assert list((ROOT / "experiments").glob("*.py")) and list((ROOT / "notebooks").glob("*.ipynb"))
    assert_no_problems(user_problems(ROOT))


@pytest.fixture
def tree_copy(tmp_path):
    """A copy of the source tree (jdp/, experiments/, notebooks/) to plant bad imports in."""
    for name in ("jdp", "experiments", "notebooks"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    return tmp_path


def plant(path: Path, line: str, *, in_function: bool = False) -> None:
    code = f"\n\ndef _planted():\n    {line}\n" if in_function else f"\n{line}\n"
    path.write_text(path.read_text() + code)


def test_check_catches_a_benchmark_importing_the_cli(tree_copy):
    plant(tree_copy / "jdp" / "bench" / "step.py", "from jdp.cli.errors import in_flags", in_function=True)
    problems = package_problems(tree_copy / "jdp")
    assert any("jdp.bench.step (layer 7) imports jdp.cli.errors (layer 8)" in p for p in problems), problems
    assert any("jdp.bench.step imports the CLI (jdp.cli.errors)" in p for p in problems), problems


def test_check_catches_an_import_against_the_data_flow(tree_copy):
    plant(tree_copy / "jdp" / "models" / "lenet.py", "from jdp.cli import main", in_function=True)
    problems = package_problems(tree_copy / "jdp")
    assert any("jdp.models.lenet (layer 3) imports jdp.cli.main (layer 8)" in p for p in problems), problems
    assert any("jdp.models.lenet imports the CLI" in p for p in problems), problems
    with pytest.raises(AssertionError, match="layers"):
        assert_no_problems(problems)


def test_check_catches_an_import_of_the_package_from_inside(tree_copy):
    plant(tree_copy / "jdp" / "training" / "keeper.py", "import jdp")
    problems = package_problems(tree_copy / "jdp")
    assert any("jdp.training.keeper (layer 5) imports jdp (layer 9)" in p for p in problems), problems


def test_check_catches_a_cycle_within_a_layer(tree_copy):
    plant(tree_copy / "jdp" / "models" / "lenet.py", "from . import lenet_fast", in_function=True)
    problems = package_problems(tree_copy / "jdp")
    assert problems == ["import cycle: jdp.models.lenet -> jdp.models.lenet_fast -> jdp.models.lenet"], problems


def test_check_catches_a_module_in_no_layer(tree_copy):
    (tree_copy / "jdp" / "extra.py").write_text("from jdp.errors import ConfigError\n")
    assert package_problems(tree_copy / "jdp") == [
        "jdp.extra is in no layer: add it to LAYERS in tests/test_imports.py"]


def test_check_catches_user_code_reaching_past_the_api(tree_copy):
    plant(tree_copy / "experiments" / "eval.py", "from jdp.training.loop import train", in_function=True)
    plant(tree_copy / "experiments" / "scaling.py", "import jdp; jdp.training.checkpoint.list_checkpoints('.')")
    notebook = tree_copy / "notebooks" / "multiple_devices_from_scratch.ipynb"
    nb = json.loads(notebook.read_text())
    nb["cells"].append({"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                        "source": ["%matplotlib inline\n", "from jdp import main\n"]})
    notebook.write_text(json.dumps(nb))
    problems = "\n".join(user_problems(tree_copy))
    assert "experiments/eval.py" in problems and "from jdp.training.loop import" in problems, problems
    assert "experiments/scaling.py" in problems and "`jdp.training` is not in jdp.__all__" in problems, problems
    assert "`from jdp import main`: not in jdp.__all__" in problems, problems
