"""The seam app/service.py declares: the node runtime and the HTTP tests' double define every
member of ``KVService``, methods with the same parameters (names, kinds, defaults), the same
sync-or-async and the same declared result.

Why: ``KVService`` is a Protocol nobody type-checks against, so a member added, renamed or
re-typed on one side would otherwise drift silently until a route called it on a real node.
Read from the classes (nothing is started).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from app.runtime import NodeRuntime
from app.service import KVService
from tests.http.service_double import InProcessService

IMPLEMENTATIONS = [NodeRuntime, InProcessService]


def protocol_methods() -> dict[str, Callable[..., Any]]:
    return {name: member for name, member in vars(KVService).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def protocol_attributes() -> list[str]:
    return [name for name in KVService.__annotations__ if name not in protocol_methods()]


def parameters(function: Callable[..., Any]) -> list[tuple[str, object, object]]:
    """(name, kind, default) of every parameter but ``self``."""
    return [(parameter.name, parameter.kind, parameter.default)
            for parameter in list(inspect.signature(function).parameters.values())[1:]]


def assigned_in_init(implementation: type) -> set[str]:
    """Every ``self.<name> = ...`` in the ``__init__`` of the class or its bases."""
    names: set[str] = set()
    for klass in implementation.__mro__:
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            names.update(target.attr for target in targets
                         if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                         and target.value.id == "self")
    return names


def test_the_protocol_is_read_as_expected() -> None:
    """Guards the two helpers above: an empty reading would make every check pass."""
    assert {"get", "list", "changes", "status", "take_snapshot", "resign"} <= set(protocol_methods())
    assert {"node_id", "metrics", "auth_tokens", "compact"} <= set(protocol_attributes())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda cls: cls.__name__)
def test_every_method_has_the_protocols_signature(implementation: type) -> None:
    mismatches = []
    for name, declared in protocol_methods().items():
        defined = getattr(implementation, name, None)
        if not callable(defined):
            mismatches.append(f"{name}: missing")
            continue
        if parameters(defined) != parameters(declared):
            mismatches.append(f"{name}: parameters {inspect.signature(defined)} != {inspect.signature(declared)}")
        if inspect.iscoroutinefunction(defined) != inspect.iscoroutinefunction(declared):
            mismatches.append(f"{name}: async {inspect.iscoroutinefunction(defined)}, "
                              f"declared {inspect.iscoroutinefunction(declared)}")
        returned = inspect.signature(defined).return_annotation
        if returned != inspect.signature(declared).return_annotation:
            mismatches.append(f"{name}: returns {returned}, declared {inspect.signature(declared).return_annotation}")
    assert not mismatches, f"{implementation.__name__} drifted from KVService:\n" + "\n".join(mismatches)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda cls: cls.__name__)
def test_every_attribute_is_defined(implementation: type) -> None:
    defined = set(dir(implementation)) | assigned_in_init(implementation)
    missing = [name for name in protocol_attributes() if name not in defined]
    assert not missing, f"{implementation.__name__} lacks KVService's {missing}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda cls: cls.__name__)
def test_compact_is_none_or_an_async_call_without_arguments(implementation: type) -> None:
    """``compact`` is declared ``Callable[[], Awaitable[CompactReport]] | None``."""
    compact = getattr(implementation, "compact", None)
    if compact is None:
        return
    assert inspect.iscoroutinefunction(compact) and parameters(compact) == []
    assert inspect.signature(compact).return_annotation == "CompactReport"
