"""The chaos workload: concurrent clients on a small key set, recording a history.

Why these choices:
- a few keys and many clients, so operations on one key overlap and a wrong order shows;
- every value written is unique (``<process>-<seq>``), so a read names the write it saw;
- every transaction touches one key (compare by value, put, else get), so the per-key
  checker stays exact; compare-by-value gives the checker CAS on values, If-Match gives CAS
  on ``mod_version``, If-None-Match gives create;
- outcomes follow the API contract: 200 ok; 412 (or a txn that did not succeed) fail;
  504 indeterminate, or a transport error once the request may have been sent; 503,
  a refused connection or a redirect loop: the write surely did not happen ("error").
  307 is followed (httpx re-sends method and body).

A history is one JSON object per line: process, op, key, value, invoke_ns, complete_ns,
outcome, result, plus op-specific fields (consistency, min_version, expected_version,
compare, success_op, since). ``complete_ns`` is the time the client learned the outcome (or
gave up); the checker ignores it for indeterminate operations.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# Client-side bound on one request; above the server's own commit and read waits, so that a
# server answer (504 indeterminate) normally arrives before the client gives up.
REQUEST_TIMEOUT_S = 12.0
# min_version reads wait at most this long on the server.
READ_WAIT_MS = 3000
# Watch long-poll length.
WATCH_TIMEOUT_MS = 1500
# Pause after an error before the next operation of that client.
ERROR_BACKOFF_S = 0.05
# Bound on the records one run may hold in memory.
MAX_HISTORY_RECORDS = 2_000_000
TEXT = {"content-type": "text/plain"}


class History:
    """A thread-safe, append-only list of records, written as JSON lines."""

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            if len(self._records) >= MAX_HISTORY_RECORDS:
                raise RuntimeError(f"history holds {MAX_HISTORY_RECORDS} records; shorten the run")
            self._records.append(record)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)

    def write(self, path: Path) -> None:
        with path.open("w") as handle:
            for record in self.records():
                handle.write(json.dumps(record, separators=(",", ":")) + "\n")


def now_ns() -> int:
    return time.monotonic_ns()


def _is_transport_error_after_send(exc: httpx.HTTPError) -> bool:
    """False only when the request surely never reached a server."""
    return not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)


@dataclass
class WorkloadConfig:
    keys: list[str]
    process_count: int = 6
    # operation mix (weights)
    read_weight: int = 40
    put_weight: int = 20
    cas_weight: int = 12
    create_weight: int = 4
    delete_weight: int = 6
    txn_weight: int = 12
    # how reads are split across consistency levels
    consistency_weights: dict[str, int] = field(
        default_factory=lambda: {"linearizable": 5, "leader": 2, "local": 3})
    min_version_rate: float = 0.3  # share of local reads that pass the client's last seen version
    think_time_s: float = 0.0
    client: str = "httpx"  # "httpx": raw HTTP requests; "metakv": the Python client (client_workload.py)


class Client:
    """One sequential client ("process" in the history): a keep-alive httpx client bound to
    a home node (reads go there; writes start there and follow redirects)."""

    def __init__(self, process: int, urls: Callable[[], dict[int, str]], config: WorkloadConfig,
                 history: History, seed: int) -> None:
        self.process = process
        self.urls = urls
        self.config = config
        self.history = history
        self.rng = random.Random(seed)
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S, follow_redirects=True, max_redirects=3)
        self.sequence = 0
        self.last_seen_version = 0
        self.known_mod_version: dict[str, int] = {}
        self.known_value: dict[str, str] = {}
        self.home = 1 + process % max(1, len(urls()))

    def close(self) -> None:
        self.http.close()

    def url(self) -> str:
        urls = self.urls()
        if self.home not in urls:
            self.home = self.rng.choice(sorted(urls))
        return urls[self.home]

    def rotate(self) -> None:
        """Try another node after an error."""
        nodes = sorted(self.urls())
        self.home = nodes[(nodes.index(self.home) + 1) % len(nodes)] if self.home in nodes else nodes[0]

    def _record(self, op: str, key: str, invoke_ns: int, outcome: str, result: dict[str, Any],
                **fields: Any) -> dict[str, Any]:
        record = {"process": self.process, "op": op, "key": key, "invoke_ns": invoke_ns,
                  "complete_ns": now_ns(), "outcome": outcome, "result": result, "node": self.home, **fields}
        self.history.add(record)
        if outcome in ("error", "indeterminate"):
            self.rotate()
            time.sleep(ERROR_BACKOFF_S)
        return record

    def step(self) -> None:
        config = self.config
        key = self.rng.choice(config.keys)
        kind = self.rng.choices(
            ["read", "put", "cas", "create", "delete", "txn"],
            [config.read_weight, config.put_weight, config.cas_weight, config.create_weight,
             config.delete_weight, config.txn_weight])[0]
        getattr(self, f"do_{kind}")(key)

    def _value(self) -> str:
        self.sequence += 1
        return f"{self.process}-{self.sequence}"

    # -- writes ------------------------------------------------------------------------

    def _write(self, op: str, key: str, method: str, value: str | None, headers: dict[str, str],
               **fields: Any) -> None:
        invoke = now_ns()
        try:
            response = self.http.request(method, f"{self.url()}/v1/kv/{key}",
                                         content=None if value is None else value.encode(),
                                         headers={**TEXT, **headers})
        except httpx.TooManyRedirects:
            self._record(op, key, invoke, "error", {"error": "redirect loop"}, value=value, **fields)
            return
        except httpx.HTTPError as exc:
            outcome = "indeterminate" if _is_transport_error_after_send(exc) else "error"
            self._record(op, key, invoke, outcome, {"error": type(exc).__name__}, value=value, **fields)
            return
        self._write_outcome(op, key, invoke, response, value, **fields)

    def _write_outcome(self, op: str, key: str, invoke: int, response: httpx.Response, value: str | None,
                       **fields: Any) -> None:
        status = response.status_code
        if status == 200:
            body = response.json()
            result = {"version": body["version"], "node": _node_of(response)}
            if "created" in body:
                result["created"] = body["created"]
            if "deleted" in body:
                result["deleted"] = body["deleted"]
            self.last_seen_version = max(self.last_seen_version, int(body["version"]))
            if op != "delete":
                self.known_mod_version[key] = int(body["version"])
            self._record(op, key, invoke, "ok", result, value=value, **fields)
        elif status == 412:
            current = _problem(response).get("current_version")
            if isinstance(current, int) and current > 0:
                self.known_mod_version[key] = current
            self._record(op, key, invoke, "fail", {"current_version": current}, value=value, **fields)
        elif status == 504 and _problem(response).get("indeterminate"):
            self._record(op, key, invoke, "indeterminate", {"status": 504}, value=value, **fields)
        elif status in (503, 307):
            self._record(op, key, invoke, "error", {"status": status}, value=value, **fields)
        else:
            # anything else is outside the contract for these requests: unknown outcome,
            # and the status stays in the history for the report
            self._record(op, key, invoke, "indeterminate", {"status": status, "unexpected": True,
                                                            "body": response.text[:300]}, value=value, **fields)

    def do_put(self, key: str) -> None:
        self._write("put", key, "PUT", self._value(), {})

    def do_create(self, key: str) -> None:
        self._write("create", key, "PUT", self._value(), {"If-None-Match": "*"})

    def do_cas(self, key: str) -> None:
        expected = self.known_mod_version.get(key) or self.rng.randint(1, max(1, self.last_seen_version))
        self._write("cas", key, "PUT", self._value(), {"If-Match": f'"{expected}"'}, expected_version=expected)

    def do_delete(self, key: str) -> None:
        self._write("delete", key, "DELETE", None, {})

    def do_txn(self, key: str) -> None:
        expected = self.known_value.get(key) or "absent-value"
        value = self._value()
        body = {"compare": [{"key": key, "value": expected}],
                "success": [{"op": "put", "key": key, "value": value, "content_type": "text/plain"}],
                "failure": [{"op": "get", "key": key}]}
        fields = {"compare": ["value", expected], "success_op": "put"}
        invoke = now_ns()
        try:
            response = self.http.post(f"{self.url()}/v1/txn", json=body)
        except httpx.TooManyRedirects:
            self._record("txn", key, invoke, "error", {"error": "redirect loop"}, value=value, **fields)
            return
        except httpx.HTTPError as exc:
            outcome = "indeterminate" if _is_transport_error_after_send(exc) else "error"
            self._record("txn", key, invoke, outcome, {"error": type(exc).__name__}, value=value, **fields)
            return
        if response.status_code != 200:
            self._write_outcome("txn", key, invoke, response, value, **fields)
            return
        payload = response.json()
        version = int(payload["version"])
        self.last_seen_version = max(self.last_seen_version, version)
        if payload["succeeded"]:
            self.known_value[key] = value
            self.known_mod_version[key] = version
            self._record("txn", key, invoke, "ok", {"version": version, "node": _node_of(response)},
                         value=value, **fields)
            return
        got = payload["results"][0] if payload["results"] else {}
        read = {"found": bool(got.get("found"))}
        if got.get("found"):
            read.update(value=got.get("value"), mod_version=got.get("mod_version"))
            self.known_value[key] = str(got.get("value"))
            self.known_mod_version[key] = int(got.get("mod_version") or 0)
        self._record("txn", key, invoke, "fail", {"read": read, "version": version}, value=value, **fields)

    # -- reads -------------------------------------------------------------------------

    def do_read(self, key: str) -> None:
        weights = self.config.consistency_weights
        consistency = self.rng.choices(list(weights), list(weights.values()))[0]
        params: dict[str, Any] = {"consistency": consistency}
        min_version = None
        if consistency == "local" and self.rng.random() < self.config.min_version_rate and self.last_seen_version:
            min_version = self.last_seen_version
            params.update(min_version=min_version, wait_ms=READ_WAIT_MS)
        invoke = now_ns()
        fields = {"consistency": consistency, "min_version": min_version}
        try:
            response = self.http.get(f"{self.url()}/v1/kv/{key}", params=params)
        except httpx.HTTPError as exc:
            self._record("read", key, invoke, "error", {"error": type(exc).__name__}, **fields)
            return
        status = response.status_code
        if status not in (200, 404) or (status == 404 and _problem(response).get("type", "").find("key") < 0):
            self._record("read", key, invoke, "error", {"status": status}, **fields)
            return
        node_version = _int_header(response, "X-Metadata-Version")
        result: dict[str, Any] = {"found": status == 200, "node": _node_of(response), "node_version": node_version}
        if status == 200:
            etag = response.headers.get("ETag", "").strip('"')
            result.update(value=response.content.decode(errors="replace"), mod_version=int(etag) if etag else None)
            if etag:
                self.known_mod_version[key] = int(etag)
            self.known_value[key] = result["value"]
        if node_version is not None:
            self.last_seen_version = max(self.last_seen_version, node_version)
        self._record("read", key, invoke, "ok", result, **fields)


def _node_of(response: httpx.Response) -> int | None:
    return _int_header(response, "X-Node-Id")


def _int_header(response: httpx.Response, name: str) -> int | None:
    value = response.headers.get(name, "")
    return int(value) if value.strip().isdigit() else None


def _problem(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class Watcher:
    """Long-polls /v1/watch from a rotating node, recording each answer as a "watch" record.
    After a 410 it re-lists and continues from the list's version (the gap is legitimate)."""

    def __init__(self, process: str, urls: Callable[[], dict[int, str]], history: History, prefix: str) -> None:
        self.process = process
        self.urls = urls
        self.history = history
        self.prefix = prefix
        self.since = 0
        self.turn = 0
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def close(self) -> None:
        self.http.close()

    def step(self) -> None:
        urls = self.urls()
        node = sorted(urls)[self.turn % len(urls)]
        invoke = now_ns()
        try:
            response = self.http.get(f"{urls[node]}/v1/watch",
                                     params={"prefix": self.prefix, "since": self.since, "timeout_ms": WATCH_TIMEOUT_MS})
        except httpx.HTTPError:
            self.turn += 1
            time.sleep(ERROR_BACKOFF_S)
            return
        if response.status_code == 410:
            self._relist(urls[node])
            return
        if response.status_code != 200:
            self.turn += 1
            time.sleep(ERROR_BACKOFF_S)
            return
        body = response.json()
        self.history.add({"process": self.process, "op": "watch", "prefix": self.prefix, "since": self.since,
                          "invoke_ns": invoke, "complete_ns": now_ns(), "outcome": "ok",
                          "result": {"version": body["version"], "events": body["events"], "node": node}})
        self.since = max(self.since, int(body["version"]))
        # switch nodes now and then, so the stream crosses replicas
        if random.random() < 0.1:
            self.turn += 1

    def _relist(self, url: str) -> None:
        try:
            response = self.http.get(f"{url}/v1/kv", params={"prefix": self.prefix, "keys_only": "true"})
            if response.status_code == 200:
                self.since = int(response.json()["version"])
        except httpx.HTTPError:
            self.turn += 1


class Workload:
    """Runs clients and a watcher on threads until ``stop()``."""

    def __init__(self, urls: Callable[[], dict[int, str]], config: WorkloadConfig, history: History,
                 seed: int, prefix: str) -> None:
        kind: type[Client] = Client
        if config.client == "metakv":
            from tests.chaos.client_workload import MetakvClientProcess
            kind = MetakvClientProcess
        self.clients = [kind(p, urls, config, history, seed * 1000 + p) for p in range(config.process_count)]
        self.watcher = Watcher("watch", urls, history, prefix)
        self.config = config
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def _loop(self, step: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                step()
            except Exception as exc:  # a bug in the workload must not stop the run silently
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(ERROR_BACKOFF_S)
            if self.config.think_time_s:
                time.sleep(self.config.think_time_s)

    def start(self) -> None:
        for index, client in enumerate(self.clients):
            thread = threading.Thread(target=self._loop, args=(client.step,), name=f"client-{index}", daemon=True)
            self._threads.append(thread)
        self._threads.append(threading.Thread(target=self._loop, args=(self.watcher.step,), name="watcher",
                                              daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S * 2)
        for client in self.clients:
            client.close()
        self.watcher.close()
