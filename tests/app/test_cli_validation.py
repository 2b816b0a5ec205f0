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
        try:
            code = main(args)
        finally:
            for key in env or {}:
                monkeypatch.delenv(key)
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


@pytest.mark.parametrize("toml_value", ["1.7", "1e400", "nan"])
def test_a_non_integral_toml_number_is_not_truncated_to_an_integer(tmp_path: Path, refused,  # type: ignore[no-untyped-def]
                                                                     toml_value: str) -> None:
    config = tmp_path / "float.toml"
    config.write_text(f"node_id = {toml_value}\n")
    line = refused([*serve_args(tmp_path, node_id=None), "--config", str(config)])
    assert line.startswith("metakv: error: node_id (in ") and "expected an integer" in line


def test_an_integral_toml_float_is_still_an_integer(tmp_path: Path) -> None:
    from app.config import build_node_config

    config = tmp_path / "float.toml"
    config.write_text("node_id = 1.0\nelection_timeout_ms = 1500.0\n")
    flags = {"data_dir": str(tmp_path), "listen_http": "127.0.0.1:1", "listen_raft": "127.0.0.1:2",
             "voters": "1@127.0.0.1:2"}
    node = build_node_config(flags, environ={}, config_path=str(config))
    assert (node.node_id, node.election_timeout_ms) == (1, 1500)


def test_a_voter_on_port_0_or_two_voters_on_one_address_are_refused(tmp_path: Path, refused) -> None:  # type: ignore[no-untyped-def]
    line = refused(serve_args(tmp_path, node_id="2", listen_raft="127.0.0.1:19102",
                              voters="1@127.0.0.1:0,2@127.0.0.1:19102"))
    assert "--voters port: 0 is outside [1, 65535]" in line
    line = refused(serve_args(tmp_path, voters="1@127.0.0.1:2,2@127.0.0.1:2"))
    assert "--voters: voters 1 and 2 have the same raft address 127.0.0.1:2" in line


def test_max_batch_bytes_must_hold_one_write_of_max_value_bytes(tmp_path: Path, refused) -> None:  # type: ignore[no-untyped-def]
    """A 2000-byte PUT under --max-batch-bytes 1024 used to answer 503 (retry) forever."""
    line = refused(serve_args(tmp_path, max_batch_bytes="1024", max_value_bytes="2000"))
    assert "--max-batch-bytes: 1024 cannot hold one write of --max-value-bytes 2000" in line
    assert "at least max_value_bytes + 8192 = 10192" in line
    line = refused(serve_args(tmp_path, max_value_bytes=str(8 * 1024 * 1024)))  # the default batch size
    assert "--max-batch-bytes: 8388608 cannot hold" in line


def test_the_max_batch_bytes_rule_covers_the_largest_put_the_http_layer_accepts(tmp_path: Path) -> None:
    """The rule's 8 KiB is not a guess: the largest PUT record (a 1024-byte key in the op and in
    three compares, a 256-byte content type) fits a batch of exactly the minimum size."""
    from app.config import RECORD_FRAMING_MAX_BYTES, build_node_config
    from app.http.settings import CONTENT_TYPE_MAX_BYTES, KEY_MAX_BYTES
    from raft.types import BATCH_OVERHEAD_BYTES, RECORD_OVERHEAD_BYTES
    from storage.commands import Command, Compare, CompareKind, Op, OpKind, encode_command

    max_value_bytes = 2000
    flags = {"node_id": "1", "data_dir": str(tmp_path), "listen_http": "127.0.0.1:1", "listen_raft": "127.0.0.1:2",
             "voters": "1@127.0.0.1:2", "max_value_bytes": str(max_value_bytes),
             "max_batch_bytes": str(max_value_bytes + RECORD_FRAMING_MAX_BYTES)}
    node = build_node_config(flags, environ={})
    key = "k" * KEY_MAX_BYTES
    largest = Command(tuple(Compare(key, CompareKind.MOD_VERSION, 2**63 - 1) for _ in range(3)),
                      (Op(OpKind.PUT, key, b"v" * max_value_bytes, "t/" + "x" * (CONTENT_TYPE_MAX_BYTES - 2)),))
    record_bytes = len(encode_command(largest))
    assert record_bytes + RECORD_OVERHEAD_BYTES + BATCH_OVERHEAD_BYTES <= node.max_batch_bytes


