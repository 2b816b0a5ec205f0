"""Settings `metakv serve` refuses before it starts anything: exit code 2 and one line naming
the setting (and the file or variable it came from). Each case runs main() in-process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import app.cli
from app.cli import main


def serve_args(tmp_path: Path, **overrides: str | None) -> list[str]:
    """A valid single-voter `serve` command line with some flags replaced (None: left out)."""
    flags: dict[str, str | None] = {
        "--node-id": "1", "--data-dir": str(tmp_path / "data"), "--listen-http": "127.0.0.1:1",
        "--listen-raft": "127.0.0.1:2", "--voters": "1@127.0.0.1:2",
    }
    flags.update({"--" + name.replace("_", "-"): value for name, value in overrides.items()})
    args = ["serve"]
    for flag, value in flags.items():
        if value is not None:
            args += [flag, value]
    return args


@pytest.fixture
def refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """refused(args, env) -> the one stderr line of a `metakv` run that must exit 2."""
    for key in [key for key in os.environ if key.startswith("METAKV_")]:
        monkeypatch.delenv(key)

    def must_not_start(config: object) -> int:
        raise AssertionError(f"the configuration was accepted and a node would start: {config}")

    monkeypatch.setattr(app.cli, "serve", must_not_start)

    def run(args: list[str], env: dict[str, str] | None = None) -> str:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        code = main(args)
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert code == 2, captured.err
        assert len(lines) == 1, captured.err
        assert captured.out == ""
        return lines[0]

    return run


def test_a_toml_file_with_a_serve_table_refuses_keys_outside_it(tmp_path: Path, refused) -> None:  # type: ignore[no-untyped-def]
    """TOML puts keys written above [serve] at the top level: they must not vanish silently."""
    config = tmp_path / "mixed.toml"
    config.write_text('data_dirr = "/tmp/x"\ncluster_secret = "prod"\n[serve]\nnode_id = 1\n')
    line = refused([*serve_args(tmp_path, node_id=None), "--config", str(config)])
    assert "'cluster_secret'" in line and str(config) in line and "[serve]" in line
    config.write_text('cluster_secret = "prod"\n[serve]\nnode_id = 1\n')  # a known name too
    line = refused([*serve_args(tmp_path, node_id=None), "--config", str(config)])
    assert "'cluster_secret'" in line and "outside [serve]" in line


def test_unknown_keys_inside_the_serve_table_are_still_refused(tmp_path: Path, refused) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "typo.toml"
    config.write_text('[serve]\nnode_id = 1\ndata_dirr = "/tmp/x"\n')
    line = refused([*serve_args(tmp_path, node_id=None), "--config", str(config)])
    assert "unknown setting 'data_dirr'" in line and str(config) in line


def test_an_empty_data_dir_is_refused_not_the_current_directory(tmp_path: Path, refused,  # type: ignore[no-untyped-def]
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert "--data-dir: must not be empty" in refused(serve_args(tmp_path, data_dir=""))
    line = refused(serve_args(tmp_path, data_dir=None), env={"METAKV_DATA_DIR": ""})
    assert "METAKV_DATA_DIR: must not be empty" in line
    assert list(tmp_path.iterdir()) == []  # nothing was written to the current directory
