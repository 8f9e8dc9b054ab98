"""The tree's layering: the engine sits above the model, so layers/, models/, kernels/ and forward/
never import from engine/ (nor from io/, queue/ or the CLI)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"
ABOVE = ("batchgen.engine", "batchgen.io", "batchgen.queue", "batchgen.cli", "batchgen.llm")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("lower", ["layers", "models", "kernels", "forward"])
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
