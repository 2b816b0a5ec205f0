"""The audit log: one WARNING line on the ``metakv.audit`` logger for every request refused
401 or 403 and for every admin action (``/v1/admin/*``, whatever its outcome), each naming
the status, the route, the client address and the token (``-`` when none authenticated):

    audit: 403 PUT /v1/kv/secret/x from 10.0.0.7:51234 token 'reader': denied: token 'reader' lacks ...
    audit: 200 POST /v1/admin/snapshot from 10.0.0.7:51240 token 'ops': admin action done

At most ``AUDIT_LINES_PER_S`` refusals and as many admin actions a second, so a client
hammering with a bad token cannot flood the log, nor push the admin actions out of it; the
next line written says how many were held back. Auth writes the
refusals (it knows why); the edge writes admin actions once they are answered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from starlette.types import Scope

from app.http.log_text import loggable

AUDIT_LINES_PER_S = 10
ADMIN_PATH_PREFIX = "/v1/admin/"
AUDITED_SCOPE_KEY = "metakv.audited"  # set once a request has its line: never two lines

log = logging.getLogger("metakv.audit")


def admin_outcome(status: int) -> str:
    if status < 300:
        return "admin action done"
    if status < 400:
        return "admin action redirected to the leader"
    return "admin action refused" if status < 500 else "admin action failed"


class AuditLog:
    """Writes the audit lines, at most ``per_s`` a second (the rest counted)."""

    def __init__(self, per_s: int = AUDIT_LINES_PER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_s = per_s
        self._clock = clock
        # Per kind of line, the start of its one-second window and the lines logged in it:
        # separate budgets, so refusals cannot crowd out the admin actions.
        self._windows: dict[str, tuple[float, int]] = {}
        self._held_back = 0

    def denied(self, scope: Scope, status: int, detail: str, token_name: str | None) -> None:
        """A request refused 401 or 403, and why."""
        self._write("denied", scope, status, token_name, f"denied: {detail}")

    def admin(self, scope: Scope, status: int, token_name: str | None) -> None:
        """An admin request answered ``status`` (a refusal was written by ``denied``)."""
        if not scope.get(AUDITED_SCOPE_KEY):
            self._write("admin", scope, status, token_name, admin_outcome(status))

    def _write(self, kind: str, scope: Scope, status: int, token_name: str | None, outcome: str) -> None:
        scope[AUDITED_SCOPE_KEY] = True
        now_s = self._clock()
        window_start_s, logged = self._windows.get(kind, (-1.0, 0))
        if now_s - window_start_s >= 1.0:
            window_start_s, logged = now_s, 0
        if logged >= self._per_s:
            self._held_back += 1
            return
        self._windows[kind] = (window_start_s, logged + 1)
        held_back, self._held_back = self._held_back, 0
        client = scope.get("client")
        address = f"{client[0]}:{client[1]}" if client else "unknown"
        token = "-" if token_name is None else repr(loggable(token_name))
        log.warning("audit: %d %s %s from %s token %s: %s%s", status, loggable(scope.get("method", "?")),
                    loggable(scope.get("path", "?")), address, token, loggable(outcome),
                    f" ({held_back} more audit lines not logged)" if held_back else "")
