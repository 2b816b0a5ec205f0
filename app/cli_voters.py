"""``metakv voters list | add ID | remove ID`` over the HTTP API (docs/api.md, Voters), and
``serve --bootstrap-servers``: a new node learns the voters from any node's /v1/status.

    metakv voters list [--endpoints URL,...] [--output json|table]
    metakv voters add ID [--directory-id HEX] [--raft-endpoint HOST:PORT] [--http-url URL]
    metakv voters remove ID [--directory-id HEX]

``add`` asks the leader which HTTP URL the observer advertises, and the observer itself (its
/v1/status) for its raft endpoint and directory id, as Kafka's tool reads a new controller's
listeners: the leader knows only what the observer's Fetches carry. Bad input exits 2 with
one line; a refused change exits 1 with the problem's title and detail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from app.cli_data import common_options, one_line, print_json, print_table
from app.config import ConfigError, HostPort, NodeConfig, parse_host_port, parse_int, parse_url
from app.status_client import MemberClient, json_object, voter_set_line
from metakv import Client, InvalidRequest, MetakvError, RetryPolicy
from metakv.protocol import Request

EXIT_FAILURE = 1
MAX_NODE_ID = 2**31 - 1
DIRECTORY_ID_HEX_DIGITS = 32
BAD_INPUT_STATUSES = (400, 413, 422)  # the cluster refused the input as malformed: exit 2, as ours


def add_voters_commands(commands: Any) -> None:
    """``metakv voters`` and its three actions (an argparse subparsers action)."""
    common = common_options()
    voters = commands.add_parser("voters", help="list, add or remove the voters of a cluster formatted with --standalone")
    actions = voters.add_subparsers(dest="voters_command", required=True, parser_class=type(voters))
    actions.add_parser("list", parents=[common], help="the voter set in force, its pending change, and the observers")
    add = actions.add_parser("add", parents=[common], help="make an observer that caught up a voter")
    add.add_argument("id", help="the observer's node id")
    add.add_argument("--directory-id", help="only while it is this replica (default: the one it runs with)")
    add.add_argument("--raft-endpoint", help="HOST:PORT the voters reach its raft port at (default: its /v1/status)")
    add.add_argument("--http-url", help="its HTTP URL (default: the one it advertises)")
    remove = actions.add_parser("remove", parents=[common], help="remove a voter (the leader too: it steps down)")
    remove.add_argument("id", help="the voter's node id")
    remove.add_argument("--directory-id", help="only while the voter is this replica")


def run_voters_command(args: argparse.Namespace) -> int:
    if args.output not in ("json", "table"):
        raise ConfigError(f"--output: expected json or table, got {args.output!r}")
    timeout_s = parse_int("--timeout-ms", args.timeout_ms, 1, 3_600_000) / 1000
    endpoints = [parse_url("--endpoints", url) for url in str(args.endpoints).split(",") if url.strip()]
    if not endpoints:
        raise ConfigError("--endpoints: no URL given")
    node_id = None if args.voters_command == "list" else parse_int("ID", args.id, 0, MAX_NODE_ID)
    directory_id = getattr(args, "directory_id", None)
    if directory_id is not None and not _is_directory_id(directory_id):
        raise ConfigError(f"--directory-id: expected {DIRECTORY_ID_HEX_DIGITS} lowercase hex digits, got {directory_id!r}")
    try:
        with Client(endpoints, token=args.token, timeout_s=timeout_s, retry=RetryPolicy(deadline_s=timeout_s)) as client:
            if node_id is None:
                _print_voters(_quorum(client), args.output)
            elif args.voters_command == "add":
                body = _add_body(client, args, node_id, directory_id, endpoints, timeout_s)
                _print_set(_change(client, "POST", "/v1/admin/voters", json.dumps(body).encode()), args.output)
            else:
                query = f"?directory_id={directory_id}" if directory_id else ""
                _print_set(_change(client, "DELETE", f"/v1/admin/voters/{node_id}{query}", None), args.output)
            return 0
    except InvalidRequest as exc:
        if exc.status in BAD_INPUT_STATUSES:
            raise ConfigError(one_line(exc)) from None
        print(f"metakv: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except MetakvError as exc:
        print(f"metakv: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def _is_directory_id(text: str) -> bool:
    return len(text) == DIRECTORY_ID_HEX_DIGITS and all(char in "0123456789abcdef" for char in text)


def _quorum(client: Client) -> dict[str, Any]:
    return json_object_of(client.call(Request("GET", "/v1/quorum", target_leader=True)).json())


def json_object_of(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MetakvError("Malformed answer", "expected a JSON object")
    return value


def _change(client: Client, method: str, path: str, content: bytes | None) -> dict[str, Any]:
    # Not resent after an unknown outcome: the node answers 504 and the operator looks first.
    request = Request(method, path, headers={"content-type": "application/json"} if content else {},
                      content=content, target_leader=True, writes=True, safe_to_resend=False)
    return json_object_of(client.call(request).json())


def _add_body(client: Client, args: argparse.Namespace, node_id: int, directory_id: str | None,
              endpoints: list[str], timeout_s: float) -> dict[str, Any]:
    """The POST body: what was given, and the raft endpoint (and directory id) from the
    observer's own /v1/status at the HTTP URL it advertises to the leader."""
    body: dict[str, Any] = {"id": node_id}
    if args.http_url is not None:
        body["http_url"] = parse_url("--http-url", args.http_url)
    if args.raft_endpoint is not None:
        body["raft_endpoint"] = str(parse_host_port("--raft-endpoint", args.raft_endpoint, min_port=1))
    if directory_id is not None:
        body["directory_id"] = directory_id
    if "raft_endpoint" in body:
        return body
    observer = next((o for o in _quorum(client).get("observers", []) if o.get("node_id") == node_id), None)
    url = body.get("http_url") or (observer or {}).get("endpoint")
    if not url:  # a voter already, or no observer: the leader's answer says which
        return body
    with httpx.Client(timeout=timeout_s) as http:
        try:
            status = json_object(MemberClient(http, endpoints, args.token).get(f"{url}/v1/status"))
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            raise MetakvError("Observer unreachable", f"cannot read {url}/v1/status for node {node_id}'s raft "
                              f"endpoint: {exc}; pass --raft-endpoint") from None
    if status.get("node_id") != node_id or not isinstance(status.get("raft_endpoint"), str):
        raise MetakvError("Observer unreachable", f"{url}/v1/status does not describe node {node_id} with a raft "
                          "endpoint; pass --raft-endpoint")
    body["raft_endpoint"] = status["raft_endpoint"]
    body.setdefault("directory_id", status.get("directory_id") or None)
    return {name: value for name, value in body.items() if value is not None}


