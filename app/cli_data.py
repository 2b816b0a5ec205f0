"""The data commands of ``metakv``, on the Python client (metakv/):

    metakv get KEY | put KEY [VALUE] | del KEY | list [PREFIX] | watch [PREFIX] | txn [FILE]
    metakv snapshot save FILE | snapshot restore FILE --data-dir DIR

Every one takes ``--endpoints`` (or ``METAKV_ENDPOINTS``), ``--token`` (or ``METAKV_TOKEN``)
and ``--output json|table|value``. Bad input exits 2 with one line (``ConfigError``, which
``app.cli.main`` prints); an error from the cluster exits 1 with one line: the problem's
title and detail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.config import ConfigError, parse_int, parse_url
from app.snapshot_restore import RestoreError, restore_snapshot
from metakv import Client, Event, InvalidRequest, KeyValue, MetakvError, RetryPolicy
from metakv.results import value_members

EXIT_FAILURE = 1
EXIT_BROKEN_PIPE = 141  # what a shell reports for a tool SIGPIPE ended (`metakv list | head -1`)
DEFAULT_ENDPOINTS = "http://127.0.0.1:8001"
OUTPUTS = ("json", "table", "value")
KEY_MAX_BYTES = 1024  # the API's bound (docs/http.md): refused here with exit 2, not by a node
DATA_COMMANDS = frozenset({"get", "put", "del", "list", "watch", "txn", "snapshot"})


def common_options() -> argparse.ArgumentParser:
    """The options every command talking to a cluster takes (an argparse parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoints", default=os.environ.get("METAKV_ENDPOINTS", DEFAULT_ENDPOINTS),
                        help=f"comma-separated node URLs [env METAKV_ENDPOINTS] (default {DEFAULT_ENDPOINTS})")
    common.add_argument("--token", default=os.environ.get("METAKV_TOKEN"),
                        help="bearer token for a cluster with auth enabled [env METAKV_TOKEN]")
    common.add_argument("--output", "-o", default="json", metavar="{json,table,value}",
                        help="json (default: one JSON document per line), table, or value (the raw value; "
                             "a write's version)")
    common.add_argument("--timeout-ms", default="15000", help="give up on the cluster after this long (default 15000)")
    return common


def add_data_commands(commands: Any) -> None:
    """Add the data commands to ``metakv``'s subcommands (an argparse subparsers action)."""
    common = common_options()
    reads = argparse.ArgumentParser(add_help=False)
    reads.add_argument("--consistency", default="local", metavar="{local,leader,linearizable}",
                       help="local (default: the first endpoint's node, which may lag), leader (the "
                            "leader's state) or linearizable (the leader, after a quorum check)")

    get = commands.add_parser("get", parents=[common, reads], help="read one key (exit 1 when it does not exist)")
    get.add_argument("key", help="the key (UTF-8, 1-1024 bytes)")
    put = commands.add_parser("put", parents=[common], help="set a key (VALUE, or stdin when left out)")
    put.add_argument("key", help="the key (UTF-8, 1-1024 bytes)")
    put.add_argument("value", nargs="?", help="the value; read from stdin (as bytes) when left out")
    put.add_argument("--content-type", help="stored Content-Type (default: text/plain; charset=utf-8 for VALUE, "
                                            "application/octet-stream for stdin)")
    condition = put.add_mutually_exclusive_group()
    condition.add_argument("--if-version", help="only if the key's mod_version is this (0: missing)")
    condition.add_argument("--create", action="store_true", help="only if the key does not exist")
    delete = commands.add_parser("del", parents=[common], help="delete a key")
    delete.add_argument("key", help="the key")
    delete.add_argument("--if-version", help="only if the key's mod_version is this")
    listing = commands.add_parser("list", parents=[common, reads], help="every key under a prefix")
    listing.add_argument("prefix", nargs="?", default="", help="list the keys starting with this (default: all)")
    listing.add_argument("--limit", help="at most this many keys")
    listing.add_argument("--keys-only", action="store_true", help="leave the values out")
    watch = commands.add_parser("watch", parents=[common], help="print changes under a prefix as they happen")
    watch.add_argument("prefix", nargs="?", default="", help="watch the keys starting with this (default: all)")
    watch.add_argument("--since", help="changes after this version (default: from now)")
    watch.add_argument("--count", help="stop after this many events (default: until Ctrl-C)")
    txn = commands.add_parser("txn", parents=[common], help="a transaction: the JSON body of POST /v1/txn")
    txn.add_argument("file", nargs="?", default="-", help="a file holding the JSON body (default: stdin)")

    snapshot = commands.add_parser("snapshot", help="save a cluster's snapshot, or restore a node from one")
    actions = snapshot.add_subparsers(dest="snapshot_command", required=True, parser_class=type(snapshot))
    save = actions.add_parser("save", parents=[common], help="stream a consistent snapshot from a node into FILE")
    save.add_argument("file", help="where to write the snapshot (replaced whole, or left as it was)")
    restore = actions.add_parser("restore", help="a new single-node data directory from a snapshot FILE")
    restore.add_argument("file", help="a file `metakv snapshot save` wrote")
    restore.add_argument("--data-dir", required=True, help="the new data directory (absent or empty)")


