// The live leases, read-only: GET /v1/leases (this node's applied state) every few seconds.
// Attached keys come from one list of this node's keys (items carry "lease"), bounded:
// the time left is the leader's to know, so it is not shown here.
"use strict";

(() => {
  const {api, el, keyPage, problem, showError} = metakv;
  const REFRESH_MS = 3000;
  const KEYS_READ = 1000;       // keys read to find each lease's keys
  const KEYS_SHOWN = 5;         // per lease
  const status = document.getElementById("leases-status");
  const rows = document.querySelector("#leases tbody");

  async function read(path) {
    const response = await api(path);
    if (!response.ok) throw new Error(await problem(response));
    return response.json();
  }

  async function refresh() {
    try {
      const [leases, keys] = await Promise.all([
        read("/v1/leases"), read("/v1/kv?" + new URLSearchParams({limit: String(KEYS_READ), keys_only: "true"}))]);
      const attached = new Map();
      for (const item of keys.items) {
        if (item.lease) attached.set(item.lease, [...(attached.get(item.lease) || []), item.key]);
      }
      rows.replaceChildren(...leases.leases.map((lease) => {
        const names = attached.get(lease.id) || [];
        const links = names.slice(0, KEYS_SHOWN).flatMap((key) => [el("a", {href: keyPage(key)}, key), " "]);
        if (names.length > KEYS_SHOWN) links.push(`(+${names.length - KEYS_SHOWN})`);
        return el("tr", {dataset: {lease: String(lease.id)}}, el("td", {}, String(lease.id)),
          el("td", {}, String(lease.ttl_s)), el("td", {}, ...links));
      }));
      status.textContent = `${leases.leases.length} live leases at version ${leases.version}` +
        (keys.next !== null ? ` (keys: the first ${KEYS_READ} read)` : "");
      showError("");
    } catch (error) {
      showError(error.message);
    }
    setTimeout(refresh, REFRESH_MS);
  }

  refresh();
})();
