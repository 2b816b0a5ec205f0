"""The `loadtest` profile of docker-compose.yml, checked without Docker: the Locust services
point at the compose nodes, and the mounted ./loadtest folder alone (Locust + the standard
library, no metakv packages) loads the locustfile with the profile's command and environment."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from loadtest.scenario_names import SCENARIOS

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_loadtest_profile_runs_the_locustfile_from_the_mounted_folder() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    master, worker = services["locust-master"], services["locust-worker"]
    for service in (master, worker):
        assert service["profiles"] == ["loadtest"]
        assert "./loadtest:/mnt/metakv/loadtest:ro" in service["volumes"]
    master_args = shlex.split(master["command"].replace("${LOCUST_WEB_PORT:-8089}", "8089"))
    assert "--master" in master_args and "--class-picker" in master_args
    assert "--worker" in shlex.split(worker["command"])
    environment = master["environment"]
    node_ports = {service["ports"][0].split(":")[0] for service in services.values() if not service.get("profiles")}
    endpoints = environment["LOADTEST_ENDPOINTS"].split(",")
    assert {endpoint.rsplit(":", 1)[1] for endpoint in endpoints} <= node_ports

    # Run the profile's command (listing the user classes instead of serving the UI) with the
    # metakv packages made unimportable: the container has only Locust and the mounted folder.
    locustfile = str(REPO_ROOT / "loadtest" / "locustfile.py")
    args = [locustfile if arg.endswith("locustfile.py") else arg for arg in master_args]
    args = [arg for arg in args if arg not in ("--master", "--class-picker")] + ["--list"]
    script = (
        "import sys\n"
        "for name in ('raft', 'storage', 'app', 'pipeline'):\n"
        "    sys.modules[name] = None\n"
        "from locust.main import main\n"
        f"sys.argv = ['locust'] + {args!r}\n"
        "main()\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOADTEST_")}
    env.update({key: str(value) for key, value in environment.items()})
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    listed = set(result.stdout.split())
    assert set(SCENARIOS.values()) <= listed, result.stdout
