"""One lock contender as its own process (so a test can SIGSTOP it): takes the lock NAME in
turn, and while holding it makes fenced writes to the guard key, reporting each step as a
JSON line on stdout.

    python -m tests.leases_client.holder --endpoints URL,URL --worker 1 --rounds 3

A fenced write: read the guard (its value starts with the fencing token of the holder that
wrote it last); if that token is above ours we were superseded: refused ("fenced"); else
write ours with If-Match on the version read, so a write by a newer holder in between
fails the condition and we look again. The holder never checks its lease before writing:
it behaves like a process that does not know it was paused, which is what the fence is for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from metakv import Client, Conflict, LeaseLost, MetakvError, RetryPolicy
from metakv.concurrency import Lock

GUARD_KEY = "fence/guard"
PATIENT = RetryPolicy(deadline_s=30.0)  # outlasts an election on a loaded machine
ATTEMPTS_PER_ROUND = 5  # a turn lost to a fault (lease lost while waiting) is tried again


def report(**members: Any) -> None:
    print(json.dumps({"at": time.monotonic(), **members}), flush=True)


def fenced_write(kv: Client, token: int, text: str) -> bool:
    """Write ``token text`` to the guard unless a newer holder wrote it; True if written."""
    while True:
        current = kv.get(GUARD_KEY, consistency="linearizable")
        if current is None:
            raise AssertionError(f"{GUARD_KEY} must exist before the holders start")
        if int(current.value.split()[0]) > token:
            return False
        try:
            kv.put(GUARD_KEY, f"{token} {text}", if_version=current.mod_version)
            return True
        except Conflict:
            continue


def hold(kv: Client, args: argparse.Namespace, round_number: int) -> bool:
    """One turn with the lock; False when it was not had (the lease lost while waiting)."""
    lease = kv.lease(args.ttl)
    lock = Lock(kv, args.name, lease)
    try:
        token = lock.acquire()
    except LeaseLost as exc:
        report(event="lost", worker=args.worker, round=round_number, detail=str(exc))
        return False
    report(event="acquired", worker=args.worker, round=round_number, token=token, lease=lease.id, ttl=lease.ttl_s)
    for write in range(args.writes):
        text = f"w{args.worker} r{round_number} n{write}"
        written = fenced_write(kv, token, text)
        report(event="wrote" if written else "fenced", worker=args.worker, round=round_number, token=token,
               text=text)
        if not written:
            break
        time.sleep(args.hold_s)
    try:
        lock.release()
        lease.revoke()
    except MetakvError as exc:  # lost meanwhile: nothing left to release
        report(event="release-failed", worker=args.worker, detail=str(exc))
    report(event="released", worker=args.worker, round=round_number, token=token)
    return True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--name", default="fence")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--writes", type=int, default=3)
    parser.add_argument("--hold-s", type=float, default=0.2)
    parser.add_argument("--ttl", type=int, default=2)
    args = parser.parse_args()
    held = 0
    with Client(args.endpoints, retry=PATIENT) as kv:
        for round_number in range(args.rounds * ATTEMPTS_PER_ROUND):
            try:
                held += hold(kv, args, round_number)
            except MetakvError as exc:  # e.g. an unknown outcome during a failover: again
                report(event="error", worker=args.worker, round=round_number, detail=str(exc))
            if held == args.rounds:
                break
    report(event="done", worker=args.worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