ClientCommand = Callable[[Client, argparse.Namespace, str], int]


def run_data_command(args: argparse.Namespace, handlers: dict[str, ClientCommand] | None = None) -> int:
    """Run one data command (of ``handlers``, default the data commands' own) with a client
    built from the common options; ``ConfigError`` for bad input, exit 1 for a cluster error."""
    if args.command == "snapshot" and args.snapshot_command == "restore":
        return _restore(args)
    output = _choice("--output", args.output, OUTPUTS)
    timeout_s = parse_int("--timeout-ms", args.timeout_ms, 1, 3_600_000) / 1000
    endpoints = [parse_url("--endpoints", url) for url in str(args.endpoints).split(",") if url.strip()]
    if not endpoints:
        raise ConfigError("--endpoints: no URL given")
    command = (handlers or COMMANDS)[args.command]
    try:
        with Client(endpoints, token=args.token, timeout_s=timeout_s,
                    retry=RetryPolicy(deadline_s=timeout_s)) as client:
            code = command(client, args, output)
            sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
            return code
    except BrokenPipeError:  # the reader went away: stop quietly, as SIGPIPE ends other tools
        with contextlib.suppress(OSError, ValueError):  # no error again when Python flushes at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except InvalidRequest as exc:  # the cluster refused the input as malformed: bad input too
        raise ConfigError(one_line(exc)) from None
    except MetakvError as exc:
        print(f"metakv: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


def one_line(exc: MetakvError) -> str:
    """A client error as one line: its title and detail."""
    text = f"{exc.title}: {exc.detail}" if exc.detail else exc.title
    return " ".join(text.split())


def _choice(name: str, raw: str, choices: Sequence[str]) -> str:
    if raw not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {raw!r}")
    return raw


def checked_key(raw: str) -> str:
    if not raw or "\x00" in raw:
        raise ConfigError("KEY: must be non-empty and hold no NUL")
    if len(raw.encode("utf-8", "surrogateescape")) > KEY_MAX_BYTES:
        raise ConfigError(f"KEY: longer than {KEY_MAX_BYTES} bytes")
    return raw


def _version(name: str, raw: str | None) -> int | None:
    return None if raw is None else parse_int(name, raw, 0, 2**63 - 1)


# ---------------------------------------------------------------------------- output


def print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False, separators=(",", ":")), flush=True)


def _write_value(value: bytes, newline: bool) -> None:
    sys.stdout.buffer.write(value + (b"\n" if newline else b""))
    sys.stdout.buffer.flush()


def _cell(value: bytes | None) -> str:
    if value is None:
        return "-"
    shown = value_members(value)
    return shown["value"] if "encoding" not in shown else f"<{len(value)} bytes>"


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _key_rows(items: Sequence[KeyValue]) -> list[tuple[Any, ...]]:
    return [(kv.key, kv.mod_version, kv.create_version, kv.content_type, _cell(kv.value)) for kv in items]


KEY_HEADER = ("KEY", "MOD_VERSION", "CREATE_VERSION", "CONTENT_TYPE", "VALUE")
WATCH_ROW = "{:<7} {:<12} {}  {}"  # a watch's table streams: fixed widths, not fitted to the rows


# ---------------------------------------------------------------------------- commands


def _get(client: Client, args: argparse.Namespace, output: str) -> int:
    key = checked_key(args.key)
    found = client.get(key, consistency=_choice("--consistency", args.consistency, ("local", "leader", "linearizable")))
    if found is None:
        print(f"metakv: Key not found: {key!r}", file=sys.stderr)
        return EXIT_FAILURE
    if output == "value":
        _write_value(found.value, newline=False)
    elif output == "table":
        print_table(KEY_HEADER, _key_rows([found]))
    else:
        print_json(found.as_json())
    return 0


def _put(client: Client, args: argparse.Namespace, output: str) -> int:
    key = checked_key(args.key)
    if_version = _version("--if-version", args.if_version)
    value: bytes | str = args.value if args.value is not None else sys.stdin.buffer.read()
    if args.create:
        result = client.create(key, value, content_type=args.content_type)
    else:
        result = client.put(key, value, content_type=args.content_type, if_version=if_version)
    _print_write(output, {"key": result.key, "version": result.version, "created": result.created})
    return 0