def _print_set(voter_set: dict[str, Any] | None, output: str) -> None:
    if output == "json":
        print_json(voter_set)
        return
    print(voter_set_line(voter_set))
    print_table(("NODE", "DIRECTORY ID", "RAFT ENDPOINT", "HTTP URL"),
                [(v.get("node_id"), v.get("directory_id") or "-", v.get("raft_endpoint") or "-", v.get("http_url") or "-")
                 for v in (voter_set or {}).get("voters", [])])


def _print_voters(quorum: dict[str, Any], output: str) -> None:
    voter_set = quorum.get("voter_set")
    observers = [{"node_id": o.get("node_id"), "directory_id": o.get("directory_id"), "http_url": o.get("endpoint"),
                  "caught_up": o.get("caught_up")} for o in quorum.get("observers", [])]
    if output == "json":
        print_json({**(voter_set or {}), "leader_id": quorum.get("leader_id"), "observers": observers})
        return
    _print_set(voter_set, output)
    if observers:
        print()
        print_table(("OBSERVER", "DIRECTORY ID", "HTTP URL", "CAUGHT UP"),
                    [(o["node_id"], o["directory_id"] or "-", o["http_url"] or "-", o["caught_up"]) for o in observers])


class BootstrapError(Exception):
    """No --bootstrap-servers node told the voters: one line, exit 1."""


