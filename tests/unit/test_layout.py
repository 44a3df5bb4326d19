"""The layout's rules (README "Layout", DESIGN.md): dependencies point one way. Read from the
source with ast, so an import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"tandem": ROOT / "libs" / "tandem", "services": ROOT / "services"}


def module_name(path: Path) -> str:
    top, folder = next((top, folder) for top, folder in SOURCES.items() if folder in path.parents)
    parts = [top, *path.relative_to(folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every tandem or services module the file imports, wherever the import statement sits."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def group(module: str) -> str:
    """tandem.engine.scheduler -> tandem.engine; services.chat.app -> services.chat; tandem.config -> tandem.config."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for folder in SOURCES.values():
        for path in folder.rglob("*.py"):
            if "v1" in path.relative_to(folder).parts:
                continue  # generated protobuf code
            source = group(module_name(path))
            graph[source].update(group(m) for m in imported_modules(path) if group(m) != source)
    return graph


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
    assert GRAPH["tandem.engine"] <= {"tandem.models", "tandem.kernels"}


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
    # Depth-first search; a package met again while still on the path closes a cycle.
    on_path: list[str] = []
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(package: str) -> None:
        if package in done:
            return
        if package in on_path:
            cycles.append(on_path[on_path.index(package) :] + [package])
            return
        on_path.append(package)
        for dependency in sorted(GRAPH.get(package, ())):
            visit(dependency)
        on_path.pop()
        done.add(package)

    for package in sorted(GRAPH):
        visit(package)
    assert cycles == []
