"""Imports flow one way: app -> raft, storage; storage -> raft; raft -> nothing of ours.

Read from the source with ``ast`` (nothing is imported), so an import inside a function or
an ``if TYPE_CHECKING:`` block counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUR_PACKAGES = frozenset({"raft", "storage", "app", "pipeline", "loadtest", "tests"})
FORBIDDEN = {
    "raft": OUR_PACKAGES - {"raft"},
    "storage": frozenset({"app", "pipeline", "loadtest", "tests"}),
    "app": frozenset({"pipeline", "loadtest", "tests"}),
}


def imported_packages(source: str) -> set[str]:
    """Top-level package of every absolute import in ``source``."""
    packages: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            packages.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            packages.add(node.module.split(".")[0])
    return packages


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no Python files under {layer}/"
    violations = [
        f"{path.relative_to(ROOT)} imports {package}"
        for path in files
        for package in sorted(imported_packages(path.read_text(encoding="utf-8")) & FORBIDDEN[layer])
    ]
    assert not violations, "\n".join(violations)


def test_the_check_sees_imports_in_functions_and_type_checking_blocks() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import app.x\ndef f():\n    from storage import y\n"
    assert {"app", "storage"} <= imported_packages(source)
