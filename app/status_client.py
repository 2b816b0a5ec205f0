"""``metakv status``: the quorum table of a running cluster, asked over HTTP.

Where the bearer token goes. Only to the cluster members the user named with ``--url``
(comma-separated, like etcdctl's ``--endpoints``): their scheme and host, any port (the nodes
of a local cluster share a host). A redirect elsewhere is followed without the token (as curl
does without --location-trusted); a redirect from https to http is never followed; an
endpoint listed by /v1/quorum on another host or scheme is asked without the token
(observers report their own endpoints, and a made-up one must not collect tokens).
"""

from __future__ import annotations

import ssl
import sys
import time
import urllib.parse
from typing import Any

import httpx

STATUS_MAX_REDIRECTS = 3  # a follower redirects to the leader once; more means a loop
EXIT_FAILURE = 1


class RedirectRefusedError(httpx.HTTPError):
    """A redirect ``status`` will not follow (https to http)."""


def scheme_and_host(url: str | httpx.URL) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(str(url))
    return parts.scheme.lower(), (parts.hostname or "").lower()


class MemberClient:
    """GETs that carry the token only to the member origins."""

    def __init__(self, client: httpx.Client, members: list[str], token: str | None) -> None:
        self.client = client
        self.members = {scheme_and_host(url) for url in members}
        self.auth = {"Authorization": f"Bearer {token.strip()}"} if token else {}

    def trusted(self, url: str | httpx.URL) -> bool:
        return scheme_and_host(url) in self.members

    def get(self, url: str | httpx.URL) -> httpx.Response:
        return self.client.get(url, headers=self.auth if self.trusted(url) else {})

    def get_following(self, url: str) -> httpx.Response:
        """GET ``url`` following redirects: the token only to members, never to http from https."""
        response = self.get(url)
        for _ in range(STATUS_MAX_REDIRECTS):
            location = response.headers.get("location")
            if response.status_code not in (301, 302, 303, 307, 308) or not location:
                break
            target = response.url.join(location)
            if response.url.scheme == "https" and target.scheme != "https":
                raise RedirectRefusedError(f"{response.url} redirects to {target}: refusing to leave https")
            response = self.get(target)
        return response


def quorum_table(answer: Any) -> dict[str, Any] | None:
    """``/v1/quorum``'s answer when it has the shape of one (None: ``--url`` names something
    else, which must get one line, not a traceback)."""
    if not isinstance(answer, dict) or not {"epoch", "leader_id", "high_watermark"} <= answer.keys():
        return None
    for kind in ("voters", "observers"):
        replicas = answer.get(kind, [])
        if not isinstance(replicas, list) or not all(isinstance(replica, dict) for replica in replicas):
            return None
    return answer


def json_object(response: httpx.Response) -> dict[str, Any]:
    """A JSON object answer, or {} for anything else (raises ValueError for no JSON)."""
    answer = response.json()
    return answer if isinstance(answer, dict) else {}


def httpx_verify(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext | bool:
    """What httpx verifies https nodes with: the system's CAs, or ``ca_file``; plus a client
    certificate when one is given."""
    if ca_file is None and cert_file is None:
        return True
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def print_status(members: list[str], token: str | None, timeout_s: float,
                 verify: ssl.SSLContext | bool = True) -> int:
    url = members[0]
    with httpx.Client(timeout=timeout_s, verify=verify) as http:
        client = MemberClient(http, members, token)
        try:
            quorum = client.get_following(f"{url}/v1/quorum")
            if quorum.status_code in (401, 403):
                if not client.trusted(quorum.url):
                    problem = f"{quorum.url.host} is not a host of --url, so the token was not sent there"
                else:
                    problem = "no --token (or METAKV_TOKEN) given" if not token else "the token was refused"
                print(f"metakv: {url} requires auth: {problem} (HTTP {quorum.status_code})", file=sys.stderr)
                return EXIT_FAILURE
            if quorum.status_code != 200:
                node = json_object(client.get(f"{url}/v1/status"))
                print(f"metakv: no leader reachable from {url} (HTTP {quorum.status_code}); "
                      f"node {node.get('node_id')} is {node.get('role')} in epoch {node.get('epoch')}",
                      file=sys.stderr)
                return EXIT_FAILURE
            table = quorum_table(quorum.json())
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # InvalidURL: a bad Location
            print(f"metakv: cannot reach {url}: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        if table is None:
            print(f"metakv: the answer of {quorum.url} is not a quorum table: is --url a metakv node?",
                  file=sys.stderr)
            return EXIT_FAILURE
        rows = []
        for kind in ("voters", "observers"):
            for replica in table.get(kind, []):
                rows.append(_status_row(client, kind[:-1], replica, table))
    print(f"epoch {table['epoch']}  leader {table['leader_id']}  high watermark {table['high_watermark']}  "
          f"{voter_set_line(table.get('voter_set'))}")
    header = ("NODE", "KIND", "ROLE", "URL", "LOG END", "LAG", "APPLIED", "READY", "LAST FETCH", "DIRECTORY ID")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _status_row(client: MemberClient, kind: str, replica: dict[str, Any], table: dict[str, Any]) -> tuple[Any, ...]:
    endpoint = replica.get("endpoint") or ""
    role, applied, ready = "?", "?", "?"
    if endpoint:
        try:
            response = client.get(f"{endpoint}/v1/status")
            if response.status_code == 401 and not client.trusted(endpoint):
                role = "not in --url"  # asked without the token, which it needs
            else:
                node = json_object(response)
                role, applied, ready = node.get("role"), node.get("applied_version"), node.get("ready")
        except (httpx.HTTPError, httpx.InvalidURL, ValueError):  # InvalidURL: a bad advertised URL
            role = "unreachable"
    last_fetch = replica.get("last_fetch_timestamp_ms")
    if replica.get("node_id") == table.get("leader_id"):
        fetched = "-"
    elif type(last_fetch) is not int:
        fetched = "never"
    else:
        fetched = f"{max(0, int(time.time() * 1000) - last_fetch)} ms ago"
    directory = replica.get("directory_id") or "-"
    if kind == "observer" and replica.get("caught_up"):
        directory += " (caught up)"  # `metakv voters add` would take it now
    return (replica.get("node_id"), kind, role, endpoint or "-", replica.get("log_end_offset"),
            replica.get("lag"), applied, ready, fetched, directory)


def voter_set_line(voter_set: Any) -> str:
    """The kraft version and any uncommitted voter change of /v1/quorum's voter_set."""
    if not isinstance(voter_set, dict):
        return "voters: static (kraft version 0)"
    pending = voter_set.get("pending_change")
    change = "none" if not isinstance(pending, dict) else (
        f"{pending.get('action')} node {pending.get('node_id')} (record at {pending.get('offset')}, uncommitted)")
    kind = "static --voters set" if voter_set.get("kraft_version") == 0 else "voters records"
    return f"kraft version {voter_set.get('kraft_version')} ({kind})  pending voter change: {change}"