def test_an_unknown_metakv_environment_variable_is_refused_naming_the_closest(tmp_path: Path, refused) -> None:  # type: ignore[no-untyped-def]
    """METAKV_CLUSTER_SECRETS=prod used to start the node on the default insecure secret."""
    line = refused(serve_args(tmp_path), env={"METAKV_CLUSTER_SECRETS": "prod"})
    assert line == ("metakv: error: METAKV_CLUSTER_SECRETS: unknown environment variable "
                    "(did you mean METAKV_CLUSTER_SECRET?); unset it or fix its name")
    line = refused(serve_args(tmp_path), env={"METAKV_ZZZ": "1"})
    assert "METAKV_ZZZ: unknown environment variable;" in line
    line = refused(["cluster", "up", "--data-dir", str(tmp_path / "data")], env={"METAKV_VOTER": "1@h:1"})
    assert "METAKV_VOTER: unknown environment variable (did you mean METAKV_VOTERS?)" in line
    assert not (tmp_path / "data").exists()  # refused before any node started


def test_every_metakv_variable_the_repository_reads_is_accepted(tmp_path: Path) -> None:
    """The allowlist is the repository's own list: every METAKV_* name in the sources, tests,
    compose file, Dockerfile and Makefile is known, and the non-serve ones do not stop `serve`."""
    import re

    from app.config import KNOWN_ENV_VARS, build_node_config
    from tests.cluster import REPO_ROOT

    used: set[str] = set()
    for pattern in ("app/**/*.py", "raft/**/*.py", "storage/**/*.py", "tests/**/*.py", "loadtest/**/*.py",
                    "pipeline/**/*.py", "metakv/**/*.py", "docker-compose.yml", "Dockerfile", "Makefile"):
        for path in REPO_ROOT.glob(pattern):
            used.update(re.findall(r"\bMETAKV_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    # Not variables: the placeholder in app/config.py's comment, and this module's own examples.
    used -= {"METAKV_NAME_UPPER", "METAKV_NAME", "METAKV_CLUSTER_SECRETS", "METAKV_ZZZ", "METAKV_VOTER"}
    assert used <= KNOWN_ENV_VARS, sorted(used - KNOWN_ENV_VARS)
    others = {"METAKV_TOKEN", "METAKV_URL", "METAKV_ENDPOINTS", "METAKV_FAILPOINTS", "METAKV_CRASH_ITERATIONS",
              "METAKV_BENCH_TRACE_OUT", "METAKV_INPUT_ERROR", "METAKV_CLUSTER_SECRET"}
    flags = {"node_id": "1", "data_dir": str(tmp_path), "listen_http": "127.0.0.1:1", "listen_raft": "127.0.0.1:2",
             "voters": "1@127.0.0.1:2"}
    assert build_node_config(flags, environ={name: "s" for name in others}).cluster_secret == "s"


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "http://a b:80", "http://h:0",
                                 "http://h:x", "http://"])
def test_status_with_a_malformed_url_is_one_line_not_a_traceback(url: str, refused) -> None:  # type: ignore[no-untyped-def]
    line = refused(["status", "--url", url])
    assert line.startswith("metakv: error: --url: expected an http:// or https:// URL") and repr(url) in line


@pytest.mark.parametrize("url", ["http://a b:99999/x?y", "http://[::1", "http://h:80/x?y", "http://user@h:80",
                                 "http://h:0", "foo", "http://"])
def test_a_malformed_advertise_http_is_refused(tmp_path: Path, url: str, refused) -> None:  # type: ignore[no-untyped-def]
    line = refused(serve_args(tmp_path, advertise_http=url))
    assert line.startswith("metakv: error: --advertise-http: expected an http:// or https:// URL")


@pytest.mark.parametrize("address", ["::1:19231", "[::1:19231", "a b:19231", "[nonsense]:19231"])
def test_a_malformed_listen_address_is_refused(tmp_path: Path, address: str, refused) -> None:  # type: ignore[no-untyped-def]
    assert "--listen-http: " in refused(serve_args(tmp_path, listen_http=address))


def test_an_ipv6_listen_address_advertises_a_url_with_brackets(tmp_path: Path) -> None:
    """`--listen-http [::1]:19231` advertised http://::1:19231, so every redirect's Location broke."""
    import httpx

    from app.config import build_node_config

    flags = {"node_id": "1", "data_dir": str(tmp_path), "listen_http": "[::1]:19231",
             "listen_raft": "[::1]:19232", "voters": "1@[::1]:19232"}
    node = build_node_config(flags, environ={})
    assert node.advertise_http == "http://[::1]:19231"
    url = httpx.URL(node.advertise_http + "/v1/kv/a")
    assert (url.host, url.port) == ("::1", 19231)
    assert (node.listen_http.host, str(node.listen_http), node.voters[1].host) == ("::1", "[::1]:19231", "::1")
    explicit = build_node_config({**flags, "advertise_http": "http://[::1]:8001/"}, environ={})
    assert explicit.advertise_http == "http://[::1]:8001"
