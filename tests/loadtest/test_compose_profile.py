"""The `loadtest` profile of docker-compose.yml, run without Docker: its Locust master and
worker commands and environment, with the metakv packages made unimportable (the containers
hold only Locust and the mounted ./loadtest folder), run a short headless distributed test
against a local metakv cluster standing in for the compose nodes."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from loadtest.local_cluster import free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_SECONDS = 3


def _wrapped(args: list[str]) -> list[str]:
    """`locust ARGS` in a Python where raft/storage/app/pipeline cannot be imported."""
    script = (
        "import sys\n"
        "for name in ('raft', 'storage', 'app', 'pipeline'):\n"
        "    sys.modules[name] = None\n"
        "from locust.main import main\n"
        f"sys.argv = ['locust'] + {args!r}\n"
        "main()\n"
    )
    return [sys.executable, "-c", script]


def _args(command: str) -> list[str]:
    locustfile = str(REPO_ROOT / "loadtest" / "locustfile.py")
    args = shlex.split(command.replace("${LOCUST_WEB_PORT:-8089}", "8089"))
    return [locustfile if arg.endswith("locustfile.py") else arg for arg in args]


def test_loadtest_profile_master_and_worker_run_a_scenario(metakv_cluster: Any) -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    master, worker = services["locust-master"], services["locust-worker"]
    for service in (master, worker):
        assert service["profiles"] == ["loadtest"]
        assert "./loadtest:/mnt/metakv/loadtest:ro" in service["volumes"]
    node_ports = {service["ports"][0].split(":")[1] for service in services.values() if not service.get("profiles")}
    compose_endpoints = master["environment"]["LOADTEST_ENDPOINTS"].split(",")
    assert {endpoint.rsplit(":", 1)[1] for endpoint in compose_endpoints} <= node_ports
    assert master["environment"]["LOADTEST_STORE"] == "metakv"

    # The compose nodes are replaced by the local cluster; everything else is the profile's.
    master_args = _args(master["command"])
    assert "--master" in master_args and "--class-picker" in master_args
    master_args.remove("--class-picker")  # headless instead of the web UI
    master_args[master_args.index("--host") + 1] = metakv_cluster.endpoints[0]
    port = free_ports(1)[0]
    master_args += ["--master-bind-port", str(port), "--headless", "--expect-workers", "1", "-u", "3", "-r", "3",
                    "-t", f"{RUN_SECONDS}s", "--json", "--only-summary", "CasContention"]
    worker_args = _args(worker["command"])
    assert "--worker" in worker_args
    worker_args += ["--master-port", str(port), "CasContention"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOADTEST_")}
    env.update({key: str(value) for key, value in master["environment"].items()})
    env.update(PYTHONPATH=str(REPO_ROOT), LOADTEST_ENDPOINTS=",".join(metakv_cluster.endpoints))

    master_process = subprocess.Popen(_wrapped(master_args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      env=env, cwd=REPO_ROOT)
    worker_process = subprocess.Popen(_wrapped(worker_args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      env=env, cwd=REPO_ROOT)
    try:
        stdout, stderr = master_process.communicate(timeout=120)
        worker_process.wait(timeout=60)
    finally:
        for process in (master_process, worker_process):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert master_process.returncode in (0, 1), stderr.decode()[-2000:]
    stats = {entry["name"]: entry for entry in json.loads(stdout)}
    assert stats["cas read"]["num_requests"] > 0 and stats["cas: won"]["num_requests"] > 0
    failures = {name: entry["num_failures"] for name, entry in stats.items() if entry["num_failures"]}
    assert failures == {}, stderr.decode()[-2000:]
