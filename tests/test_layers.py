"""Imports flow one way: app -> raft, storage, metakv; storage -> raft; raft and metakv (the
client) -> nothing of ours.

Two narrower rules on top: the HTTP front end (app/http/) reaches a node only through the
service seam (app/service.py) and the token policy (app/auth.py); the load tests do not lean
on the test suite. Read from the source with ``ast`` (nothing is imported), so an import
inside a function or an ``if TYPE_CHECKING:`` block counts too, and a relative import counts
as the module it resolves to.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUR_PACKAGES = frozenset({"raft", "storage", "app", "pipeline", "loadtest", "tests", "metakv"})
FORBIDDEN = {
    "raft": OUR_PACKAGES - {"raft"},
    "metakv": OUR_PACKAGES - {"metakv"},  # the client stands alone: only the public HTTP API
    "storage": frozenset({"app", "pipeline", "loadtest", "tests", "metakv"}),
    "app": frozenset({"pipeline", "loadtest", "tests"}),
    "loadtest": frozenset({"tests"}),
}
# All that the front ends app/http/ and app/ui/ (the dashboard) may import of ours (a module
# and what lies under it); app.tls: certificate names, stdlib only.
HTTP_MAY_IMPORT = ("app.service", "app.auth", "app.tls", "app.http", "app.ui")


def imported_modules(source: str, package: str) -> set[str]:
    """The dotted name of everything ``source`` imports (``from m import n`` gives ``m.n``,
    since ``n`` may be a module), relative imports resolved against ``package``, the
    importing module's own package."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = node.module.split(".") if node.module else []
            if node.level:
                package_parts = package.split(".")
                parts = package_parts[:len(package_parts) - (node.level - 1)] + parts
            names.update(".".join([*parts, alias.name]) for alias in node.names)
    return names


def imported_packages(source: str, package: str) -> set[str]:
    """Top-level package of every import in ``source`` (see ``imported_modules``)."""
    return {name.split(".")[0] for name in imported_modules(source, package)}


def _package_of(path: Path) -> str:
    return ".".join(path.parent.relative_to(ROOT).parts)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no Python files under {layer}/"
    violations = [
        f"{path.relative_to(ROOT)} imports {package}"
        for path in files
        for package in sorted(imported_packages(path.read_text(encoding="utf-8"), _package_of(path)) & FORBIDDEN[layer])
    ]
    assert not violations, "\n".join(violations)


def _http_may_import(name: str) -> bool:
    return name.split(".")[0] not in OUR_PACKAGES or any(
        name == allowed or name.startswith(allowed + ".") for allowed in HTTP_MAY_IMPORT)


def test_the_http_front_end_reaches_a_node_only_through_the_service() -> None:
    files = sorted([*(ROOT / "app" / "http").rglob("*.py"), *(ROOT / "app" / "ui").rglob("*.py")])
    assert files, "no Python files under app/http/"
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path.read_text(encoding="utf-8"), _package_of(path)))
        if not _http_may_import(name)
    ]
    assert not violations, "\n".join(violations)


def test_the_check_sees_imports_in_functions_and_type_checking_blocks() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import app.x\ndef f():\n    from storage import y\n"
    assert {"app", "storage"} <= imported_packages(source, "pipeline")


def test_the_check_resolves_relative_imports_within_the_package() -> None:
    source = "from . import keys\nfrom .models import Model\nfrom .. import runtime\nfrom ..service import KVService\n"
    assert imported_modules(source, "app.http") == {
        "app.http.keys", "app.http.models.Model", "app.runtime", "app.service.KVService"}
    assert imported_packages("from .cleaner import clean\n", "storage") == {"storage"}
    assert not _http_may_import("app.runtime") and _http_may_import("app.service.KVService")
