// One key: its value, versions and history, and (when the token may write and the node's
// dashboard is not read-only) edits that hold only if the key is still at the version this
// page loaded: If-Match on PUT and DELETE, so a conflict never overwrites anything.
"use strict";

(() => {
  const {api, el, problem, showError, decodeText, keyPage} = metakv;
  const HISTORY_STEP = 10;  // earlier versions read per click
  const key = metakv.main.dataset.key;
  const path = "/v1/kv/" + metakv.encodeKey(key);
  let loaded = null;          // {modVersion, createVersion, contentType, text} or null when absent
  let baseVersion = 0;        // the version edits are conditioned on
  let historyCursor = null;   // read the value as of the version before this one next
  let cursorCreated = null;   // the create version of the value at historyCursor

  async function read(query = {}) {
    const response = await api(path + "?" + new URLSearchParams(query));
    if (response.status === 404) return {absent: true, response};
    if (response.status === 410) return {gone: await response.json().catch(() => ({})), response};
    if (!response.ok) return {error: await problem(response), response};
    const bytes = new Uint8Array(await response.arrayBuffer());
    return {
      response,
      modVersion: Number(response.headers.get("ETag").replaceAll('"', "")),
      createVersion: Number(response.headers.get("X-Create-Version")),
      contentType: response.headers.get("Content-Type") || "",
      ...decodeText(bytes), size: bytes.length,
    };
  }

  function showValue() {
    const pretty = document.getElementById("pretty").checked;
    let text = loaded.text;
    if (pretty) {
      try {
        text = JSON.stringify(JSON.parse(loaded.text), null, 2);
      } catch (error) {
        text = loaded.text;  // not JSON: shown raw
      }
    }
    document.getElementById("value").textContent = text;
  }

  async function load(minVersion) {
    const result = await read(minVersion ? {min_version: String(minVersion)} : {});
    const status = document.getElementById("key-status");
    const readVersion = result.response.headers.get("X-Metadata-Version");
    document.getElementById("history").querySelector("tbody").replaceChildren();
    document.getElementById("history-note").textContent = "";
    if (result.error) {
      status.textContent = result.error;
      return;
    }
    if (result.absent) {
      loaded = null;
      baseVersion = 0;
      status.textContent = `no such key at version ${readVersion}`;
      document.getElementById("key-meta").hidden = true;
      document.getElementById("value-block").hidden = true;
      await offerEdits();
      return;
    }
    loaded = result;
    baseVersion = result.modVersion;
    status.textContent = "";
    document.getElementById("mod-version").textContent = result.modVersion;
    document.getElementById("create-version").textContent = result.createVersion;
    document.getElementById("content-type").textContent = result.contentType;
    document.getElementById("value-size").textContent = `${result.size} bytes`;
    document.getElementById("read-version").textContent = readVersion;
    document.getElementById("key-meta").hidden = false;
    document.getElementById("value-block").hidden = false;
    showValue();
    historyCursor = result.modVersion;
    cursorCreated = result.createVersion;
    await offerEdits();
    await history();
  }

  // Earlier values, newest first: the value as of the version before each change
  // (at_version), until the key did not exist, or compaction removed that version.
  async function history() {
    const body = document.getElementById("history").querySelector("tbody");
    const note = document.getElementById("history-note");
    const more = document.getElementById("history-more");
    more.hidden = true;
    if (body.children.length === 0 && loaded) {
      body.append(el("tr", {}, el("td", {}, `${loaded.modVersion} (current)`), el("td", {}, el("pre", {}, loaded.text))));
    }
    for (let step = 0; step < HISTORY_STEP; step += 1) {
      if (historyCursor <= 1 || historyCursor === cursorCreated) {
        // Nothing earlier to read: asking anyway could only meet compaction and say so, wrongly.
        note.textContent = `version ${historyCursor} created it: there is no earlier value ` +
          "(an earlier life before a delete is not followed)";
        return;
      }
      const result = await read({at_version: String(historyCursor - 1)});
      if (result.absent) {
        note.textContent = `the key did not exist at version ${historyCursor - 1}: ` +
          `version ${historyCursor} created it (an earlier life before a delete is not followed)`;
        return;
      }
      if (result.gone) {
        note.textContent = `older versions were removed by compaction: the oldest version this node ` +
          `still has is ${result.gone.oldest_version ?? "unknown"}, so values before it are gone`;
        return;
      }
      if (result.error) {
        note.textContent = result.error;
        return;
      }
      body.append(el("tr", {}, el("td", {}, result.modVersion), el("td", {}, el("pre", {}, result.text))));
      historyCursor = result.modVersion;
      cursorCreated = result.createVersion;
    }
    more.hidden = false;
  }

  async function writeFailed(answer, operation) {
    const status = document.getElementById("write-status");
    if (answer.type === "opaqueredirect") {
      const leader = await metakv.leaderLink(keyPage(key));
      status.replaceChildren(`Node ${document.body.dataset.nodeId} is not the leader, and writes go to the leader: open `,
                             leader ? leader.link : "the leader's dashboard", " (type the token there once).");
      return;
    }
    if (answer.status === 412) {
      const current = await read();
      const conflict = document.getElementById("conflict");
      const kept = operation === "delete" ? "Nothing was deleted." : "Nothing was changed; your text is still in the editor.";
      document.getElementById("conflict-text").textContent = current.absent
        ? `Conflict: the key was deleted after this page loaded version ${baseVersion}. ${kept}`
        : `Conflict: the key is now at version ${current.modVersion}, not ${baseVersion} as loaded. ${kept} ` +
          "The current value:";
      document.getElementById("conflict-value").textContent = current.absent ? "" : current.text;
      conflict.dataset.currentVersion = current.absent ? "0" : String(current.modVersion);
      conflict.dataset.operation = operation;
      // Retrying a delete deletes the value just shown; retrying a save writes the editor's
      // text (never the text of an editor the user did not open).
      const retry = document.getElementById("rebase-button");
      retry.textContent = operation === "delete" ? "Delete this version anyway" : "Save my text over this version";
      retry.hidden = operation === "delete" && current.absent;
      conflict.hidden = false;
      status.textContent = "";
      return;
    }
    status.textContent = await problem(answer);
  }

  async function save() {
    const answer = await api(path, {
      method: "PUT", body: document.getElementById("edit-value").value,
      headers: {"If-Match": `"${baseVersion}"`,
                "Content-Type": document.getElementById("edit-content-type").value || "text/plain"},
    });
    if (!answer.ok) {
      await writeFailed(answer, "save");
      return;
    }
    const {version} = await answer.json();
    document.getElementById("editor").hidden = true;
    document.getElementById("conflict").hidden = true;
    document.getElementById("write-status").textContent = `saved at version ${version}`;
    await load(version);
  }

  async function remove() {
    document.getElementById("delete-confirm").hidden = true;
    const answer = await api(path, {method: "DELETE", headers: {"If-Match": `"${baseVersion}"`}});
    if (!answer.ok) {
      await writeFailed(answer, "delete");
      return;
    }
    const {version} = await answer.json();
    document.getElementById("conflict").hidden = true;
    document.getElementById("write-status").textContent = `deleted at version ${version}`;
    await load(version);
  }

  let wired = false;
  async function offerEdits() {
    const controls = document.getElementById("edit-controls");
    if (!controls) return;  // read-only mode: the page has no edit controls at all
    const response = await api("/ui/api/access?" + new URLSearchParams({key}));
    const allowed = response.ok && (await response.json()).write;
    controls.hidden = !allowed;
    document.getElementById("delete-button").hidden = !loaded;
    document.getElementById("edit-button").textContent = loaded ? "Edit" : "Create";
    // The editor holds text: saving a binary value's hex preview would replace the bytes.
    const binary = Boolean(loaded && loaded.binary);
    document.getElementById("edit-button").hidden = binary;
    document.getElementById("binary-note").hidden = !binary;
    if (!allowed || wired) return;
    wired = true;
    document.getElementById("edit-button").addEventListener("click", () => {
      document.getElementById("base-version").textContent = baseVersion === 0 ? "0 (absent)" : String(baseVersion);
      document.getElementById("edit-value").value = loaded ? loaded.text : "";
      document.getElementById("edit-content-type").value = loaded ? loaded.contentType : "text/plain";
      document.getElementById("editor").hidden = false;
    });
    document.getElementById("cancel-edit").addEventListener("click", () => {
      document.getElementById("editor").hidden = true;
    });
    document.getElementById("editor").addEventListener("submit", (event) => {
      event.preventDefault();
      save();
    });
    document.getElementById("rebase-button").addEventListener("click", () => {
      // The user read the current value and still wants their write: condition on that version.
      const conflict = document.getElementById("conflict");
      baseVersion = Number(conflict.dataset.currentVersion);
      document.getElementById("base-version").textContent = String(baseVersion);
      conflict.hidden = true;
      if (conflict.dataset.operation === "delete") remove();
      else save();
    });
    document.getElementById("delete-button").addEventListener("click", () => {
      document.getElementById("delete-version").textContent = String(baseVersion);
      document.getElementById("delete-confirm").hidden = false;
    });
    document.getElementById("delete-no").addEventListener("click", () => {
      document.getElementById("delete-confirm").hidden = true;
    });
    document.getElementById("delete-yes").addEventListener("click", remove);
  }

  document.getElementById("pretty").addEventListener("change", () => loaded && showValue());
  document.getElementById("history-more").addEventListener("click", history);
  metakv.whenReady(() => load(null).catch((error) => showError(error.message)));
})();
