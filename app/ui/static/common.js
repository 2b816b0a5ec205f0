// metakv dashboard: what every page shares. The token typed once lives in this tab's
// sessionStorage and goes only to this page's own origin (the CSP's connect-src 'self').
// Every key, value and name is put into the page with textContent, never as HTML.
"use strict";

const metakv = (() => {
  const TOKEN_KEY = "metakv-token";
  const body = document.body;
  const authOn = body.dataset.auth === "on";

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function showError(message) {
    const box = document.getElementById("error");
    box.textContent = message;
    box.hidden = !message;
  }

  function askForToken(message) {
    sessionStorage.removeItem(TOKEN_KEY);
    document.getElementById("token-form").hidden = false;
    document.getElementById("token-state").hidden = true;
    showError(message);
  }

  // fetch against this node with the token. Redirects are not followed: a 307 to the
  // leader would take the token to another origin.
  async function api(path, options = {}) {
    const headers = new Headers(options.headers || {});
    if (authOn && token()) headers.set("Authorization", "Bearer " + token());
    const response = await fetch(path, {...options, headers, redirect: "manual", cache: "no-store"});
    if (response.status === 401) askForToken("The node did not accept the token: type it again.");
    return response;
  }

  async function problem(response) {
    try {
      const document_ = await response.json();
      return `${response.status} ${document_.title || ""}: ${document_.detail || ""}`;
    } catch (error) {
      return `${response.status} ${response.statusText}`;
    }
  }

  // A key as a URL path: each "/"-separated part percent-encoded. A browser resolves a "."
  // or ".." part away (/v1/kv/a/../b is /v1/kv/b), even percent-encoded, so the "/" next to
  // one goes as %2F, which the node decodes back to "/": the path names exactly this key.
  // (The keys "." and ".." themselves have no URL a browser keeps.)
  function encodeKey(key) {
    const parts = key.split("/").map(encodeURIComponent);
    const dot = (part) => part === "." || part === "..";
    let path = parts[0];
    for (let index = 1; index < parts.length; index += 1) {
      const nextToDot = dot(parts[index - 1]) || (index === parts.length - 1 && dot(parts[index]));
      path += (nextToDot ? "%2F" : "/") + parts[index];
    }
    return path;
  }

  function keyPage(key) {
    return "/ui/keys/" + encodeKey(key);
  }

  // el("td", {className: "x"}, "text", otherNode): children are text or nodes, never HTML.
  function el(tag, properties = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(properties)) {
      if (name === "dataset") Object.assign(node.dataset, value);
      else node[name] = value;
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : String(child ?? ""));
    }
    return node;
  }

  function decodeText(bytes) {
    try {
      return {text: new TextDecoder("utf-8", {fatal: true}).decode(bytes), binary: false};
    } catch (error) {
      const hex = Array.from(bytes.slice(0, 256), (b) => b.toString(16).padStart(2, "0")).join(" ");
      return {text: `(binary, ${bytes.length} bytes) ${hex}${bytes.length > 256 ? " …" : ""}`, binary: true};
    }
  }

  function ago(timestampMs, nowMs) {
    if (timestampMs === null || timestampMs === undefined) return "never";
    const seconds = Math.max(0, (nowMs - timestampMs) / 1000);
    return seconds < 1 ? "now" : `${seconds.toFixed(1)} s ago`;
  }

  // Where this node says the leader serves, for a write it answered with 307.
  async function leaderLink(path) {
    const response = await api("/v1/status");
    if (!response.ok) return null;
    const status = await response.json();
    if (!status.leader_url) return null;
    const link = el("a", {href: status.leader_url + path}, `node ${status.leader_id}'s dashboard`);
    return {status, link};
  }

  // Read a text/event-stream response (an EventSource cannot send the token): calls
  // onEvent(type, data, id) per block (id null when the block has none, data "" when it has
  // no data lines); resolves when the stream ends.
  async function readEvents(response, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += value.replaceAll("\r\n", "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let type = "message", data = "", id = null;
        for (const line of block.split("\n")) {
          if (line.startsWith(":")) continue;
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "id") id = text;
          else if (field === "event") type = text;
          else if (field === "data") data += data ? "\n" + text : text;
        }
        onEvent(type, data, id);
      }
    }
  }

  // Run start() once a token is at hand (at once when auth is off).
  function whenReady(start) {
    if (!authOn) {
      start();
      return;
    }
    const form = document.getElementById("token-form");
    document.getElementById("token-forget").addEventListener("click", () => {
      askForToken("");
      location.reload();
    });
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, document.getElementById("token-input").value.trim());
      location.reload();
    });
    if (token()) {
      document.getElementById("token-state").hidden = false;
      start();
    } else {
      askForToken("This node requires a token.");
    }
  }

  return {api, problem, encodeKey, keyPage, el, showError, decodeText, ago, leaderLink, readEvents, whenReady,
          mode: body.dataset.mode, main: document.getElementById("main")};
})();
