"""A token revoked or narrowed by a token-file reload (SIGHUP) ends the reads still open with
it (issue 21: "a revoked token keeps its open streams"): a long-poll or a min_version wait
answers 401/403, an SSE stream ends with a final error event, and other tokens' reads go on."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from app.auth import hash_token
from tests.cluster import Cluster

SECRETS = {"root": "root-secret-0f3a", "reader": "reader-secret-77c1", "writer": "writer-secret-1b9e"}
LONG_MS = 120_000  # far longer than the test waits: only the reload can end these reads
ENDED_WITHIN_S = 30.0


def token_file(rules: dict[str, dict[str, str]]) -> str:
    return "\n".join(
        f'[[tokens]]\nname = "{name}"\nsha256 = "{hash_token(SECRETS[name])}"\n'
        f"rules = {{ {', '.join(f'{json.dumps(p)} = {json.dumps(a)}' for p, a in token_rules.items())} }}\n"
        for name, token_rules in rules.items())


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def sse_lines(url: str, headers: dict[str, str], opened: Future[None]) -> list[str]:
    """Every line of an SSE stream until the node ends it."""
    lines: list[str] = []
    with httpx.Client(timeout=httpx.Timeout(10.0, read=LONG_MS / 1000)) as client, client.stream(
            "GET", url, headers={**headers, "Accept": "text/event-stream"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            opened.set_result(None) if not opened.done() else None
            lines.append(line)
    return lines


def watchers(client: httpx.Client, url: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("metakv_http_watchers "):
            return float(line.split()[1])
    raise AssertionError("no metakv_http_watchers gauge")


def test_a_reload_ends_the_open_reads_of_a_revoked_or_narrowed_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(token_file({"root": {"": "admin"}, "reader": {"": "read"}, "writer": {"app/": "write"}}))
    cluster = Cluster(tmp_path / "cluster", voters=1, settings={"auth_file": path}, token=SECRETS["root"])
    pool = ThreadPoolExecutor(max_workers=5)
    try:
        cluster.start()
        node = cluster.wait_for_leader()
        with httpx.Client(timeout=httpx.Timeout(10.0, read=LONG_MS / 1000)) as http:
            version = int(http.put(f"{node.url}/v1/kv/app/x", content=b"1", headers=bearer("root"))
                          .headers["x-metadata-version"])
            watch = f"{node.url}/v1/watch?since={version}&timeout_ms={LONG_MS}"

            def get(url: str, name: str) -> Callable[[], httpx.Response]:
                return lambda: http.get(url, headers=bearer(name))

            opened: Future[None] = Future()
            sse = pool.submit(sse_lines, f"{watch}&prefix=app/", bearer("reader"), opened)
            opened.result(timeout=ENDED_WITHIN_S)
            writer_poll = pool.submit(get(f"{watch}&prefix=app/", "writer"))
            writer_wait = pool.submit(get(f"{node.url}/v1/kv/app/x?min_version={version + 10**6}&wait_ms=60000",
                                          "writer"))
            root_poll = pool.submit(get(f"{watch}&prefix=app/", "root"))
            cluster.wait_until(lambda: watchers(http, node.url) == 3, timeout_s=ENDED_WITHIN_S)
            # reader loses app/, writer is gone, root is unchanged.
            path.write_text(token_file({"root": {"": "admin"}, "reader": {"": "read", "app/": "deny"}}))
            node.signal(signal.SIGHUP)

            poll: httpx.Response = writer_poll.result(timeout=ENDED_WITHIN_S)
            assert poll.status_code == 401 and "'writer' was revoked" in poll.json()["detail"]
            assert poll.headers["www-authenticate"] == 'Bearer realm="metakv", error="invalid_token"'
            wait: httpx.Response = writer_wait.result(timeout=ENDED_WITHIN_S)
            assert wait.status_code == 401, wait.text
            lines = sse.result(timeout=ENDED_WITHIN_S)
            assert "event: error" in lines, lines
            problem: dict[str, Any] = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
            assert problem["status"] == 403 and "lacks read access" in problem["detail"]
            assert not root_poll.done()  # root's watch goes on, and still sees changes
            assert http.put(f"{node.url}/v1/kv/app/y", content=b"2", headers=bearer("root")).status_code == 200
            events = root_poll.result(timeout=ENDED_WITHIN_S).json()["events"]
            assert [event["key"] for event in events] == ["app/y"]
            cluster.wait_until(lambda: watchers(http, node.url) == 0, timeout_s=ENDED_WITHIN_S)
            assert "audit: 401 GET /v1/watch from 127.0.0.1:" in node.log_tail()
    finally:
        print(cluster.logs())
        cluster.close()
        pool.shutdown(wait=False, cancel_futures=True)
