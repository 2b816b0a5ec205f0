"""A contender that stops waiting for a lock or a leadership (cancelled, interrupted, timed
out) while its lease lives on must leave the line, as etcd's Mutex.Lock and Campaign do:
otherwise its key reaches the front later and holds the lock for nobody until the lease
ends, and every contender behind it waits that long. One in-process node served on loopback
(tests/http/served.py)."""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.http import create_app
from metakv import AsyncClient, Client
from metakv.concurrency import AsyncElection, AsyncLock, Election, Lock, NotAcquired
from tests.http.conftest import TEST_SETTINGS
from tests.http.served import serve_in_thread
from tests.http.service_double import InProcessService

ACQUIRE_S = 20.0  # the next contender's bound: far below the abandoning one's 60 s lease
WAIT_S = 30.0


def line(kv: Client, prefix: str) -> list[str]:
    return [item.key for item in kv.list(prefix).items]


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def ctrl_c_handled() -> Iterator[None]:
    """Python's own SIGINT handler, which a shell's background job (SIGINT ignored) lacks:
    without it ``interrupt_main`` does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_once_in_line(watcher: Client, prefix: str) -> None:
    """Ctrl-C for the main thread once the waiter's key is in line (at the latest after
    WAIT_S: the test then fails on what it sees, instead of waiting forever)."""
    try:
        wait_until(lambda: len(line(watcher, prefix)) == 2, "the waiter in line")
    finally:
        _thread.interrupt_main()


def test_a_cancelled_or_interrupted_wait_leaves_the_line(tmp_path: Path) -> None:
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    try:
        with serve_in_thread(create_app(service, TEST_SETTINGS)) as url:
            contend(url)
    finally:
        service.close()


def contend(url: str) -> None:

    async def cancelled_waiters() -> None:
        async with AsyncClient(url) as kv:
            holder, waiter = await kv.lease(60), await kv.lease(60)
            lock, election = AsyncLock(kv, "a", holder), AsyncElection(kv, "a", holder)
            await lock.acquire()
            await election.campaign("holder")
            for prefix, contender in (("locks/a/", AsyncLock(kv, "a", waiter).acquire()),
                                      ("elections/a/", AsyncElection(kv, "a", waiter).campaign("waiter"))):
                task = asyncio.ensure_future(contender)
                for _ in range(int(WAIT_S / 0.05)):  # in line, waiting
                    if len((await kv.list(prefix)).items) == 2:
                        break
                    await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert waiter.alive
            await lock.release()
            await election.resign()
            assert (await kv.list("locks/a/")).items == [] and (await kv.list("elections/a/")).items == []

    asyncio.run(cancelled_waiters())

    with Client(url) as kv, kv.lease(60) as holder, kv.lease(60) as waiter:
        Lock(kv, "b", holder).acquire()
        Election(kv, "b", holder).campaign("holder")
        for prefix, contender in (("locks/b/", lambda: Lock(kv, "b", waiter).acquire()),
                                  ("elections/b/", lambda: Election(kv, "b", waiter).campaign("waiter"))):
            with Client(url) as watcher, ctrl_c_handled():  # Ctrl-C in a program, once its wait is in line
                interrupt = threading.Thread(target=interrupt_once_in_line, args=(watcher, prefix))
                interrupt.start()
                try:
                    with pytest.raises(KeyboardInterrupt):
                        contender()
                finally:
                    interrupt.join()
        with pytest.raises(NotAcquired):
            Lock(kv, "b", waiter).acquire(timeout_s=0.5)
        assert waiter.alive
        assert line(kv, "locks/b/") == [f"locks/b/{holder.id}"]
        assert line(kv, "elections/b/") == [f"elections/b/{holder.id}"]
        holder.revoke()
        with kv.lease(60) as late:  # the next in line is not held up by the abandoned key
            assert Lock(kv, "b", late).acquire(timeout_s=ACQUIRE_S) > 0
            assert Election(kv, "b", late).campaign("late", timeout_s=ACQUIRE_S).value == b"late"
