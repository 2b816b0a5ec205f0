"""The chaos workload through the Python client (metakv/): the same operations, keys and
history records as ``history.Client``, but every request goes through ``metakv.Client``
with its leader tracking, failover, retries and read-your-writes session. The checker then
judges the client too: a retry that applied a write twice, or a read older than the
session's own writes, shows up as an anomaly.

Outcomes map from the client's typed errors: ``Conflict`` fail; ``Indeterminate`` (the
client could not tell whether a write happened) indeterminate; ``Unavailable`` error (the
client raises it only when no attempt can have applied); anything else indeterminate and
marked unexpected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import metakv
from metakv import Conflict, Indeterminate, MetakvError, RetryPolicy, Unavailable
from tests.chaos.history import REQUEST_TIMEOUT_S, Client, History, WorkloadConfig, now_ns

TEXT_PLAIN = "text/plain"
# The client's own deadline for one call: short enough that a process records an error and
# moves on during a long fault, as the raw-HTTP processes do.
CALL_DEADLINE_S = 8.0


class MetakvClientProcess(Client):
    """One sequential history process driving ``metakv.Client``."""

    def __init__(self, process: int, urls: Callable[[], dict[int, str]], config: WorkloadConfig,
                 history: History, seed: int) -> None:
        super().__init__(process, urls, config, history, seed)
        ordered = [urls()[node] for node in sorted(urls())]
        home = (self.home - 1) % len(ordered)
        # Reads stay on this process's home node (as for the raw processes) until it fails.
        self.kv = metakv.Client(ordered[home:] + ordered[:home], timeout_s=REQUEST_TIMEOUT_S,
                                retry=RetryPolicy(deadline_s=CALL_DEADLINE_S))

    def close(self) -> None:
        super().close()
        self.kv.close()

    def _attempt(self, op: str, key: str, write: Callable[[], Any], value: str | None, **fields: Any) -> Any:
        """Run ``write``; record anything but success here and return None, else its result."""
        invoke = now_ns()
        try:
            return invoke, write()
        except Conflict as exc:
            if exc.current_version > 0:
                self.known_mod_version[key] = exc.current_version
            self._record(op, key, invoke, "fail", {"current_version": exc.current_version}, value=value, **fields)
        except Indeterminate as exc:
            self._record(op, key, invoke, "indeterminate", {"error": exc.title}, value=value, **fields)
        except Unavailable as exc:
            self._record(op, key, invoke, "error", {"error": exc.title}, value=value, **fields)
        except MetakvError as exc:
            self._record(op, key, invoke, "indeterminate", {"status": exc.status, "unexpected": True,
                                                            "body": str(exc)[:300]}, value=value, **fields)
        return None

    def _written(self, op: str, key: str, value: str | None, write: Callable[[], Any], **fields: Any) -> None:
        attempt = self._attempt(op, key, write, value, **fields)
        if attempt is None:
            return
        invoke, written = attempt
        result: dict[str, Any] = {"version": written.version}
        if hasattr(written, "created"):
            result["created"] = written.created
            self.known_mod_version[key] = written.version
        if hasattr(written, "deleted"):
            result["deleted"] = written.deleted
        self.last_seen_version = max(self.last_seen_version, written.version)
        self._record(op, key, invoke, "ok", result, value=value, **fields)

    def do_put(self, key: str) -> None:
        value = self._value()
        self._written("put", key, value, lambda: self.kv.put(key, value, content_type=TEXT_PLAIN))

    def do_create(self, key: str) -> None:
        value = self._value()
        self._written("create", key, value, lambda: self.kv.create(key, value, content_type=TEXT_PLAIN))

    def do_cas(self, key: str) -> None:
        expected = self.known_mod_version.get(key) or self.rng.randint(1, max(1, self.last_seen_version))
        value = self._value()
        self._written("cas", key, value, lambda: self.kv.put(key, value, content_type=TEXT_PLAIN, if_version=expected),
                      expected_version=expected)

    def do_delete(self, key: str) -> None:
        self._written("delete", key, None, lambda: self.kv.delete(key))

    def do_txn(self, key: str) -> None:
        expected = self.known_value.get(key) or "absent-value"
        value = self._value()
        fields = {"compare": ["value", expected], "success_op": "put"}
        attempt = self._attempt("txn", key, lambda: self.kv.txn().when_value(key, expected).then_put(
            key, value, TEXT_PLAIN).else_get(key).commit(), value, **fields)
        if attempt is None:
            return
        invoke, result = attempt
        self.last_seen_version = max(self.last_seen_version, result.version)
        if result.succeeded:
            self.known_value[key], self.known_mod_version[key] = value, result.version
            self._record("txn", key, invoke, "ok", {"version": result.version}, value=value, **fields)
            return
        got = result.results[0] if result.results else {}
        read: dict[str, Any] = {"found": bool(got.get("found"))}
        if "kv" in got:
            read.update(value=got["kv"].text, mod_version=got["kv"].mod_version)
            self.known_value[key], self.known_mod_version[key] = got["kv"].text, got["kv"].mod_version
        self._record("txn", key, invoke, "fail", {"read": read, "version": result.version}, value=value, **fields)

    def do_read(self, key: str) -> None:
        weights = self.config.consistency_weights
        consistency = self.rng.choices(list(weights), list(weights.values()))[0]
        fields = {"consistency": consistency, "min_version": None}  # local reads carry the session's
        invoke = now_ns()
        try:
            found = self.kv.get(key, consistency=consistency)
        except MetakvError as exc:
            self._record("read", key, invoke, "error", {"error": exc.title}, **fields)
            return
        result: dict[str, Any] = {"found": found is not None}
        if found is not None:
            result.update(value=found.value.decode(errors="replace"), mod_version=found.mod_version)
            self.known_mod_version[key], self.known_value[key] = found.mod_version, result["value"]
        self._record("read", key, invoke, "ok", result, **fields)