def voters_from_bootstrap(config: NodeConfig, timeout_s: float = 5.0) -> NodeConfig:
    """``--bootstrap-servers``: the raft endpoints of the voters in force, from the first of
    the servers whose /v1/status answers (a node of any role; no token: it is sent nowhere).
    The node starts as an observer of them even when the set names it: its log's voters
    records make it a voter again only with the same directory id (a wiped one is new)."""
    failures = []
    with httpx.Client(timeout=timeout_s, verify=True) as http:
        for url in config.bootstrap_servers:
            try:
                status = json_object(http.get(f"{url}/v1/status"))
            except (httpx.HTTPError, ValueError) as exc:
                failures.append(f"{url}: {exc}")
                continue
            voters = (status.get("voter_set") or {}).get("voters") or []
            addresses: dict[int, HostPort] = {}
            for voter in voters:
                if isinstance(voter, dict) and type(voter.get("node_id")) is int and voter.get("raft_endpoint"):
                    addresses[voter["node_id"]] = parse_host_port(f"--bootstrap-servers ({url})",
                                                                  voter["raft_endpoint"], min_port=1)
            addresses.pop(config.node_id, None)
            if addresses:
                return dataclasses.replace(config, voters=addresses, observer=True)
            failures.append(f"{url}: its /v1/status names no other voter with a raft endpoint")
    raise BootstrapError(f"--bootstrap-servers: no server told the voters ({'; '.join(failures)})")


GROW_TIMEOUT_S = 60.0  # cluster up --dynamic: for every voter to be added
GROW_RETRY_S = 0.2


def dynamic_voter_flags(node_id: int, count: int, first_raft: HostPort) -> list[str]:
    """``cluster up --dynamic``: node 1 formats itself the only voter; the others observe it.
    Every node lets all others connect as observers (any of them may lead later)."""
    others = ",".join(str(i) for i in range(2, count + 1) if i != node_id)
    flags = ["--standalone"] if node_id == 1 else ["--voters", f"1@{first_raft}", "--observer"]
    return flags + (["--allowed-observers", others] if others else [])


def grow_voters(leader_url: str, nodes: list[tuple[int, str]], token: str | None, verify: Any,
                stop: Callable[[], bool]) -> bool:
    """Add each (node id, raft endpoint) as a voter, one at a time, retrying while the leader
    says it is not caught up yet (or not ready); False, with one line, when one never is."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + GROW_TIMEOUT_S
    with httpx.Client(timeout=10.0, headers=headers, verify=verify, follow_redirects=False) as http:
        for node_id, endpoint in nodes:
            last = "no answer"
            while True:
                if stop():
                    return False
                if time.monotonic() > deadline:
                    print(f"voters: node {node_id} was not added within {GROW_TIMEOUT_S:.0f} s ({last})",
                          file=sys.stderr, flush=True)
                    return False
                try:
                    response = http.post(f"{leader_url}/v1/admin/voters", json={"id": node_id, "raft_endpoint": endpoint})
                except httpx.HTTPError as exc:
                    last = str(exc)
                else:
                    if response.status_code == 200:
                        print(f"voters: added node {node_id}", flush=True)
                        break
                    problem = json_object(response) if response.content else {}
                    last = f"HTTP {response.status_code} {problem.get('type', '')}: {problem.get('detail', '')}"
                    if response.status_code not in (409, 503) or problem.get("type", "").rsplit(":", 1)[-1] not in (
                            "not-caught-up", "leader-not-ready", "change-pending"):
                        print(f"voters: node {node_id} was not added: {last}", file=sys.stderr, flush=True)
                        return False
                time.sleep(GROW_RETRY_S)
    return True
