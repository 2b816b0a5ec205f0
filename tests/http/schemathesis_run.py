"""Run the schemathesis CLI against a served metakv /openapi.json and report what it found.

Shared by the in-process test (the app over the real StateMachine) and the test against a
real ``metakv serve`` process. Checks: no server errors, every status and header and body
documented, invalid input rejected with a 4xx, valid input accepted.

Statuses the contract defines that the stock checks would misread:
- 504 is a documented answer to ``min_version`` that the node has not reached within
  ``wait_ms`` (the fuzzer picks huge versions), not a crash; 500 stays a failure.
- 413 is the right rejection of a too-long key (the schema's maxLength).
- 412 is the right answer to a well-formed If-Match that does not hold; 410 to an
  at_version below the horizon.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCHEMATHESIS_TIMEOUT_S = 600
SCHEMATHESIS_CONFIG = """
[checks]
not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", 504]
negative_data_rejection.expected-statuses = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]
positive_data_acceptance.expected-statuses = ["2xx", "3xx", 401, 403, 404, 409, 410, 412, 429, 504]
"""


def run_schemathesis(base_url: str, work_dir: Path, *, max_examples: int, seed: int = 1,
                     phases: str = "coverage,fuzzing",
                     fixed_parameters: dict[str, int] | None = None,
                     exclude_paths: tuple[str, ...] = (),
                     headers: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``schemathesis run`` with every check; return the finished process (exit 0 = clean).

    ``fixed_parameters`` (``{"query.wait_ms": 0}``) pins parameters the fuzzer would
    otherwise push to the server's maximum wait on every request."""
    config = work_dir / "schemathesis.toml"
    pinned = "".join(f'"{name}" = {value}\n' for name, value in (fixed_parameters or {}).items())
    config.write_text(SCHEMATHESIS_CONFIG + ("\n[parameters]\n" + pinned if pinned else ""))
    command = [
        str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config), "--no-color",
        "run", f"{base_url}/openapi.json", "--checks", "all", "--max-examples", str(max_examples),
        "--seed", str(seed), "--workers", "1", "--phases", phases, "--max-redirects", "0",
        "--output-truncate", "false", "--request-timeout", "30",
    ]
    for path in exclude_paths:
        command += ["--exclude-path", path]
    for name, value in (headers or {}).items():  # sent on every request (a bearer token)
        command += ["--header", f"{name}: {value}"]
    return subprocess.run(command, cwd=work_dir, capture_output=True, text=True, timeout=SCHEMATHESIS_TIMEOUT_S,
                          check=False)
