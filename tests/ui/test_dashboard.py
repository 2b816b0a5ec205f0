"""The dashboard (docs/ui.md) in a real browser against a real 3-voter + 1-observer cluster
with auth on: what the operator sees must be what the API says, edits must go through the
API with the user's token and never overwrite a change they did not see, user data is never
markup, and a read-only token gets no way to write.

One cluster serves the module; the failover test kills the leader, so it runs last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, Route, expect

from app.ui.cluster_view import describe
from tests.cluster import Cluster
from tests.ui.conftest import (
    BROWSER_WAIT_MS,
    SECRETS,
    api_get,
    api_key_url,
    api_put,
    key_url,
    open_with_token,
    row_texts,
)


def quorum_leader(cluster: Cluster) -> tuple[int, int]:
    leader = cluster.wait_for_leader()
    quorum = cluster.client().get(f"{leader.url}/v1/quorum").json()
    return int(quorum["leader_id"]), int(quorum["epoch"])


def test_create_edit_and_delete_in_the_browser_are_what_the_api_serves(
        cluster: Cluster, page: Page, dialogs: list[str], screenshot_dir: Path) -> None:
    leader = cluster.wait_for_leader()
    open_with_token(page, f"{leader.url}/ui/keys?prefix=app/", SECRETS["root"])
    page.fill("#create-key", "app/db/url")
    page.fill("#create-value", "postgres://db:5432")
    page.click("#create-form button[type=submit]")
    expect(page.locator("#value")).to_have_text("postgres://db:5432")
    created = api_get(cluster, "app/db/url")
    assert (created.status_code, created.text) == (200, "postgres://db:5432")

    page.click("#edit-button")
    page.fill("#edit-value", '{"host": "db2", "port": 5433}')
    page.fill("#edit-content-type", "application/json")
    page.click("#save-button")
    expect(page.locator("#write-status")).to_contain_text("saved at version")
    edited = api_get(cluster, "app/db/url")
    assert edited.text == '{"host": "db2", "port": 5433}'
    assert edited.headers["content-type"].startswith("application/json")
    page.check("#pretty")
    expect(page.locator("#value")).to_contain_text('"port": 5433')
    page.screenshot(path=str(screenshot_dir / "ui-key.png"), full_page=True)

    page.click("#delete-button")
    expect(page.locator("#delete-confirm")).to_be_visible()  # asked in the page, not a dialog
    assert api_get(cluster, "app/db/url").status_code == 200  # nothing deleted before the confirmation
    page.click("#delete-yes")
    expect(page.locator("#write-status")).to_contain_text("deleted at version")
    assert api_get(cluster, "app/db/url").status_code == 404
    assert dialogs == []


def test_an_edit_on_a_stale_page_is_a_conflict_and_loses_nothing(cluster: Cluster, page: Page,
                                                                  dialogs: list[str]) -> None:
    leader = cluster.wait_for_leader()
    loaded_version = api_put(cluster, "app/flag", b"loaded")
    open_with_token(page, key_url(leader, "app/flag"), SECRETS["root"])
    expect(page.locator("#mod-version")).to_have_text(str(loaded_version))
    page.click("#edit-button")
    page.fill("#edit-value", "mine")
    api_put(cluster, "app/flag", b"theirs")  # someone else's write after the page loaded
    page.click("#save-button")

    expect(page.locator("#conflict")).to_be_visible()
    expect(page.locator("#conflict-value")).to_have_text("theirs")
    assert api_get(cluster, "app/flag").text == "theirs"  # never overwritten
    expect(page.locator("#edit-value")).to_have_value("mine")  # the user's text is kept
    page.click("#rebase-button")  # having seen "theirs", the user saves over it on purpose
    expect(page.locator("#write-status")).to_contain_text("saved at version")
    assert api_get(cluster, "app/flag").text == "mine"
    assert dialogs == []


def test_a_delete_on_a_stale_page_is_a_conflict_and_its_retry_deletes_never_blanks(cluster: Cluster, page: Page,
                                                                                    dialogs: list[str]) -> None:
    """The retry under a delete's conflict once saved the (never opened) editor's empty text."""
    leader = cluster.wait_for_leader()
    api_put(cluster, "app/stale-delete", b"loaded")
    open_with_token(page, key_url(leader, "app/stale-delete"), SECRETS["root"])
    expect(page.locator("#delete-button")).to_be_visible()
    theirs = api_put(cluster, "app/stale-delete", b"theirs")
    page.click("#delete-button")
    page.click("#delete-yes")
    expect(page.locator("#conflict-text")).to_contain_text(f"now at version {theirs}")
    expect(page.locator("#conflict-text")).to_contain_text("Nothing was deleted")
    expect(page.locator("#conflict-value")).to_have_text("theirs")
    assert api_get(cluster, "app/stale-delete").text == "theirs"
    page.click("#rebase-button")  # having seen "theirs", the user deletes it on purpose
    expect(page.locator("#write-status")).to_contain_text("deleted at version")
    assert api_get(cluster, "app/stale-delete").status_code == 404
    assert dialogs == []


def test_a_put_made_with_curl_appears_in_the_watch_feed_and_history_shows_earlier_values(
        cluster: Cluster, page: Page, dialogs: list[str], screenshot_dir: Path) -> None:
    observer = cluster.observers[0]  # the feed is served by any node, the observer too
    open_with_token(page, f"{observer.url}/ui/watch?prefix=feed/", SECRETS["root"])
    expect(page.locator("#watch-status")).to_have_attribute("data-state", "live")
    versions = [api_put(cluster, "feed/color", value) for value in (b"red", b"green", b"blue")]
    api_put(cluster, "other/color", b"not under the prefix")
    expect(page.locator("#feed tbody tr")).to_have_count(3)
    assert row_texts(page, "#feed tbody tr td:nth-child(4)") == [str(v) for v in reversed(versions)]
    assert [text.strip() for text in page.locator("#feed tbody tr td:nth-child(5)").all_inner_texts()] == [
        "blue", "green", "red"]
    cluster.kill(observer)  # the stream breaks; the feed resumes after the last version it saw
    expect(page.locator("#watch-status")).to_have_attribute("data-state", "reconnecting")
    versions.append(api_put(cluster, "feed/color", b"violet"))  # made while the page is cut off
    observer.start()
    expect(page.locator("#feed tbody tr")).to_have_count(4, timeout=BROWSER_WAIT_MS)
    assert row_texts(page, "#feed tbody tr td:nth-child(4)") == [str(v) for v in reversed(versions)]
    page.screenshot(path=str(screenshot_dir / "ui-watch.png"), full_page=True)

    page.goto(key_url(observer, "feed/color"))  # same origin: the token is remembered
    expect(page.locator("#history tbody tr")).to_have_count(4)
    assert row_texts(page, "#history tbody tr") == [
        f"{versions[3]} (current) violet", f"{versions[2]} blue", f"{versions[1]} green", f"{versions[0]} red"]
    expect(page.locator("#history-note")).to_contain_text(f"version {versions[0]} created it")

    page.goto(f"{observer.url}/ui/keys?prefix=")
    expect(page.locator("#listing tbody tr.directory a", has_text="feed/")).to_be_visible()
    page.screenshot(path=str(screenshot_dir / "ui-keys.png"), full_page=True)
    assert dialogs == []


def test_the_watch_feed_shows_text_values_as_text_and_marks_a_gap_it_cannot_replay(
        cluster: Cluster, page: Page, dialogs: list[str]) -> None:
    leader = cluster.wait_for_leader()
    cut: list[str] = []

    def history_passed_once(route: Route) -> None:
        """The node's answer when the history passed the feed's position (e.g. after a long cut)."""
        if cut:
            route.continue_()
            return
        cut.append(route.request.url)
        route.fulfill(status=410, content_type="application/problem+json", body=json.dumps({
            "type": "urn:metakv:problem:version-compacted", "title": "Version compacted", "status": 410,
            "detail": "versions below 10 are no longer retained", "oldest_version": 10}))

    page.route("**/v1/watch?*", history_passed_once)
    open_with_token(page, f"{leader.url}/ui/watch?prefix=decoded/", SECRETS["root"])
    expect(page.locator("#watch-status")).to_have_attribute("data-state", "live")
    # The status line is overwritten once live again: the row stays to say what was skipped.
    expect(page.locator('#feed tr[data-type="gap"]')).to_contain_text("are not shown")
    for value in ("é".encode(), b"\xff\xfe"):  # octet-stream: the event carries base64
        response = cluster.client().put(api_key_url(leader, "decoded/v"), content=value)
        assert response.status_code == 200, response.text
    expect(page.locator('#feed tr[data-type="put"]')).to_have_count(2)
    assert row_texts(page, '#feed tr[data-type="put"] td:nth-child(5)') == ["(binary, 2 bytes) ff fe", "é"]
    assert dialogs == []


def test_a_watch_the_token_may_not_read_stops_and_says_why(cluster: Cluster, page: Page, dialogs: list[str]) -> None:
    """It once retried the 403 every second forever, saying "resuming"."""
    open_with_token(page, f"{cluster.wait_for_leader().url}/ui/watch?prefix=secret/", SECRETS["app-reader"])
    expect(page.locator("#watch-status")).to_have_attribute("data-state", "stopped")
    expect(page.locator("#watch-status")).to_contain_text("403 Forbidden")
    assert dialogs == []


def test_the_key_browser_shows_a_tree_a_flat_list_and_bounded_pages(cluster: Cluster, page: Page,
                                                                   dialogs: list[str]) -> None:
    leader = cluster.wait_for_leader()
    keys = [f"pages/k{index:03d}" for index in range(55)] + ["pages/sub/a", "pages/sub/deeper/b"]
    response = cluster.client().post(f"{leader.url}/v1/txn", json={
        "compare": [], "success": [{"op": "put", "key": key, "value": "v"} for key in keys]})
    assert response.status_code == 200, response.text
    open_with_token(page, f"{leader.url}/ui/keys?prefix=pages/&view=flat", SECRETS["root"])
    expect(page.locator("#listing tbody tr")).to_have_count(50)  # one page, never the whole prefix
    first_page = row_texts(page, "#listing tbody tr td:first-child")
    page.click("#next-page")
    expect(page.locator("#listing tbody tr")).to_have_count(7)
    assert first_page + row_texts(page, "#listing tbody tr td:first-child") == keys
    expect(page.locator("#next-page")).to_be_hidden()
    page.click("#first-page")
    expect(page.locator("#listing tbody tr")).to_have_count(50)
    expect(page.locator("#first-page")).to_be_hidden()
    page.goto(f"{leader.url}/ui/keys?prefix=pages/&view=flat&after=pages/z")
    expect(page.locator("#listing-status")).to_have_text('no more keys under this prefix after "pages/z"')

    page.goto(f"{leader.url}/ui/keys?prefix=pages/&view=tree")  # one level: sub/ once, its keys inside it
    expect(page.locator("#listing tbody tr")).to_have_count(50)
    page.click("#next-page")
    expect(page.locator("#listing tbody tr")).to_have_count(6)
    assert row_texts(page, "#listing tbody tr td:first-child") == [
        "k050", "k051", "k052", "k053", "k054", "sub/"]
    page.locator("#listing a", has_text="sub/").click()
    expect(page.locator("#listing tbody tr")).to_have_count(2)
    assert row_texts(page, "#listing tbody tr td:first-child") == ["a", "deeper/"]
    assert dialogs == []


def test_a_key_and_value_made_of_markup_are_shown_as_text(cluster: Cluster, page: Page, dialogs: list[str]) -> None:
    key, value = "xss/<img src=x onerror=alert(1)>", "</script><script>alert(2)</script>"
    leader = cluster.wait_for_leader()
    open_with_token(page, f"{leader.url}/ui/watch?prefix=xss/", SECRETS["root"])
    expect(page.locator("#watch-status")).to_have_attribute("data-state", "live")
    api_put(cluster, key, value.encode())
    expect(page.locator("#feed tbody tr td:nth-child(3)")).to_have_text(key)
    expect(page.locator("#feed tbody tr td:nth-child(5)")).to_have_text(value)

    page.goto(f"{leader.url}/ui/keys?prefix=xss/")
    expect(page.locator("#listing a.key-link")).to_have_text("<img src=x onerror=alert(1)>")
    page.click("#listing a.key-link")
    expect(page.locator("#key-name")).to_have_text(key)
    expect(page.locator("#value")).to_have_text(value)
    expect(page.locator("#history tbody tr")).to_have_count(1)
    assert page.locator("img").count() == 0 and page.locator("main script").count() == 0
    assert dialogs == []


def test_keys_with_dot_parts_and_odd_values_open_their_own_page(cluster: Cluster, page: Page,
                                                                 dialogs: list[str]) -> None:
    """A browser resolves "." and ".." in a URL path: the link of "odd/../up" once opened the key
    "up", where Edit and Delete would have hit that other key."""
    leader = cluster.wait_for_leader()
    values = {"odd/../up": "dot-dot", "odd/./here": "dot", "odd/a/..": "trailing dot-dot",
              "odd/q?#%20 é": "punctuation", "odd/dir/": "a key ending in /"}
    response = cluster.client().post(f"{leader.url}/v1/txn", json={"compare": [], "success": [
        *({"op": "put", "key": key, "value": value, "content_type": "text/plain"} for key, value in values.items()),
        {"op": "put", "key": "odd/binary", "value": "//4AAQ==", "encoding": "base64"}]})
    assert response.status_code == 200, response.text
    open_with_token(page, f"{leader.url}/ui/keys?prefix=odd/&view=flat", SECRETS["root"])
    expect(page.locator("#listing a.key-link")).to_have_count(len(values) + 1)
    links = {link.inner_text(): link.get_attribute("href") for link in page.locator("#listing a.key-link").all()}
    for key, value in values.items():
        page.goto(f"{leader.url}{links[key]}")
        expect(page.locator("#value")).to_have_text(value)
        expect(page.locator("#key-name")).to_have_text(key)
        expect(page.locator("#edit-button")).to_be_visible()
    # A binary value is shown as hex, and not offered to the text editor (saving would replace it).
    page.goto(f"{leader.url}{links['odd/binary']}")
    expect(page.locator("#value")).to_have_text("(binary, 4 bytes) ff fe 00 01")
    expect(page.locator("#delete-button")).to_be_visible()
    expect(page.locator("#edit-button")).to_be_hidden()
    expect(page.locator("#binary-note")).to_be_visible()
    page.goto(f"{leader.url}/ui/keys?prefix=odd/dir/")  # the key equal to the prefix: not an empty link
    expect(page.locator("#listing a.key-link")).to_have_text("odd/dir/")
    assert dialogs == []


def test_a_read_only_token_sees_no_edit_controls_and_a_forced_edit_is_403(cluster: Cluster, page: Page,
                                                                         dialogs: list[str]) -> None:
    leader = cluster.wait_for_leader()
    api_put(cluster, "app/readonly", b"unchanged")
    open_with_token(page, key_url(leader, "app/readonly"), SECRETS["reader"])
    expect(page.locator("#value")).to_have_text("unchanged")
    expect(page.locator("#edit-controls")).to_be_hidden()
    expect(page.locator("#edit-button")).to_be_hidden()
    page.goto(f"{leader.url}/ui/keys?prefix=app/")
    expect(page.locator("#listing a.key-link").first).to_be_visible()
    expect(page.locator("#create-form")).to_be_hidden()

    # Forcing it from the page (as a user could in the console) meets the API's own refusal.
    status = page.evaluate("""async (url) => (await fetch(url, {method: "PUT", body: "forced",
        headers: {Authorization: "Bearer " + sessionStorage.getItem("metakv-token")}})).status""",
                           api_key_url(leader, "app/readonly"))
    assert status == 403
    assert api_get(cluster, "app/readonly").text == "unchanged"
    assert dialogs == []


def test_an_edit_on_a_follower_links_to_the_leader_and_changes_nothing(cluster: Cluster, page: Page,
                                                                      dialogs: list[str]) -> None:
    leader = cluster.wait_for_leader()
    follower = next(node for node in cluster.voters if node.node_id != leader.node_id)
    api_put(cluster, "app/on-follower", b"before")
    open_with_token(page, key_url(follower, "app/on-follower"), SECRETS["root"])
    page.click("#edit-button")
    page.fill("#edit-value", "after")
    page.click("#save-button")
    expect(page.locator("#write-status")).to_contain_text("is not the leader")
    # The 307 is not followed (the token would go to another origin): a link to the leader's page.
    expect(page.locator("#write-status a")).to_have_attribute("href", key_url(leader, "app/on-follower"))
    assert api_get(cluster, "app/on-follower").text == "before"
    assert dialogs == []


def test_history_says_where_compaction_removed_older_versions(cluster: Cluster, page: Page,
                                                             dialogs: list[str]) -> None:
    leader = cluster.wait_for_leader()
    created_once = api_put(cluster, "compacted/once", b"only value")
    for value in (b"one", b"two", b"three"):
        last = api_put(cluster, "compacted/k", value)
    api_put(cluster, "compacted-filler", b"x")  # the dirty offset trails the last write by a fetch

    def compacted_past_the_second_value() -> bool:
        assert cluster.client().post(f"{leader.url}/v1/admin/compact").status_code == 200
        return int(cluster.client().get(f"{leader.url}/v1/status").json()["oldest_version"]) > last - 1

    cluster.wait_until(compacted_past_the_second_value, what=f"history below version {last} compacted")
    oldest = int(cluster.client().get(f"{leader.url}/v1/status").json()["oldest_version"])
    open_with_token(page, key_url(leader, "compacted/k"), SECRETS["root"])
    expect(page.locator("#history-note")).to_contain_text(
        f"older versions were removed by compaction: the oldest version this node still has is {oldest}")
    assert row_texts(page, "#history tbody tr") == [f"{last} (current) three"]
    # Its only value created it: nothing older existed, whatever compaction removed since.
    page.goto(key_url(leader, "compacted/once"))
    expect(page.locator("#history-note")).to_contain_text(f"version {created_once} created it")
    assert dialogs == []


def test_a_view_naming_no_leader_replaces_the_last_leaders_picture(cluster: Cluster, page: Page,
                                                                  dialogs: list[str]) -> None:
    """With quorum lost, no node knows a leader: such views were dropped as older than the last
    leader's epoch, and the page froze showing a dead leader. (Views scripted here; the real
    failover is the next test.)"""
    def node_status(node_id: int, role: str, epoch: int, leader_id: int) -> dict[str, Any]:
        return {"node_id": node_id, "role": role, "epoch": epoch, "leader_id": leader_id, "voter": True}

    led = describe(2, {1: node_status(1, "leader", 3, 1), 2: node_status(2, "follower", 3, 1)}, None, 1, 3, 0)
    leaderless = describe(2, {1: None, 2: node_status(2, "candidate", 4, -1)}, None, -1, -1, 0)
    quorum_lost: list[bool] = []

    def scripted_views(route: Route) -> None:
        route.fulfill(status=200, content_type="application/json", body=json.dumps(leaderless if quorum_lost else led))

    page.route("**/ui/api/cluster", scripted_views)
    open_with_token(page, f"{cluster.wait_for_leader().url}/ui", SECRETS["root"])
    expect(page.locator("#leader")).to_have_text("node 1")
    quorum_lost.append(True)
    expect(page.locator("#leader")).to_have_text("none known")
    expect(page.locator("#quorum-banner")).to_contain_text("No leader")
    expect(page.locator('#nodes tr[data-node-id="1"]')).to_have_attribute("data-role", "down")
    assert dialogs == []


def test_a_plot_says_now_only_of_the_latest_interval(cluster: Cluster, page: Page, dialogs: list[str]) -> None:
    """With no commit in the latest interval, the latency plot said "now 3.00", a value from
    a minute before."""
    points = [{"t": 1_000 + 2_000 * index, "writes_per_s": 0.0, "apply_lag": 0.0,
               "commit_latency_ms": 3.0 if index < 2 else None} for index in range(4)]
    page.route("**/ui/api/metrics", lambda route: route.fulfill(
        status=200, content_type="application/json", body=json.dumps({"node_id": 1, "points": points})))
    open_with_token(page, f"{cluster.wait_for_leader().url}/ui", SECRETS["root"])
    expect(page.locator("#chart-latency text", has_text="now")).to_have_text("now –")
    expect(page.locator("#chart-latency polyline")).to_have_count(1)  # the measured part is drawn
    expect(page.locator("#chart-writes text", has_text="now")).to_have_text("now 0.00")
    assert dialogs == []


def test_every_node_shows_the_quorums_leader_and_a_killed_leader_is_replaced_without_reload(
        cluster: Cluster, page: Page, dialogs: list[str], screenshot_dir: Path) -> None:
    leader_id, epoch = quorum_leader(cluster)
    for node in cluster.nodes.values():
        open_with_token(page, f"{node.url}/ui", SECRETS["root"])
        expect(page.locator("#leader")).to_have_attribute("data-leader-id", str(leader_id))
        expect(page.locator("#epoch")).to_have_text(str(epoch))
        expect(page.locator(f'#nodes tr[data-node-id="{leader_id}"]')).to_have_attribute("data-role", "leader")
        expect(page.locator('#nodes tr[data-role="leader"]')).to_have_count(1)
        expect(page.locator("#nodes tbody tr")).to_have_count(4)
        for other in cluster.nodes.values():  # each row links to that node's own dashboard
            expect(page.locator(f'#nodes tr[data-node-id="{other.node_id}"] a')).to_have_attribute(
                "href", f"{other.url}/ui")

    expect(page.locator("#chart-writes polyline")).to_have_count(1, timeout=BROWSER_WAIT_MS)
    page.screenshot(path=str(screenshot_dir / "ui-cluster.png"), full_page=True)
    survivor = next(node for node in cluster.voters if node.node_id != leader_id)
    page.goto(f"{survivor.url}/ui")
    # Record every leader the page ever shows, to check it never shows two for one epoch.
    page.evaluate("""() => { window.leadersSeen = [];
        new MutationObserver(() => window.leadersSeen.push([
            document.getElementById("leader").dataset.leaderId, document.getElementById("epoch").textContent,
            document.querySelectorAll('#nodes tr[data-role="leader"]').length]))
          .observe(document.getElementById("main"), {subtree: true, childList: true, attributes: true,
                                                     characterData: true}); }""")
    old_leader = cluster.nodes[leader_id]
    cluster.kill(old_leader)
    try:
        new_leader = cluster.wait_for_leader(exclude={leader_id})
        expect(page.locator("#leader")).to_have_attribute("data-leader-id", str(new_leader.node_id),
                                                          timeout=BROWSER_WAIT_MS)
        expect(page.locator(f'#nodes tr[data-node-id="{leader_id}"]')).to_have_attribute(
            "data-role", "down", timeout=BROWSER_WAIT_MS)
        # What a dead node would say is unknown, not "none" (its snapshot column said so).
        expect(page.locator(f'#nodes tr[data-node-id="{leader_id}"] td:nth-child(8)')).to_have_text("–")
        assert quorum_leader(cluster)[0] == new_leader.node_id
        expect(page.locator("#quorum-banner")).to_contain_text("Quorum at risk")  # 2 of 3 voters left
        expect(page.locator("#nodes tbody tr")).to_have_count(4)  # the observer too, before it fetched
        page.screenshot(path=str(screenshot_dir / "ui-cluster-failover.png"), full_page=True)
        seen = page.evaluate("window.leadersSeen")
        leaders_by_epoch: dict[str, set[str]] = {}
        for shown_leader, shown_epoch, leader_rows in seen:
            assert leader_rows <= 1, seen
            if shown_leader:
                leaders_by_epoch.setdefault(shown_epoch, set()).add(shown_leader)
        assert all(len(leaders) == 1 for leaders in leaders_by_epoch.values()), leaders_by_epoch
    finally:
        cluster.restart(old_leader)
    cluster.wait_ready(old_leader)
    assert dialogs == []
