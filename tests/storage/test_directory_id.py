"""The data directory's id (storage/data_dir.py, KIP-853): made with the directory, kept,
given to a directory from before it, and a damaged one refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raft.voters import is_directory_id
from storage.data_dir import DataDirError, check_identity


def test_a_new_directory_gets_a_random_id_that_every_later_start_keeps(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first = check_identity(tmp_path / "a", "c", 1)
    assert is_directory_id(first)
    assert check_identity(tmp_path / "a", "c", 1) == first
    (tmp_path / "b").mkdir()
    assert check_identity(tmp_path / "b", "c", 1) != first  # another directory, another replica


def test_a_directory_from_before_directory_ids_gets_one_and_keeps_it(tmp_path: Path) -> None:
    identity = tmp_path / "identity.json"
    identity.write_text(json.dumps({"cluster_id": "c", "node_id": 2}))
    given = check_identity(tmp_path, "c", 2)
    assert is_directory_id(given) and json.loads(identity.read_text())["directory_id"] == given
    assert check_identity(tmp_path, "c", 2) == given


def test_a_damaged_directory_id_is_refused_with_the_way_out(tmp_path: Path) -> None:
    (tmp_path / "identity.json").write_text(json.dumps({"cluster_id": "c", "node_id": 2, "directory_id": "XYZ"}))
    with pytest.raises(DataDirError) as refused:
        check_identity(tmp_path, "c", 2)
    assert "'XYZ' is not 32 lowercase hex digits" in str(refused.value)
