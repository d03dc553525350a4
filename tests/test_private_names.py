"""No module of jdp reaches into another module's private (underscore) names.

Read from the source with `ast` (nothing is imported): `from jdp.x import _name`, and `_name`
read as an attribute of an imported jdp module (`import jdp.x as m; m._name`, `from jdp import x; x._name`).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def private_reaches(source: str, module: str) -> list[str]:
    """Each place in `source` (the code of `module`) that uses another jdp module's underscore name."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the jdp module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jdp"):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "jdp"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jdp"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and node.module != module:
                    found.append(f"{module}:{node.lineno} imports {node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and aliases[node.value.id] != module):
            found.append(f"{module}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    return sorted(found, key=lambda line: (int(line.split(":")[1].split()[0]), line))


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "jdp").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def test_no_module_uses_another_modules_private_names():
    found = [line for name, path in modules().items() for line in private_reaches(path.read_text(), name)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_catches_both_forms():
    source = ("from jdp.parallel.buckets import _bounds, layout_of\n"
              "from jdp.parallel import transfers\n"
              "import jdp.parallel.step as step\n"
              "x = transfers._ordered_shards(1) + step._reduce\n"
              "y = transfers.manual\n")
    assert private_reaches(source, "jdp.parallel.zero") == [
        "jdp.parallel.zero:1 imports jdp.parallel.buckets._bounds",
        "jdp.parallel.zero:4 reads jdp.parallel.step._reduce",
        "jdp.parallel.zero:4 reads jdp.parallel.transfers._ordered_shards",
    ]
    assert private_reaches("from jdp.parallel.buckets import _bounds\n", "jdp.parallel.buckets") == []
