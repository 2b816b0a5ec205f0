// The live feed of a prefix: GET /v1/watch as Server-Sent Events, read with fetch (an
// EventSource cannot send the token). Every "id:" is a version to resume from; after the
// stream ends or breaks, the watch reconnects with Last-Event-ID, so nothing is skipped or
// shown twice.
"use strict";

(() => {
  const {api, el, keyPage, problem, decodeText} = metakv;
  const STREAM_MS = 60000;      // one stream's lifetime; the next one resumes where it ended
  const RETRY_MS = 1000;
  const ROWS_KEPT = 500;
  const VALUE_SHOWN = 200;      // characters of a value the feed shows
  const {prefix} = metakv.main.dataset;
  const status = document.getElementById("watch-status");
  const feed = document.querySelector("#feed tbody");
  let resumeFrom = null;
  let gapAfter = null;          // the position a 410 cut the feed at, until the gap row is shown

  function show(type, event) {
    let value = event.value ?? "";
    if (event.encoding === "base64") {
      // Non-text content types come base64: shown as the key page shows them, text when UTF-8.
      value = decodeText(Uint8Array.from(atob(value), (char) => char.charCodeAt(0))).text;
    }
    if (value.length > VALUE_SHOWN) value = value.slice(0, VALUE_SHOWN) + " …";
    feed.prepend(el("tr", {dataset: {type, modVersion: String(event.mod_version)}},
      el("td", {}, new Date().toLocaleTimeString()), el("td", {}, type),
      el("td", {}, el("a", {href: keyPage(event.key)}, event.key)), el("td", {}, event.mod_version),
      el("td", {}, el("code", {}, value))));
    while (feed.children.length > ROWS_KEPT) feed.lastChild.remove();
  }

  // An answer that retrying cannot change (403, 400, ...) stops the feed; a node that is down,
  // restarting or busy (no answer, 5xx, 408, 429) is retried.
  async function refusal(response) {
    const error = new Error(await problem(response));
    error.final = response.status >= 400 && response.status < 500 && ![408, 429].includes(response.status);
    return error;
  }

  async function currentVersion() {
    const response = await api("/v1/kv?" + new URLSearchParams({prefix, limit: "1", keys_only: "true"}));
    if (!response.ok) throw await refusal(response);
    return (await response.json()).version;
  }

  // The feed skips what happened between a 410 and the current version: a row says so, as
  // the status line is overwritten as soon as the feed is live again.
  function showGap(restartVersion) {
    feed.prepend(el("tr", {className: "gap", dataset: {type: "gap"}}, el("td", {}, new Date().toLocaleTimeString()),
      el("td", {}, "gap"), el("td", {colSpan: 3},
        `changes after version ${gapAfter} up to version ${restartVersion} are not shown: ` +
        "the history passed this feed's position; list the prefix to see its state")));
    gapAfter = null;
  }

  function cutByCompaction() {
    if (gapAfter === null) gapAfter = resumeFrom ?? "?";
    resumeFrom = null;  // behind the history horizon: start again from the current version
  }

  function handleEvent(type, data, id) {
    if (id !== null) resumeFrom = Number(id);
    if (!data) return;
    if (type === "error") {
      const gone = JSON.parse(data);
      cutByCompaction();
      status.textContent = `fell behind: ${gone.detail}; restarting from the current version`;
      return;
    }
    show(type, JSON.parse(data));
  }

  async function stream() {
    if (resumeFrom === null) resumeFrom = await currentVersion();
    if (gapAfter !== null) showGap(resumeFrom);
    const query = new URLSearchParams({prefix, since: String(resumeFrom), timeout_ms: String(STREAM_MS)});
    const response = await api("/v1/watch?" + query, {
      headers: {"Accept": "text/event-stream", "Last-Event-ID": String(resumeFrom)},
    });
    if (response.status === 410) {
      cutByCompaction();
      status.textContent = "the history passed this watch's position; restarted from the current version";
      return;
    }
    if (!response.ok) throw await refusal(response);
    status.textContent = `live: changes under "${prefix}" after version ${resumeFrom}`;
    status.dataset.state = "live";
    await metakv.readEvents(response, handleEvent);
  }

  async function run() {
    for (;;) {
      try {
        await stream();
        status.dataset.state = "reconnecting";
      } catch (error) {
        if (error.final) {
          status.dataset.state = "stopped";
          status.textContent = `stopped: ${error.message}`;
          return;
        }
        status.dataset.state = "reconnecting";
        status.textContent = `disconnected (${error.message}); resuming after version ${resumeFrom ?? "?"}`;
        await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
      }
    }
  }

  metakv.whenReady(run);
})();
