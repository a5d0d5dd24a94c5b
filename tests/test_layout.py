"""The layout's rules, read from the code's own imports (with `ast`, imports inside functions
included): no import cycle between modules, packages depend one way (runtime -> treeflash_export
-> kernels, plugins -> kernels), the models reach the kernels only through the custom ops, and no
folder holds more than a dozen modules side by side."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"treeflash_export": "treeflash_export", "treeflash_runtime": "runtime", "treeflash_kernels": "kernels",
           "treeflash_plugins": "plugins"}
# What each installed package may import from the others (itself always).
ALLOWED = {
    "treeflash_kernels": set(),
    "treeflash_plugins": {"treeflash_kernels"},
    "treeflash_export": {"treeflash_kernels", "treeflash_plugins"},
    "treeflash_runtime": {"treeflash_export", "treeflash_kernels", "treeflash_plugins"},
}
MAX_MODULES = 12


def project_modules(folders: dict[str, str] = FOLDERS, root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    mods = {}
    for pkg, folder in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            mods[".".join([pkg, *(p for p in rel.parts if p != "__init__")])] = (path, path.name == "__init__.py")
    return mods


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file. `from package import name`
    counts as importing package.name when that is a module, else the package."""
    graph = {}
    for name, (path, is_init) in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_init else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # `import a.b.c` names a.b.c; a class names its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph(project_modules())


def test_the_checks_see_a_cycle_and_an_import_inside_a_function(tmp_path):
    """The reader itself: a cycle closed only by an import inside a function is found."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg.a import f\n")
    g = import_graph(project_modules({"pkg": "pkg"}, tmp_path))
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.a"} and g["pkg.c"] == {"pkg.a"}
    assert find_cycle(g) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_no_import_cycle(graph):
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_packages_import_one_way(graph):
    wrong = [f"{a} -> {b}" for a, deps in graph.items() for b in deps
             if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]]]
    assert not wrong, wrong


def test_models_reach_the_kernels_only_through_the_custom_ops(graph):
    wrong = [f"{a} -> {b}" for a, deps in graph.items() if a.startswith("treeflash_export.models")
             for b in deps if b.startswith("treeflash_kernels") and b != "treeflash_kernels.ops"]
    assert not wrong, wrong


@pytest.mark.parametrize("top", [*FOLDERS.values(), "tests"])
def test_no_folder_holds_more_than_a_dozen_modules(top):
    crowded = {}
    for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
        if "__pycache__" in folder.parts:
            continue
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_MODULES:
            crowded[str(folder.relative_to(ROOT))] = count
    assert not crowded, crowded


# The round's core (the runner contract and backends, the plan/report values, the scheduler, the engine
# loop and one generation) sits below the policies and the front ends: nothing in it imports upwards.
CORE = ("treeflash_runtime.backends", "treeflash_runtime.plan", "treeflash_runtime.scheduler",
        "treeflash_runtime.engine", "treeflash_runtime.loop", "treeflash_runtime.sampling")
ABOVE = ("treeflash_runtime.tuner", "treeflash_runtime.serving", "treeflash_runtime.bench", "treeflash_runtime.cli",
         "treeflash_runtime.options", "treeflash_runtime.factory", "treeflash_runtime.offline")


def test_the_rounds_core_imports_nothing_above_it(graph):
    def under(module, prefixes):
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    wrong = [f"{a} -> {b}" for a, deps in graph.items() if under(a, CORE) for b in deps if under(b, ABOVE)]
    assert not wrong, wrong
    assert any(under(m, CORE) for m in graph) and any(under(m, ABOVE) for m in graph)  # the names are real
