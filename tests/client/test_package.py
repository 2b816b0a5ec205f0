"""The client as a package: what `pip install` gives a user."""

from __future__ import annotations

import tomllib
from pathlib import Path

import metakv

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_is_marked_typed_and_ships_the_marker() -> None:
    """PEP 561: without py.typed, mypy and pyright ignore the client's type hints."""
    assert (Path(metakv.__file__).parent / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data.get("metakv", [])


def test_every_exception_is_exported_and_a_metakv_error() -> None:
    for name in metakv.__all__:
        exported = getattr(metakv, name)
        if isinstance(exported, type) and issubclass(exported, Exception):
            assert issubclass(exported, metakv.MetakvError), name
    assert {"ClientClosed", "Compacted", "Conflict", "Indeterminate", "Unavailable"} <= set(metakv.__all__)