def _delete(client: Client, args: argparse.Namespace, output: str) -> int:
    result = client.delete(checked_key(args.key), if_version=_version("--if-version", args.if_version))
    _print_write(output, {"key": result.key, "version": result.version, "deleted": result.deleted})
    return 0


def _print_write(output: str, result: dict[str, Any]) -> None:
    if output == "value":
        print(result["version"])
    elif output == "table":
        print_table([name.upper() for name in result], [list(result.values())])
    else:
        print_json(result)


def _list(client: Client, args: argparse.Namespace, output: str) -> int:
    limit = None if args.limit is None else parse_int("--limit", args.limit, 1, 2**31)
    consistency = _choice("--consistency", args.consistency, ("local", "leader", "linearizable"))
    listing = client.list(args.prefix, limit=limit, keys_only=args.keys_only, consistency=consistency)
    if output == "value":
        for kv in listing.items:
            _write_value(kv.key.encode() if args.keys_only else kv.value, newline=True)
    elif output == "table":
        print_table(KEY_HEADER, _key_rows(listing.items))
    else:
        items = [{key: value for key, value in kv.as_json().items()
                  if not (args.keys_only and key in ("value", "encoding"))} for kv in listing.items]
        print_json({"version": listing.version, "items": items, "next": listing.next_key})
    return 0


def _watch(client: Client, args: argparse.Namespace, output: str) -> int:
    since = _version("--since", args.since)
    count = None if args.count is None else parse_int("--count", args.count, 1, 2**62)
    printed = 0
    if output == "table":
        print(WATCH_ROW.format("TYPE", "MOD_VERSION", "KEY", "VALUE").rstrip(), flush=True)
    for event in client.watch(args.prefix, since=since):
        _print_event(event, output)
        printed += 1
        if count is not None and printed >= count:
            break
    return 0


def _print_event(event: Event, output: str) -> None:
    if output == "value":
        _write_value(event.value if event.value is not None else b"", newline=True)
    elif output == "table":
        print(WATCH_ROW.format(event.type, event.mod_version, event.key, _cell(event.value)), flush=True)
    else:
        print_json(event.as_json())


def _txn(client: Client, args: argparse.Namespace, output: str) -> int:
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"txn: cannot read {args.file}: {exc}") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"txn: the body is not JSON: {exc}") from None
    if not isinstance(body, dict) or not set(body) <= {"compare", "success", "failure"} or not all(
            isinstance(member, list) for member in body.values()):
        raise ConfigError('txn: expected a JSON object with "compare", "success" and "failure" lists')
    txn = client.txn()
    txn.compare, txn.success, txn.failure = (list(body.get(name, [])) for name in ("compare", "success", "failure"))
    result = txn.commit()
    if output == "value":
        print(result.version)
        return 0
    results = [{k: v for k, v in r.items() if k != "kv"} for r in result.results]
    if output == "table":
        print_table(("SUCCEEDED", "VERSION", "RESULTS"), [(result.succeeded, result.version, json.dumps(results))])
    else:
        print_json({"succeeded": result.succeeded, "version": result.version, "results": results,
                     "failed_compares": result.failed_compares})
    return 0


def _save(client: Client, args: argparse.Namespace, output: str) -> int:
    target = Path(args.file)
    partial = target.with_name(target.name + ".partial")
    try:
        with open(partial, "wb") as destination:
            saved = client.save_snapshot(destination)
            os.fsync(destination.fileno())
        os.replace(partial, target)
    except OSError as exc:
        raise ConfigError(f"snapshot save: cannot write {target}: {exc.strerror or exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    report = {"file": str(target), "version": saved.version, "epoch": saved.epoch, "size_bytes": saved.size_bytes}
    _print_write(output, report)
    return 0


def _restore(args: argparse.Namespace) -> int:
    try:
        snapshot_id = restore_snapshot(Path(args.file), Path(args.data_dir))
    except RestoreError as exc:
        raise ConfigError(f"snapshot restore: {exc}") from None
    print(f"restored version {snapshot_id.end_offset} (epoch {snapshot_id.epoch}) into {args.data_dir}; start it "
          f"with: metakv serve --data-dir {args.data_dir} --node-id 1 --voters 1@HOST:PORT ...", flush=True)
    return 0


COMMANDS: dict[str, ClientCommand] = {
    "get": _get, "put": _put, "del": _delete, "list": _list, "watch": _watch, "txn": _txn, "snapshot": _save,
}
