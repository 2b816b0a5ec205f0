"""A schemathesis run against the served app's /openapi.json finds nothing.

The app is served by uvicorn on a loopback port over the in-process node on the real
StateMachine; the fuzzer is the schemathesis CLI (every check).
"""

from __future__ import annotations

from pathlib import Path

from app.auth import Access, AuthPolicy, AuthTokens, Token, hash_token
from app.http import HttpSettings, create_app
from storage.commands import put
from tests.http.schemathesis_run import run_schemathesis
from tests.http.served import serve_in_thread
from tests.http.service_double import InProcessService

# Small waits so the fuzzer's huge wait_ms / timeout_ms values (clamped) keep the run short.
FUZZ_SETTINGS = HttpSettings(max_value_bytes=64 * 1024, max_wait_ms=20, max_watch_timeout_ms=20, sse_keepalive_ms=10)


def test_schemathesis_finds_no_server_errors_and_no_undocumented_behaviour(tmp_path: Path) -> None:
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    # A served node has always applied something (its leader's LeaderChange record); without
    # it, a snapshot asked for first is a correct but unfuzzable 503.
    service.apply_now(put("seed", b"x"))
    try:
        with serve_in_thread(create_app(service, FUZZ_SETTINGS)) as base_url:
            result = run_schemathesis(base_url, tmp_path, max_examples=3)
    finally:
        service.close()
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-12000:]
    assert "29 selected / 29 total" in report
    assert service.proposals > 0  # the fuzzer's writes reached the state machine


def test_schemathesis_with_auth_on_finds_only_documented_401_and_403(tmp_path: Path) -> None:
    """Auth on (app/auth.py), fuzzing with a token that may write every key except those
    starting with "a" (read only) and is no admin: its 403s and (from the ignored_auth
    check's token-less requests) 401s must all be documented, and nothing may answer 2xx
    without a token. Fuzzing phase only: the coverage phase is the other test's job."""
    secret = "fuzz-token"
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    service.apply_now(put("seed", b"x"))
    service.auth_tokens = AuthTokens(AuthPolicy("inline", (Token("fuzzer", hash_token(secret), (
        ("a", Access.READ), ("", Access.WRITE))),)))
    try:
        with serve_in_thread(create_app(service, FUZZ_SETTINGS)) as base_url:
            result = run_schemathesis(base_url, tmp_path, max_examples=10, phases="fuzzing",
                                      headers={"Authorization": f"Bearer {secret}"})
    finally:
        service.close()
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-12000:]
    assert "29 selected / 29 total" in report
