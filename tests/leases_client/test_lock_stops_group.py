"""`metakv lock` stops what CMD started, not only CMD, when the lock's lease is lost: a
shell's child working on without the lock is what the lock was taken to prevent. Against
one in-process node served on loopback (tests/http/served.py): a subprocess of the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.http import create_app
from tests.cluster import REPO_ROOT
from tests.http.conftest import TEST_SETTINGS
from tests.http.served import serve_in_thread
from tests.http.service_double import InProcessService

WAIT_S = 30.0


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait a while for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_lost_lease_stops_the_processes_the_command_started(tmp_path: Path) -> None:
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    grandchild = 0
    try:
        with serve_in_thread(create_app(service, TEST_SETTINGS)) as url:
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
            lock = subprocess.Popen(  # sh forks sleep (no exec): sleep is CMD's child, not CMD
                [sys.executable, "-m", "app.cli", "lock", "job", "--ttl", "3", "--endpoints", url, "--",
                 "sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & echo $!; wait"],
                cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                assert lock.stdout is not None
                grandchild = int(lock.stdout.readline())
                assert running(grandchild)
                with httpx.Client(base_url=url) as http:
                    lease = http.get("/v1/kv", params={"prefix": "locks/job/"}).json()["items"][0]["lease"]
                    assert http.delete(f"/v1/leases/{lease}").status_code == 200
                _out, err = lock.communicate(timeout=WAIT_S)
            finally:
                if lock.poll() is None:
                    lock.kill()
                    lock.wait()
            assert lock.returncode == 1 and "lock lost" in err, err
            deadline = time.monotonic() + WAIT_S
            while running(grandchild) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not running(grandchild), "CMD's child still runs without the lock"
    finally:
        if grandchild and running(grandchild):
            os.kill(grandchild, 9)
        service.close()
