"""Fixtures for the dashboard's browser tests: Debian's chromium driven by pytest-playwright
(playwright's own browser download cannot work here), and one 3-voter + 1-observer cluster
with auth on, shared by the module (starting a cluster is the expensive part)."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, BrowserType, Page, Playwright, expect, sync_playwright

from app.auth import hash_token
from tests.cluster import REPO_ROOT, Cluster, Node

CHROMIUM = "/usr/bin/chromium"  # Debian's package, installed by `make system-chromium`
SECRETS = {"root": "ui-root-secret-51c2", "reader": "ui-reader-secret-9e07", "app-reader": "ui-app-secret-3d18"}
RULES = {"root": {"": "admin"}, "reader": {"": "read"}, "app-reader": {"app/": "read"}}
# Screenshots for docs/ui.md: written to this directory when the variable is set
# (UI_SCREENSHOT_DIR=docs), else under the test's temporary directory.
SCREENSHOT_DIR_VARIABLE = "UI_SCREENSHOT_DIR"
BROWSER_WAIT_MS = 30_000  # generous: the machine may be shared


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: run `make system-chromium` (apt-get install chromium)"
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": ["--no-sandbox"]}


# pytest-playwright's playwright, browser_type and browser fixtures, scoped to the module
# instead of the session: playwright's sync API keeps an event loop running in this thread
# while it lives, and every asyncio test after it in the run would fail to start its own.
@pytest.fixture(scope="module")
def playwright(_pw_api_request_contexts: Any) -> Iterator[Playwright]:
    started = sync_playwright().start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def browser_type(playwright: Playwright, browser_name: str) -> BrowserType:
    return getattr(playwright, browser_name)


@pytest.fixture(scope="module")
def browser(browser_type: BrowserType, browser_type_launch_args: dict[str, Any]) -> Iterator[Browser]:
    launched = browser_type.launch(**browser_type_launch_args)
    try:
        yield launched
    finally:
        launched.close()


@pytest.fixture(scope="module")
def browser_context_args() -> dict[str, Any]:
    """Playwright's own defaults (the plugin's version reads the session-scoped playwright)."""
    return {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("ui")
    token_file = root / "tokens.toml"
    token_file.write_text("\n".join(
        f'[[tokens]]\nname = "{name}"\nsha256 = "{hash_token(secret)}"\n'
        f'rules = {{ {", ".join(f"{json.dumps(p)} = {json.dumps(a)}" for p, a in RULES[name].items())} }}\n'
        for name, secret in SECRETS.items()))
    started = Cluster(root / "cluster", voters=3, observers=1, settings={"auth_file": token_file},
                      token=SECRETS["root"])
    try:
        started.start()
        started.wait_for_leader()
        for node in started.nodes.values():
            started.wait_ready(node)
        yield started
    finally:
        print(started.logs())
        started.close()


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    chosen = os.environ.get(SCREENSHOT_DIR_VARIABLE)
    return (REPO_ROOT / chosen) if chosen else tmp_path


@pytest.fixture
def dialogs(page: Page) -> list[str]:
    """Every JavaScript dialog the page opens (alert, confirm, prompt): dismissed and recorded."""
    opened: list[str] = []

    def record(dialog: Any) -> None:
        opened.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", record)
    page.set_default_timeout(BROWSER_WAIT_MS)
    return opened


def key_url(node: Node, key: str) -> str:
    return f"{node.url}/ui/keys/{urllib.parse.quote(key, safe='/')}"


def api_key_url(node: Node, key: str) -> str:
    return f"{node.url}/v1/kv/{urllib.parse.quote(key, safe='/')}"


def open_with_token(page: Page, url: str, secret: str) -> None:
    """Open a dashboard page and type the token once, as a person would."""
    page.goto(url)
    page.fill("#token-input", secret)
    page.click("#token-form button[type=submit]")
    expect(page.locator("#token-state")).to_be_visible()


def api_get(cluster: Cluster, key: str) -> httpx.Response:
    """The key as the leader has it now (curl's view)."""
    return cluster.client().get(api_key_url(cluster.wait_for_leader(), key), params={"consistency": "leader"})


def api_put(cluster: Cluster, key: str, value: bytes) -> int:
    response = cluster.client().put(api_key_url(cluster.wait_for_leader(), key), content=value,
                                    headers={"Content-Type": "text/plain"})
    assert response.status_code == 200, response.text
    return int(response.json()["version"])


def row_texts(page: Page, selector: str) -> list[str]:
    return [re.sub(r"\s+", " ", text).strip() for text in page.locator(selector).all_inner_texts()]
