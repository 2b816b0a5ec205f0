"""The coordination commands of ``metakv``, on the client's leases and recipes (metakv/):

    metakv lock NAME [--ttl S] -- CMD [ARGS...]     run CMD while holding the lock NAME
    metakv elect NAME VALUE [--ttl S] | elect NAME --listen
    metakv lease grant TTL | keepalive ID [--once] | revoke ID | list | ttl ID [--keys]

They take the data commands' common options (app/cli_data.py) and follow their rules: bad
input exits 2 with one line, a cluster error exits 1 with one line. ``lock`` exports the
fencing token to CMD as ``METAKV_LOCK_VERSION`` (and its key as ``METAKV_LOCK_KEY``), exits
with CMD's code, releases the lock on every exit; if the lock's lease is lost meanwhile it
stops CMD (SIGTERM, then SIGKILL) and exits 1, as ``consul lock`` does. CMD runs in a
process group of its own (given the terminal when it has it), so stopping it stops what it
started too (``sh -c 'a; b'``), as consul does: work must not go on without the lock.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from app.cli_data import (
    ClientCommand,
    checked_key,
    common_options,
    one_line,
    print_json,
    print_table,
)
from app.config import ConfigError, parse_int
from metakv import Client, KeyValue, Lease, LeaseNotFound, MetakvError
from metakv.concurrency import Election, Lock
from metakv.leases import LeaseInfo

EXIT_LOST = 1
EXIT_NOT_RUN = 127  # what a shell answers for a command it cannot find or run
CHILD_POLL_S = 0.2  # how often `lock` checks its lease while CMD runs
CHILD_STOP_GRACE_S = 5.0  # SIGTERM, then this long, then SIGKILL
MAX_TTL_S = 86_400  # the nodes' default --max-lease-ttl-s
DEFAULT_TTL = "10"
LEASE_ACTIONS = ("grant", "keepalive", "revoke", "list", "ttl")


def add_coordination_commands(commands: Any) -> None:
    """Add ``lock``, ``elect`` and ``lease`` to ``metakv``'s subcommands."""
    common = common_options()
    lock = commands.add_parser("lock", parents=[common], help="run a command while holding a lock",
                               usage="metakv lock NAME [options] -- CMD [ARGS...]")
    lock.add_argument("name", help="the lock's name (its keys are locks/NAME/<lease id>)")
    lock.add_argument("--ttl", default=DEFAULT_TTL, help=f"the lock's lease TTL in seconds (default {DEFAULT_TTL})")
    lock.set_defaults(cmd=[])  # set by split_lock_command: argparse cannot take it after options
    elect = commands.add_parser("elect", parents=[common], help="campaign for leadership, or --listen to the leaders")
    elect.add_argument("name", help="the election's name (its keys are elections/NAME/<lease id>)")
    elect.add_argument("value", nargs="?", help="the value this candidate proclaims once leader")
    elect.add_argument("--listen", action="store_true", help="do not campaign: print each leader as it changes")
    elect.add_argument("--ttl", default=DEFAULT_TTL, help=f"the campaign's lease TTL in seconds (default {DEFAULT_TTL})")
    lease = commands.add_parser("lease", help="grant, keep alive, revoke, list and inspect leases")
    actions = lease.add_subparsers(dest="lease_command", required=True, parser_class=type(lease))
    grant = actions.add_parser("grant", parents=[common], help="grant a lease of TTL seconds; prints its id")
    grant.add_argument("ttl", help="seconds (the cluster raises it to its minimum)")
    keep = actions.add_parser("keepalive", parents=[common], help="keep a lease alive until Ctrl-C (every TTL/3)")
    keep.add_argument("id", help="the lease id")
    keep.add_argument("--once", action="store_true", help="one keep-alive, then exit")
    revoke = actions.add_parser("revoke", parents=[common], help="revoke a lease: its keys are deleted")
    revoke.add_argument("id", help="the lease id")
    actions.add_parser("list", parents=[common], help="every live lease")
    ttl = actions.add_parser("ttl", parents=[common], help="a lease's TTL and remaining time")
    ttl.add_argument("id", help="the lease id")
    ttl.add_argument("--keys", action="store_true", help="also the keys attached to it")


