"""The tree's layering, top down: the CLI, io/ and queue/; llm.py; replicas/ (data parallelism: engines in
child processes); engine/ (the host: the loop, scheduling, finish rules); executor/ (the device: model
runner, memory, graphs, sampling); models/; layers/; parallel/ (the tensor-parallel group, child
processes); kernels/. No floor imports a floor above it, the host reaches the
model only through the executor, kernels/ import no other part of batchgen, and no module imports
itself through others (no import circle)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"
ABOVE = ("batchgen.engine", "batchgen.executor", "batchgen.io", "batchgen.queue", "batchgen.cli", "batchgen.llm",
         "batchgen.ray", "batchgen.replicas")
HOST = ("batchgen.engine", "batchgen.io", "batchgen.queue", "batchgen.cli", "batchgen.llm", "batchgen.ray",
        "batchgen.replicas")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth of the file (`from a import b` names a.b too: b may be a
    module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """batchgen's modules -> the batchgen modules each imports: `from p import x` counts as p.x where
    that is a module, else as p; a package's own submodules importing it back (`from batchgen.io import
    sinks` inside batchgen.io) is not counted (Python's ordinary package layout)."""
    files = {module_name(f): f for f in PACKAGE.rglob("*.py")}
    graph = {}
    for name, f in files.items():
        edges = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    edges.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files else node.module)
        graph[name] = {m for m in edges if m in files and m != name and not name.startswith(m + ".")}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (circle := visit(imported)):
                return circle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return None


@pytest.mark.parametrize("lower", ["layers", "models", "kernels", "parallel"])
def test_lower_packages_do_not_import_upwards(lower):
    files = sorted((PACKAGE / lower).rglob("*.py"))
    assert files
    upward = {
        f"{f.relative_to(PACKAGE)} imports {m}"
        for f in files
        for m in imported_modules(f)
        if m.startswith(ABOVE)
    }
    assert not upward


def test_the_executor_does_not_import_the_host():
    upward = {
        f"{f.relative_to(PACKAGE)} imports {m}"
        for f in sorted((PACKAGE / "executor").rglob("*.py"))
        for m in imported_modules(f)
        if m.startswith(HOST)
    }
    assert not upward


def test_one_engine_knows_nothing_of_replicas():
    """engine/ runs one engine; replicas/ and llm.py compose engines, above it."""
    upward = {
        f"{f.relative_to(PACKAGE)} imports {m}"
        for f in sorted((PACKAGE / "engine").rglob("*.py"))
        for m in imported_modules(f)
        if m.startswith(("batchgen.replicas", "batchgen.llm"))
    }
    assert not upward


def test_the_host_reaches_the_model_only_through_the_executor():
    """engine/ plans steps and judges tokens; what runs on the device (kernels, layers) is the executor's."""
    past = {
        f"{f.relative_to(PACKAGE)} imports {m}"
        for f in sorted((PACKAGE / "engine").rglob("*.py"))
        for m in imported_modules(f)
        if m.startswith(("batchgen.kernels", "batchgen.layers"))
    }
    assert not past


def test_kernels_import_nothing_else_of_batchgen():
    """kernels/ is the floor: not layers/, parallel/, models/ nor the config (settings come as arguments)."""
    outside = {
        f"{f.relative_to(PACKAGE)} imports {m}"
        for f in sorted((PACKAGE / "kernels").rglob("*.py"))
        for m in imported_modules(f)
        if m.startswith("batchgen") and not m.startswith("batchgen.kernels")
    }
    assert not outside


def test_no_import_circle():
    assert find_circle(import_graph()) is None


def test_find_circle_finds_one():
    """The search itself: a circle of three and one of a module with itself through another."""
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "e"}, "e": {"d"}}) == ["d", "e", "d"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
