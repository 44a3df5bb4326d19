"""The layout's rules (DESIGN.md "Layout"): dependencies point one way, no two modules import each
other (however far round), and no source file grows past MAX_LINES. Read from the source with ast,
so an import inside a function or under TYPE_CHECKING counts as much as one at the top: a circle a
reader has to untangle is a circle, whether or not Python would trip on it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"tandem": ROOT / "libs" / "tandem", "services": ROOT / "services"}
MAX_LINES = 450  # STYLE.md: one concept per file, usually under 300 lines


def module_name(path: Path) -> str:
    top, folder = next((top, folder) for top, folder in SOURCES.items() if folder in path.parents)
    parts = [top, *path.relative_to(folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every tandem or services module the file imports, wherever the import statement sits."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> set[str]:
    """The tandem or services names a module's source imports; `package` resolves relative imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in SOURCES}


def source_files() -> list[Path]:
    """Every hand-written module: libs/tandem and services, without the generated protobuf code."""
    return [path for folder in SOURCES.values() for path in sorted(folder.rglob("*.py")) if "v1" not in path.relative_to(folder).parts]


MODULES = {module_name(path): path for path in source_files()}


def as_module(name: str) -> str | None:
    """`tandem.engine.scheduler.Scheduler` -> `tandem.engine.scheduler`: the longest prefix that is a
    module. `from tandem.kvtransfer import wire` names the module wire, not the package. None for
    the generated code (tandem.v1), which imports nothing of ours."""
    if name.startswith("tandem.v1.") or name == "tandem.v1":
        return None
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        names = imported_modules(path)
        # `from package import module`: both names are found; the module alone is what is used.
        used = {as_module(name) for name in names if not any(other.startswith(name + ".") for other in names)}
        graph[module] = {name for name in used if name is not None and name != module}
    return graph


def group(module: str) -> str:
    """tandem.engine.scheduler -> tandem.engine; services.chat.app -> services.chat; tandem.config -> tandem.config."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, dependencies in module_graph().items():
        graph[group(module)].update(group(m) for m in dependencies if group(m) != group(module))
    return graph


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """Depth-first search; a node met again while still on the path closes a cycle."""
    on_path: list[str] = []
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        if node in done:
            return
        if node in on_path:
            cycles.append(on_path[on_path.index(node) :] + [node])
            return
        on_path.append(node)
        for dependency in sorted(graph.get(node, ())):
            visit(dependency)
        on_path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    return cycles


GRAPH = package_graph()


def test_the_graph_sees_the_imports_it_should():
    # A guard for the guard: a parser that found nothing would pass every rule below.
    assert "tandem.kernels" in GRAPH["tandem.models"]
    assert "tandem.engine" in GRAPH["tandem.worker"]
    assert "tandem.runtime" in GRAPH["services.chat"]


@pytest.mark.parametrize("package", ["tandem.models", "tandem.kernels"])
def test_models_and_kernels_never_import_the_engine(package):
    assert "tandem.engine" not in GRAPH[package]


def test_the_engine_imports_only_models_kernels_and_itself():
    # errors: StartupError, a leaf; structured_output: grammar specs, a leaf the chat checks specs with too
    assert GRAPH["tandem.engine"] <= {"tandem.models", "tandem.kernels", "tandem.errors", "tandem.structured_output"}
    assert GRAPH.get("tandem.structured_output", set()) == set()


def test_libs_never_import_services():
    offenders = {
        package: sorted(d for d in deps if d.startswith("services.")) for package, deps in GRAPH.items() if package.startswith("tandem.")
    }
    assert {package: deps for package, deps in offenders.items() if deps} == {}


def test_services_never_import_each_other():
    offenders = {
        package: sorted(d for d in deps if d.startswith("services.")) for package, deps in GRAPH.items() if package.startswith("services.")
    }
    assert {package: deps for package, deps in offenders.items() if deps} == {}


def test_packages_import_each_other_without_a_cycle():
    assert cycles_in(GRAPH) == []


def test_the_cycle_finder_finds_a_circle_through_a_type_checking_import():
    # A guard for the guard below, on a package of three modules written here.
    sources = {
        "tandem.demo.a": "from tandem.demo.b import B\n",
        "tandem.demo.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\nB = 1\n",
        "tandem.demo.c": "def f():\n    from tandem.demo.a import A\n",
    }
    graph = {module: {name for name in imports_in(source, "tandem.demo") if name.count(".") == 2} for module, source in sources.items()}
    assert cycles_in(graph) == [["tandem.demo.a", "tandem.demo.b", "tandem.demo.c", "tandem.demo.a"]]


def test_no_two_modules_import_each_other_however_far_round():
    assert cycles_in(module_graph()) == []


def test_no_source_file_is_longer_than_the_limit():
    bench = sorted((ROOT / "bench").rglob("*.py"))
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in [*source_files(), *bench]}
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}
