"""WatcherSlots' caps per node and per token (the HTTP route answers its ProblemError 429)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from app.http.auth import TOKEN_NAME_SCOPE_KEY
from app.http.problems import ProblemError
from app.http.watch_limits import WatcherSlots, watcher_metrics


def scope_of(token: str | None) -> dict[str, object]:
    return {} if token is None else {TOKEN_NAME_SCOPE_KEY: token}


def test_a_token_past_its_cap_is_refused_while_other_tokens_still_watch() -> None:
    slots = WatcherSlots(max_watchers=10, max_per_token=2, metrics=watcher_metrics(CollectorRegistry()))
    releases = [slots.take(scope_of("alice")) for _ in range(2)]
    with pytest.raises(ProblemError) as refused:
        slots.take(scope_of("alice"))
    assert refused.value.status == 429 and refused.value.slug == "too-many-watchers"
    assert refused.value.headers["Retry-After"] == "1" and "'alice'" in refused.value.detail
    slots.take(scope_of("bob"))
    releases[0]()
    releases[0]()  # a second release of one slot frees nothing more
    slots.take(scope_of("alice"))
    assert slots.active == 3 and slots.by_token == {"alice": 2, "bob": 1}


def test_the_node_cap_counts_every_watch_and_frees_on_release() -> None:
    registry = CollectorRegistry()
    slots = WatcherSlots(max_watchers=2, max_per_token=2, metrics=watcher_metrics(registry))
    first = slots.take(scope_of(None))
    slots.take(scope_of("alice"))
    with pytest.raises(ProblemError, match="maximum of 2 watches"):
        slots.take(scope_of("bob"))
    assert registry.get_sample_value("metakv_http_watchers") == 2
    assert registry.get_sample_value("metakv_http_watchers_refused_total", {"cap": "node"}) == 1
    first()
    slots.take(scope_of("bob"))
    assert registry.get_sample_value("metakv_http_watchers") == 2