def split_lock_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``metakv lock NAME [options] -- CMD [ARGS...]``: ``(the arguments before --, CMD
    [ARGS...])``; any other command line is left whole (and its ``--`` to argparse)."""
    words = list(argv)
    if words[:1] == ["lock"] and "--" in words:
        cut = words.index("--")
        return words[:cut], words[cut + 1:]
    return words, []


def _lease_id(raw: str) -> int:
    return parse_int("ID", raw, 1, 2**63 - 1)


def _ttl(name: str, raw: str) -> int:
    return parse_int(name, raw, 1, MAX_TTL_S)


class Signals:
    """SIGINT and SIGTERM while a command runs: remembered, forwarded to the child if one
    runs, else raised as ``Interrupted`` to end the wait for a lock or a leader."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self._starting = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if self._starting:
            return  # inside Popen: raising there could leave a child nobody stops; see start
        if self.child is not None and self.child.poll() is None:
            signal_group(self.child, signum)
            return
        raise Interrupted(signum)

    def start(self, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start the child in a process group of its own; a signal that arrived meanwhile is
        passed on to it at once."""
        self.received = None
        self._starting = True
        try:
            self.child = subprocess.Popen(command, env=env, process_group=0)
        finally:
            self._starting = False
        if self.received is not None:
            signal_group(self.child, self.received)
        return self.child

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # tests call main() in a thread: no handlers there
            return
        previous = {signum: signal.signal(signum, self._handle) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class Interrupted(BaseException):
    """SIGINT/SIGTERM arrived while waiting (a BaseException: no ``except Exception`` eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _release(lease: Lease) -> None:
    """Revoke the lease (its lock or campaign key goes with it); if the cluster cannot be
    reached the lease expires after its TTL anyway."""
    with contextlib.suppress(MetakvError):
        lease.revoke()


def signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    """Send ``signum`` to the child's process group: the child and whatever it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(child.pid, signum)


def _stop_child(child: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the child's group, SIGKILL after the grace (to what is left of the group
    too: a process the child started must not go on working without the lock)."""
    signal_group(child, signal.SIGTERM)
    try:
        return child.wait(timeout=CHILD_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()
    finally:
        signal_group(child, signal.SIGKILL)


@contextlib.contextmanager
def terminal_for(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """Give the terminal to the child's group while it runs (as a shell does for a job), so
    it may read from it and Ctrl-C reaches it; take it back after. Nothing without one."""
    try:
        ours = os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):  # no terminal, or stdin closed
        ours = False
    if ours:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(sys.stdin.fileno(), child.pid)
    try:
        yield
    finally:
        if ours:
            # Taking it back from the background would stop us with SIGTTOU: ignore it meanwhile.
            previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            try:
                with contextlib.suppress(OSError):
                    os.tcsetpgrp(sys.stdin.fileno(), os.getpgrp())
            finally:
                signal.signal(signal.SIGTTOU, previous)


def _exit_code(returncode: int) -> int:
    """A child's exit status as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _lock(client: Client, args: argparse.Namespace, output: str) -> int:
    command = args.cmd
    if not command:
        raise ConfigError("lock: give the command to run after --, e.g. metakv lock NAME -- ./job.sh")
    name = checked_key(args.name)
    lease = client.lease(_ttl("--ttl", args.ttl))
    signals = Signals()
    try:
        with signals.installed():
            lock = Lock(client, name, lease)
            lock.acquire()
            env = {**os.environ, "METAKV_LOCK_KEY": lock.key, "METAKV_LOCK_VERSION": str(lock.version)}
            try:
                child = signals.start(command, env)
            except OSError as exc:
                print(f"metakv: lock: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
                return EXIT_NOT_RUN
            with terminal_for(child):
                while True:
                    try:
                        return _exit_code(child.wait(timeout=CHILD_POLL_S))
                    except subprocess.TimeoutExpired:
                        pass
                    if not lease.alive:
                        _stop_child(child)
                        print(f"metakv: lock lost: lease {lease.id}: {lease.lost_reason or 'expired'}; "
                              f"the command was stopped", file=sys.stderr)
                        return EXIT_LOST
    except Interrupted as interrupted:
        return 128 + interrupted.signum
    finally:
        if signals.child is not None and signals.child.poll() is None:  # never leave CMD running
            _stop_child(signals.child)
        _release(lease)


def _leader_json(kv: KeyValue, name: str) -> dict[str, Any]:
    return {"name": name, **kv.as_json(), "version": kv.create_version}


def _print_leader(kv: KeyValue, name: str, output: str) -> None:
    if output == "value":
        sys.stdout.buffer.write(kv.value + b"\n")
        sys.stdout.buffer.flush()
    elif output == "table":
        print_table(("NAME", "KEY", "VERSION", "VALUE"), [(name, kv.key, kv.create_version, kv.text)])
        sys.stdout.flush()
    else:
        print_json(_leader_json(kv, name))


def _elect(client: Client, args: argparse.Namespace, output: str) -> int:
    name = checked_key(args.name)
    if args.listen:
        if args.value is not None:
            raise ConfigError("elect: --listen takes no VALUE")
        with Signals().installed():
            try:
                for leader in Election(client, name).observe():
                    _print_leader(leader, name, output)
            except Interrupted:
                pass
        return 0
    if args.value is None:
        raise ConfigError("elect: give a VALUE to campaign with, or --listen")
    lease = client.lease(_ttl("--ttl", args.ttl))
    try:
        with Signals().installed():
            election = Election(client, name, lease)
            _print_leader(election.campaign(args.value), name, output)
            while not lease.done.wait(CHILD_POLL_S):
                if not lease.alive:
                    break
            print(f"metakv: leadership lost: lease {lease.id}: {lease.lost_reason or 'expired'}", file=sys.stderr)
            return EXIT_LOST
    except Interrupted:
        return 0
    finally:
        _release(lease)


def _print_info(info: LeaseInfo, output: str) -> None:
    if output == "value":
        print(info.remaining_s)
    elif output == "table":
        print_table(("ID", "TTL_S", "REMAINING_S", "GRANTED_VERSION", "KEYS"),
                    [(info.id, info.ttl_s, f"{info.remaining_s:.1f}", info.granted_version,
                      ",".join(info.keys) if info.keys is not None else "-")])
    else:
        document: dict[str, Any] = {"id": info.id, "ttl_s": info.ttl_s, "remaining_s": info.remaining_s,
                                    "granted_version": info.granted_version}
        if info.keys is not None:
            document["keys"] = info.keys
        print_json(document)


def _print_row(output: str, row: dict[str, Any], value: Any) -> None:
    if output == "value":
        print(value, flush=True)
    elif output == "table":
        print_table([name.upper() for name in row], [list(row.values())])
        sys.stdout.flush()
    else:
        print_json(row)


def _lease(client: Client, args: argparse.Namespace, output: str) -> int:
    action = args.lease_command
    if action == "grant":
        ttl_s = _ttl("TTL", args.ttl)
        granted_id, ttl, version, _ = client.run(client.grant_plan(ttl_s, None))
        _print_row(output, {"id": granted_id, "ttl_s": ttl, "version": version}, granted_id)
    elif action == "revoke":
        lease_id = _lease_id(args.id)
        deleted = client.revoke(lease_id)
        if deleted is None:
            print(f"metakv: Lease not found: {lease_id}", file=sys.stderr)
            return EXIT_LOST
        _print_row(output, {"id": lease_id, "deleted_keys": deleted}, deleted)
    elif action == "list":
        leases = client.leases()
        if output == "table":
            print_table(("ID", "TTL_S"), [(lease.id, lease.ttl_s) for lease in leases])
        elif output == "value":
            for lease in leases:
                print(lease.id)
        else:
            print_json({"leases": [{"id": lease.id, "ttl_s": lease.ttl_s} for lease in leases]})
    else:
        lease_id = _lease_id(args.id)
        try:
            if action == "keepalive":
                return _keepalive(client, lease_id, args.once, output)
            _print_info(client.lease_info(lease_id, keys=args.keys), output)
        except LeaseNotFound as exc:  # a missing lease exits 1, like a missing key for `get`
            print(f"metakv: {one_line(exc)}", file=sys.stderr)
            return EXIT_LOST
    return 0


def _keepalive(client: Client, lease_id: int, once: bool, output: str) -> int:
    """Keep-alives of a lease this process did not grant, until interrupted (etcdctl's)."""
    with Signals().installed():
        try:
            while True:
                ttl = client.keep_alive_once(lease_id)
                _print_row(output, {"id": lease_id, "ttl_s": ttl}, ttl)
                if once:
                    return 0
                time.sleep(ttl / 3)
        except Interrupted:
            return 0


COORDINATION_COMMANDS: dict[str, ClientCommand] = {"lock": _lock, "elect": _elect, "lease": _lease}
