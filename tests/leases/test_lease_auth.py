"""Lease calls under auth (docs/http.md "Auth"), as etcd checks them: revoking a lease
deletes every attached key, so it needs write on each; listing a lease's keys needs read on
each. Otherwise a token denied a prefix could delete its keys, or learn their names, through
a lease another token attached them to."""

from __future__ import annotations

import logging

import httpx
import pytest

from app.auth import Access, AuthPolicy, AuthTokens, Token, hash_token
from app.http import create_app
from tests.http.conftest import TEST_SETTINGS

pytestmark = pytest.mark.anyio

ROOT = {"Authorization": "Bearer root-secret"}
DEPLOYER = {"Authorization": "Bearer deployer-secret"}


async def test_revoke_and_key_list_need_access_to_every_attached_key(service, caplog):
    service.auth_tokens = AuthTokens(AuthPolicy("inline", (
        Token("root", hash_token("root-secret"), (("", Access.ADMIN),)),
        Token("deployer", hash_token("deployer-secret"),
              (("secrets/", Access.DENY), ("apps/", Access.WRITE), ("", Access.READ))))))
    transport = httpx.ASGITransport(app=create_app(service, TEST_SETTINGS))
    async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
        secret = (await http.post("/v1/leases", json={"ttl_s": 60}, headers=ROOT)).json()["id"]
        assert (await http.put(f"/v1/kv/secrets/db?lease={secret}", content=b"pw", headers=ROOT)).status_code == 200
        own = (await http.post("/v1/leases", json={"ttl_s": 60}, headers=DEPLOYER)).json()["id"]
        assert (await http.put(f"/v1/kv/apps/web?lease={own}", content=b"up", headers=DEPLOYER)).status_code == 200

        with caplog.at_level(logging.WARNING, logger="metakv.audit"):
            revoke = await http.delete(f"/v1/leases/{secret}", headers=DEPLOYER)
            listing = await http.get(f"/v1/leases/{secret}", params={"keys": "true"}, headers=DEPLOYER)
        for refused in (revoke, listing):
            assert refused.status_code == 403, refused.text
            assert refused.json()["type"] == "urn:metakv:problem:forbidden"
            assert "secrets/db" in refused.json()["detail"]
        assert sum("audit: 403" in record.getMessage() for record in caplog.records) == 2
        assert (await http.get("/v1/kv/secrets/db", headers=ROOT)).content == b"pw"

        info = await http.get(f"/v1/leases/{secret}", headers=DEPLOYER)  # without its keys: allowed
        assert info.status_code == 200 and "keys" not in info.json()
        assert (await http.get(f"/v1/leases/{own}", params={"keys": "true"}, headers=DEPLOYER)).json()["keys"] == [
            "apps/web"]
        assert (await http.delete(f"/v1/leases/{own}", headers=DEPLOYER)).json()["deleted_keys"] == 1
        assert (await http.delete(f"/v1/leases/{secret}", headers=ROOT)).json()["deleted_keys"] == 1
