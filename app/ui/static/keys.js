// The key browser: a prefix as a tree (one level, split on "/") or a flat recursive list,
// one bounded page at a time, read through GET /v1/kv with the user's token.
"use strict";

(() => {
  const {api, el, keyPage, problem, showError} = metakv;
  const PAGE_ENTRIES = 50;     // rows a page shows
  const LIST_LIMIT = 100;      // keys one list request reads
  const MAX_REQUESTS = 20;     // list requests one tree page may make
  const PAST_SUBTREE = "\u{10FFFF}";  // after "dir/" + this: past every key under dir/ (UTF-8 order)
  const {prefix, listing, after} = metakv.main.dataset;

  async function list(cursor, limit) {
    const query = new URLSearchParams({prefix, limit: String(limit), keys_only: "true"});
    if (cursor) query.set("after", cursor);
    const response = await api("/v1/kv?" + query);
    if (!response.ok) throw new Error(await problem(response));
    return response.json();
  }

  // One level under the prefix: keys, and "directories" (the next "/"-ended prefix),
  // each directory read once and skipped past.
  async function treePage() {
    const children = [];
    let cursor = after || null, requests = 0, more = false;
    while (requests < MAX_REQUESTS) {
      const page = await list(cursor, LIST_LIMIT);
      requests += 1;
      let directory = null;
      for (const item of page.items) {
        if (directory !== null && item.key.startsWith(directory)) continue;
        const rest = item.key.slice(prefix.length);
        const slash = rest.indexOf("/");
        if (slash >= 0) {
          directory = prefix + rest.slice(0, slash + 1);
          children.push({directory});
          cursor = directory + PAST_SUBTREE;
        } else {
          directory = null;
          children.push(item);
          cursor = item.key;
        }
        if (children.length >= PAGE_ENTRIES) break;
      }
      if (children.length >= PAGE_ENTRIES || (page.next !== null && requests === MAX_REQUESTS)) {
        more = true;  // the next page may turn out empty: knowing would cost another read
        break;
      }
      if (page.next === null) break;
    }
    return {children, next: more ? cursor : null, version: null};
  }

  async function flatPage() {
    const page = await list(after || null, PAGE_ENTRIES);
    return {children: page.items, next: page.next, version: page.version};
  }

  function row(child) {
    if (child.directory !== undefined) {
      const query = new URLSearchParams({prefix: child.directory, view: "tree"});
      return el("tr", {className: "directory"},
        el("td", {}, el("a", {href: "/ui/keys?" + query}, child.directory.slice(prefix.length))),
        el("td", {}, ""), el("td", {}, ""));
    }
    // In the tree, a key equal to the prefix itself (a key ending in "/") would be an empty link.
    const label = listing === "flat" || child.key === prefix ? child.key : child.key.slice(prefix.length);
    return el("tr", {},
      el("td", {}, el("a", {href: keyPage(child.key), className: "key-link"}, label)),
      el("td", {}, child.mod_version), el("td", {}, child.create_version));
  }

  async function showCreateForm() {
    const form = document.getElementById("create-form");
    if (!form) return;  // read-only mode: the page has no form
    const response = await api("/ui/api/access?" + new URLSearchParams({key: prefix}));
    if (!response.ok || !(await response.json()).write) return;
    form.hidden = false;
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const key = document.getElementById("create-key").value;
      const status = document.getElementById("create-status");
      const answer = await api("/v1/kv/" + metakv.encodeKey(key), {
        method: "PUT", body: document.getElementById("create-value").value,
        headers: {"If-None-Match": "*", "Content-Type": document.getElementById("create-content-type").value || "text/plain"},
      });
      if (answer.ok) {
        location.href = keyPage(key);
      } else if (answer.type === "opaqueredirect") {
        const leader = await metakv.leaderLink("/ui/keys?" + new URLSearchParams({prefix}));
        status.replaceChildren("This node is not the leader; writes go to the leader: open ",
                               leader ? leader.link : "the leader's dashboard", ".");
      } else if (answer.status === 412) {
        status.replaceChildren("The key exists already: ", el("a", {href: keyPage(key)}, key), ".");
      } else {
        status.textContent = await problem(answer);
      }
    });
  }

  async function start() {
    const status = document.getElementById("listing-status");
    try {
      const page = listing === "flat" ? await flatPage() : await treePage();
      document.querySelector("#listing tbody").replaceChildren(...page.children.map(row));
      if (after) {
        const first = document.getElementById("first-page");
        first.href = "/ui/keys?" + new URLSearchParams({prefix, view: listing});
        first.hidden = false;
      }
      status.textContent = page.children.length === 0
        ? (after ? `no more keys under this prefix after "${after}"` : "no keys under this prefix")
        : `${page.children.length} ${listing === "flat" ? "keys" : "entries"}` +
          (page.version !== null ? ` as of version ${page.version}` : "");
      const next = document.getElementById("next-page");
      if (page.next) {
        next.href = "/ui/keys?" + new URLSearchParams({prefix, view: listing, after: page.next});
        next.hidden = false;
      }
    } catch (error) {
      showError(error.message);
    }
    await showCreateForm();
  }

  metakv.whenReady(start);
})();
