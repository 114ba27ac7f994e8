// tokenbelt web chat: plain JavaScript, no build step, no network beyond this server.
//
// The Stop button (and Esc) first asks the server to cancel the request
// (POST /v1/requests/{id}/cancel, recorded as user_cancel) and only then stops
// listening (AbortController). Aborting first would make the server see a
// disconnect and record client_disconnect instead.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const now = () => performance.timeOrigin + performance.now(); // epoch ms, sub-ms precision
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // -- Markdown, rendered safely ---------------------------------------------------------
  // Every piece of model text goes through escapeHtml before it reaches the markup we
  // build; the only tags in the output are the ones written below.

  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  function inline(escaped) {
    // Code spans are set aside first so that emphasis never reaches inside them.
    const codes = [];
    let s = escaped.replace(/`([^`\n]+)`/g, (_, code) => {
      codes.push(code);
      return `\u0000${codes.length - 1}\u0000`;
    });
    s = s.replace(/\*\*(?=\S)([^\n]*?\S)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^\w])__(?=\S)([^\n]*?\S)__(?!\w)/g, "$1<strong>$2</strong>");
    s = s.replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![_\w])/g, "$1<em>$2</em>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
  }

  function renderMarkdown(text) {
    // NUL is our placeholder marker: model text never gets to use it.
    const lines = String(text).replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null;
    const md = (line) => inline(escapeHtml(line));
    const flushPara = () => {
      if (para.length) out.push(`<p>${para.map(md).join("<br>")}</p>`);
      para = [];
    };
    const flushList = () => {
      if (list) {
        const items = list.items.map((item) => `<li>${md(item)}</li>`).join("");
        out.push(`<${list.tag}>${items}</${list.tag}>`);
      }
      list = null;
    };
    for (let i = 0; i < lines.length; i += 1) {
      const line = lines[i];
      const fence = /^\s*```\s*([\w+-]*)/.exec(line);
      if (fence) {
        flushPara();
        flushList();
        const body = [];
        // An unclosed fence (a reply still streaming) runs to the end of the text.
        for (i += 1; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i += 1) body.push(lines[i]);
        const lang = fence[1] ? ` data-lang="${escapeHtml(fence[1])}"` : "";
        out.push(`<pre${lang}><code>${escapeHtml(body.join("\n"))}</code></pre>`);
        continue;
      }
      const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
      const number = /^\s*\d{1,9}[.)]\s+(.*)$/.exec(line);
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (bullet || number) {
        flushPara();
        const tag = bullet ? "ul" : "ol";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push((bullet || number)[1]);
      } else if (heading) {
        flushPara();
        flushList();
        const level = Math.min(heading[1].length + 2, 6); // h3..h6: headings inside a reply
        out.push(`<h${level}>${md(heading[2])}</h${level}>`);
      } else if (line.trim() === "") {
        flushPara();
        flushList();
      } else if (list && /^\s+\S/.test(line)) {
        list.items[list.items.length - 1] += ` ${line.trim()}`;
      } else {
        flushList();
        para.push(line);
      }
    }
    flushPara();
    flushList();
    return out.join("");
  }

  // -- small helpers -----------------------------------------------------------------------

  function el(tag, props = {}, children = []) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (key === "text") node.textContent = value;
      else if (key === "testid") node.dataset.testid = value;
      else if (key === "className") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function fmtMs(value) {
    if (value === null || value === undefined) return "–";
    return value < 10 ? `${value.toFixed(1)} ms` : `${Math.round(value)} ms`;
  }

  function showError(message) {
    const banner = $("error");
    banner.textContent = message;
    banner.hidden = false;
  }

  function hideError() {
    $("error").hidden = true;
  }

  function apiHeaders(json) {
    const headers = {};
    if (json) headers["content-type"] = "application/json";
    const key = $("api-key").value.trim();
    if (key) headers.authorization = `Bearer ${key}`;
    return headers;
  }

  async function errorText(response) {
    let message = `${response.status} ${response.statusText}`.trim();
    try {
      const body = await response.json();
      const error = body && body.error;
      if (error && error.message) {
        message = `${error.message} (HTTP ${response.status}${error.code ? `, ${error.code}` : ""})`;
      }
    } catch (_) {
      // not JSON: the status line is all we have
    }
    const retry = response.headers.get("retry-after");
    if (retry) message += `; retry after ${retry} s`;
    if (response.status === 401) {
      $("api-key-field").hidden = false;
      $("settings").open = true;
      message += ". Enter the server's API key in Settings.";
    }
    return message;
  }

  async function getJson(path) {
    const response = await fetch(path, { headers: apiHeaders(false), cache: "no-store" });
    if (!response.ok) throw new Error(await errorText(response));
    return response.json();
  }

  // -- settings: the server's limits, checked in the form ----------------------------------
  // The same bounds as the server's request schema (server/core/_options.py and
  // server/openai/_schemas.py); a test compares them with /openapi.json so the two cannot
  // drift apart.

  const DEFAULT_MAX_TOKENS = 512;
  const LIMITS = {
    max_tokens: { minimum: 1, maximum: 1048576, integer: true },
    temperature: { minimum: 0, maximum: 2 },
    top_p: { exclusiveMinimum: 0, maximum: 1 },
    seed: { minimum: 0, maximum: 4294967295, integer: true },
    stop: { maxItems: 16 },
  };
  const FIELDS = [
    ["max_tokens", "max-tokens"],
    ["temperature", "temperature"],
    ["top_p", "top-p"],
    ["seed", "seed"],
  ];
  const SETTINGS_KEY = "tokenbelt.settings.v1";
  const STORE_KEY = "tokenbelt.conversations.v1";
  const MINE_KEY = "tokenbelt.requests.v1";

  function describeRange(limit) {
    const low = limit.exclusiveMinimum !== undefined ? `more than ${limit.exclusiveMinimum}` : `${limit.minimum}`;
    const kind = limit.integer ? "a whole number" : "a number";
    return limit.exclusiveMinimum !== undefined
      ? `${kind} ${low} and at most ${limit.maximum}`
      : `${kind} from ${low} to ${limit.maximum}`;
  }

  function checkNumber(raw, limit) {
    if (raw === "") return { value: undefined };
    const value = Number(raw);
    const bad = !Number.isFinite(value)
      || (limit.integer && !Number.isInteger(value))
      || (limit.minimum !== undefined && value < limit.minimum)
      || (limit.exclusiveMinimum !== undefined && value <= limit.exclusiveMinimum)
      || value > limit.maximum;
    return bad ? { error: `Must be ${describeRange(limit)}.` } : { value };
  }

  function stopStrings() {
    return $("stop-strings").value.split("\n").filter((line) => line !== "");
  }

  /** The sampling settings as request fields, and an error message per invalid field. */
  function readSettings() {
    const values = {};
    const errors = {};
    for (const [key, id] of FIELDS) {
      const input = $(id);
      // A number input holding text reports "" with badInput set: that is an error too.
      const raw = input.validity && input.validity.badInput ? "NaN" : input.value.trim();
      const checked = checkNumber(raw, LIMITS[key]);
      if (checked.error) errors[id] = checked.error;
      else if (checked.value !== undefined) values[key] = checked.value;
    }
    const stops = stopStrings();
    if (stops.length > LIMITS.stop.maxItems) errors["stop-strings"] = `At most ${LIMITS.stop.maxItems} stop strings.`;
    else if (stops.length) values.stop = stops;
    const system = $("system").value.trim();
    return { values, errors, system };
  }

  function showSettingsErrors(errors) {
    for (const id of ["max-tokens", "temperature", "top-p", "seed", "stop-strings"]) {
      const input = $(id);
      const message = $(`${id}-error`);
      if (errors[id]) {
        input.setAttribute("aria-invalid", "true");
        message.textContent = errors[id];
        message.hidden = false;
      } else {
        input.removeAttribute("aria-invalid");
        message.hidden = true;
      }
    }
  }

  function saveSettings() {
    const saved = {};
    for (const id of ["system", "max-tokens", "temperature", "top-p", "seed", "stop-strings"]) saved[id] = $(id).value;
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(saved));
    } catch (_) {
      // storage full or disabled: settings then last as long as the page
    }
  }

  function restoreSettings() {
    let saved = null;
    try {
      saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "null");
    } catch (_) {
      saved = null;
    }
    if (!saved || typeof saved !== "object") return;
    for (const [id, value] of Object.entries(saved)) {
      const input = $(id);
      if (input && typeof value === "string") input.value = value;
    }
  }

  // -- conversations, kept in this browser -------------------------------------------------

  const state = {
    store: { current: null, conversations: [] },
    current: null, // the reply in flight
    lastStop: null,
    modelsTimer: null,
    contextLength: {},
    mine: [],
    leaving: false, // the page is being left (a reload, a closed tab)
  };

  const newId = () => `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;

  function loadStore() {
    try {
      const data = JSON.parse(localStorage.getItem(STORE_KEY) || "null");
      if (data && Array.isArray(data.conversations)) state.store = data;
    } catch (_) {
      // a damaged entry is replaced by a fresh one
    }
    try {
      const mine = JSON.parse(localStorage.getItem(MINE_KEY) || "[]");
      if (Array.isArray(mine)) state.mine = mine.filter((id) => typeof id === "string");
    } catch (_) {
      state.mine = [];
    }
    if (!conversation()) newConversation();
  }

  function saveStore() {
    try {
      localStorage.setItem(STORE_KEY, JSON.stringify(state.store));
      localStorage.setItem(MINE_KEY, JSON.stringify(state.mine.slice(-200)));
    } catch (err) {
      showError(`Could not save the conversation in this browser: ${err.message}`);
    }
  }

  function conversation() {
    return state.store.conversations.find((c) => c.id === state.store.current) || null;
  }

  function newConversation() {
    const conv = { id: newId(), title: "", updated: Date.now(), turns: [] };
    state.store.conversations.unshift(conv);
    state.store.current = conv.id;
    saveStore();
    return conv;
  }

  function titleOf(conv) {
    if (conv.title) return conv.title;
    const first = conv.turns.find((t) => t.role === "user");
    return first ? first.content.slice(0, 48) : "New chat";
  }

  function renderConversationList() {
    const list = $("conversation-list");
    list.replaceChildren(...state.store.conversations.map((conv) => {
      const current = conv.id === state.store.current;
      const open = el("button", { type: "button", className: "open", testid: "conversation-open", text: titleOf(conv) });
      if (current) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => switchConversation(conv.id));
      const rename = el("button", { type: "button", className: "small", testid: "conversation-rename", "aria-label": `Rename ${titleOf(conv)}`, text: "✎" });
      rename.addEventListener("click", () => renameConversation(conv.id));
      const remove = el("button", { type: "button", className: "small", testid: "conversation-delete", "aria-label": `Delete ${titleOf(conv)}`, text: "×" });
      remove.addEventListener("click", () => deleteConversation(conv.id));
      const item = el("li", { className: current ? "current" : "", testid: "conversation" }, [open, rename, remove]);
      item.dataset.conversationId = conv.id;
      return item;
    }));
  }

  function switchConversation(id) {
    if (state.current) return;
    state.store.current = id;
    saveStore();
    renderAll();
    $("prompt").focus();
  }

  function renameConversation(id) {
    const conv = state.store.conversations.find((c) => c.id === id);
    if (!conv) return;
    const title = window.prompt("Name this conversation", titleOf(conv));
    if (title === null) return;
    conv.title = title.trim();
    saveStore();
    renderConversationList();
  }

  function deleteConversation(id) {
    if (state.current && state.store.current === id) return;
    const conv = state.store.conversations.find((c) => c.id === id);
    if (!conv || !window.confirm(`Delete "${titleOf(conv)}"?`)) return;
    state.store.conversations = state.store.conversations.filter((c) => c.id !== id);
    if (state.store.current === id) {
      state.store.current = state.store.conversations.length ? state.store.conversations[0].id : null;
    }
    if (!conversation()) newConversation();
    saveStore();
    renderAll();
  }

  /** The messages the server sees: every exchange whose reply has text, a stopped or
   *  interrupted one too (what the user saw stays in the conversation), unless the user
   *  dropped it. A reply that failed with no text leaves its question out as well. */
  function history(turns) {
    const out = [];
    for (let i = 0; i + 1 < turns.length; i += 1) {
      const user = turns[i];
      const reply = turns[i + 1];
      if (user.role !== "user" || reply.role !== "assistant") continue;
      if (inContext(reply)) {
        out.push({ role: "user", content: user.content }, { role: "assistant", content: reply.content });
      }
      i += 1;
    }
    return out;
  }

  // -- partial replies: stopped or interrupted, kept unless dropped --------------------------

  /** A reply that did not end on its own: stopped, cut by an error or by a reload. */
  function isPartial(turn) {
    return turn.endReason !== "stop" && turn.endReason !== "length";
  }

  function inContext(reply) {
    if (!reply.content) return false;
    if (!isPartial(reply)) return !reply.error;
    return !reply.dropped;
  }

  /** The mark on a partial reply: kept in the conversation (Drop it), or dropped (Keep it). */
  function partialMark(turn) {
    const kept = !turn.dropped;
    const why = turn.endReason ? "Stopped. " : ""; // an interrupted reply says so above
    const text = kept
      ? `${why}This partial reply stays in the conversation the model sees.`
      : `${why}Dropped: the model no longer sees this partial reply.`;
    const toggle = action(kept ? "Drop it" : "Keep it", kept ? "drop-partial" : "keep-partial", () => {
      if (state.current) return; // not while a reply streams: the log is not redrawn then
      turn.dropped = kept;
      saveStore();
      renderLog();
    }, true);
    const mark = el("div", { className: `partial${kept ? "" : " dropped"}`, testid: "partial" }, [
      el("span", { text }), " ", toggle,
    ]);
    mark.dataset.kept = String(kept);
    return mark;
  }

  function markPartial(node, turn) {
    node.querySelector(".partial")?.remove();
    if (!turn.content || !isPartial(turn)) return;
    node.classList.toggle("dropped", Boolean(turn.dropped));
    // Right under the text (and the word that it was interrupted), above the trace.
    const anchor = node.querySelector('[data-testid="interrupted"]') || node.querySelector(".content");
    anchor.after(partialMark(turn));
  }

  // -- models and the loading state --------------------------------------------------------

  function usable(entry) {
    const tb = entry.tokenbelt || {};
    if (tb.loaded) return true;
    // A path or alias that loaded under another name is listed again with a finished
    // load; the loaded name is the one to pick.
    return Boolean(tb.load && tb.load.state !== "ready" && tb.load.state !== "available");
  }

  function scheduleModels(ms) {
    clearTimeout(state.modelsTimer);
    state.modelsTimer = setTimeout(refreshModels, ms);
  }

  function showLoading(loading) {
    const parts = [];
    let received = 0;
    let total = 0;
    for (const e of loading) {
      const load = e.tokenbelt.load;
      const dl = load.download;
      let bytes = "";
      if (dl && dl.total_bytes) {
        bytes = ` (downloaded ${(dl.received_bytes / 1e6).toFixed(1)} of ${(dl.total_bytes / 1e6).toFixed(1)} MB)`;
        received += dl.received_bytes;
        total += dl.total_bytes;
      }
      parts.push(`${e.id}: ${load.elapsed_s.toFixed(1)} s${bytes}`);
    }
    $("load-text").textContent = `Loading model ${parts.join(", ")}`;
    const bar = $("load-progress");
    if (total > 0) {
      bar.max = total;
      bar.value = received;
    } else {
      bar.removeAttribute("value"); // indeterminate: loading, nothing to count
    }
  }

  async function refreshModels() {
    let data;
    try {
      const listing = await getJson("v1/models");
      // A failed load is listed apart from the served models; the page still shows it.
      data = (listing.data || []).concat((listing.tokenbelt || {}).not_served || []);
    } catch (err) {
      showError(`Could not list the models: ${err.message}`);
      scheduleModels(2000);
      return;
    }
    const entries = data.filter(usable);
    for (const entry of data) {
      const tb = entry.tokenbelt || {};
      if (tb.context_length) state.contextLength[entry.id] = tb.context_length;
    }
    const picker = $("model");
    const previous = picker.value;
    picker.replaceChildren(
      ...entries.map((entry) => {
        const tb = entry.tokenbelt || {};
        const label = tb.loaded ? entry.id : `${entry.id} (${tb.load.state})`;
        const option = el("option", { value: entry.id, text: label });
        option.disabled = !tb.loaded;
        return option;
      }),
    );
    const loaded = entries.filter((e) => e.tokenbelt && e.tokenbelt.loaded).map((e) => e.id);
    if (loaded.includes(previous)) picker.value = previous;
    else if (loaded.length) picker.value = loaded[0];

    const banner = $("load-status");
    const loading = entries.filter((e) => !e.tokenbelt.loaded && e.tokenbelt.load.state === "loading");
    const failed = entries.filter((e) => !e.tokenbelt.loaded && e.tokenbelt.load.state === "failed");
    banner.classList.remove("error");
    $("load-progress").hidden = true;
    if (loading.length) {
      showLoading(loading);
      $("load-progress").hidden = false;
      banner.dataset.state = "loading";
      banner.hidden = false;
      scheduleModels(500);
    } else if (failed.length) {
      $("load-text").textContent = failed.map((e) => `${e.id} failed to load: ${e.tokenbelt.load.error}`).join("; ");
      banner.classList.add("error");
      banner.dataset.state = "failed";
      banner.hidden = false;
    } else if (!loaded.length) {
      $("load-text").textContent = "No model is loaded on this server.";
      banner.dataset.state = "none";
      banner.hidden = false;
      scheduleModels(2000);
    } else {
      banner.hidden = true;
      banner.dataset.state = "ready";
    }
    updateButtons();
    updateContext();
  }

  function updateButtons() {
    const busy = state.current !== null;
    const picker = $("model");
    const ready = Boolean(picker.value) && !(picker.selectedOptions[0] || {}).disabled;
    $("send").disabled = busy || !ready;
    $("stop").disabled = !busy || state.current.stopRequested;
    for (const button of document.querySelectorAll(".turn-actions button.needs-idle, .partial button.needs-idle")) button.disabled = busy;
    document.body.dataset.busy = busy ? "true" : "false";
  }

  // -- the context indicator ---------------------------------------------------------------

  function updateContext() {
    const conv = conversation();
    const last = conv ? [...conv.turns].reverse().find((t) => t.role === "assistant" && t.trace) : null;
    const text = $("context-text");
    const meter = $("context-meter");
    const box = $("context");
    if (!last) {
      text.textContent = "–";
      meter.value = 0;
      box.dataset.used = "0";
      return;
    }
    const prompt = last.trace.prompt_tokens || 0;
    const reply = last.trace.completion_tokens || 0;
    const size = state.contextLength[last.model] || state.contextLength[$("model").value] || 0;
    meter.max = size || prompt + reply || 1;
    meter.value = prompt + reply;
    text.textContent = size ? `${prompt} + ${reply} of ${size} tokens` : `${prompt} + ${reply} tokens`;
    box.dataset.used = String(prompt + reply);
    box.dataset.size = String(size);
  }

  // -- the conversation on screen ----------------------------------------------------------

  function scrollToEnd() {
    const log = $("log");
    log.scrollTop = log.scrollHeight;
  }

  function userNode(turn) {
    const node = el("li", { className: "turn user", testid: "user-turn" }, [
      el("div", { className: "content", text: turn.content }),
    ]);
    return node;
  }

  function assistantNode(turn) {
    const node = el("li", { className: "turn assistant", testid: "reply" }, [
      el("div", { className: "meta", text: turn.model || "" }),
      el("div", { className: "content md", testid: "reply-text" }),
    ]);
    node.querySelector(".content").innerHTML = renderMarkdown(turn.content || "");
    if (turn.thinking) thinkingNode(node).textContent = turn.thinking;
    if (turn.requestId) node.dataset.requestId = turn.requestId;
    if (turn.error) showReplyError(node, turn.error);
    else if (!turn.trace) {
      // Stored while it streamed, and the page went away before the end.
      node.append(el("p", { className: "length-hint", testid: "interrupted", text: "Interrupted: the page was closed or reloaded while this reply streamed." }));
      node.dataset.interrupted = "true";
    }
    if (turn.trace) {
      node.append(traceDetails(turn.trace));
      node.dataset.endReason = turn.trace.end_reason || "";
      const hint = lengthHint(turn);
      if (hint) node.append(hint);
    }
    markPartial(node, turn);
    node.dataset.state = turn.error ? "error" : "done";
    return node;
  }

  function renderLog() {
    const conv = conversation();
    const log = $("log");
    const nodes = conv.turns.map((turn) => (turn.role === "user" ? userNode(turn) : assistantNode(turn)));
    if (!nodes.length) nodes.push($("hint-template").content.firstElementChild.cloneNode(true));
    log.replaceChildren(...nodes);
    renderActions();
    scrollToEnd();
  }

  function renderAll() {
    renderConversationList();
    renderLog();
    updateContext();
    updateButtons();
    refreshRecent();
  }

  function action(label, testid, onClick, needsIdle) {
    const button = el("button", { type: "button", className: `small${needsIdle ? " needs-idle" : ""}`, testid, text: label });
    button.addEventListener("click", onClick);
    return button;
  }

  /** Copy on every reply; Edit on the last question and Regenerate on the last reply. */
  function renderActions() {
    const conv = conversation();
    const nodes = [...$("log").querySelectorAll(".turn")];
    for (const bar of $("log").querySelectorAll(".turn-actions")) bar.remove();
    nodes.forEach((node, i) => {
      const turn = conv.turns[i];
      if (!turn) return;
      const last = i === conv.turns.length - 1;
      const buttons = [];
      if (turn.role === "assistant") {
        buttons.push(action("Copy", "copy", (event) => copyReply(turn, event.currentTarget), false));
        if (last) buttons.push(action("Regenerate", "regenerate", regenerate, true));
      } else if (i >= conv.turns.length - 2) {
        buttons.push(action("Edit", "edit", () => editLast(node, turn), true));
      }
      if (buttons.length) node.append(el("div", { className: "turn-actions" }, buttons));
    });
    updateButtons();
  }

  async function copyReply(turn, button) {
    try {
      await navigator.clipboard.writeText(turn.content);
      button.textContent = "Copied";
      button.dataset.copied = "true";
    } catch (err) {
      button.textContent = "Copy failed";
      showError(`Could not copy: ${err.message}`);
    }
  }

  function regenerate() {
    if (state.current) return;
    const conv = conversation();
    const last = conv.turns[conv.turns.length - 1];
    const question = conv.turns[conv.turns.length - 2];
    if (!last || last.role !== "assistant" || !question || question.role !== "user") return;
    conv.turns.splice(conv.turns.length - 2, 2);
    renderLog();
    send(question.content);
  }

  function editLast(node, turn) {
    if (state.current) return;
    const box = el("textarea", { className: "edit-box", testid: "edit-box", rows: "3", "aria-label": "Edit your message" });
    box.value = turn.content;
    const save = action("Send", "edit-send", () => {
      const text = box.value;
      if (!text.trim()) return;
      const conv = conversation();
      const at = conv.turns.indexOf(turn);
      if (at >= 0) conv.turns.splice(at);
      renderLog();
      send(text);
    }, true);
    const cancel = action("Cancel", "edit-cancel", () => renderLog(), false);
    node.replaceChildren(box, el("div", { className: "turn-actions" }, [save, cancel]));
    box.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        save.click();
      } else if (event.key === "Escape") {
        event.preventDefault();
        event.stopPropagation();
        renderLog();
      }
    });
    box.focus();
  }

  function addLive(node) {
    node.append(el("div", { className: "live", testid: "live" }, [
      "first token ", el("span", { testid: "live-ttft", text: "…" }),
      " · ", el("span", { testid: "live-rate", text: "–" }), " tok/s",
      " · ", el("span", { testid: "live-buffer", text: "–", title: "tokens made ahead of this page / the most allowed" }), " ahead",
      " · ", el("span", { testid: "live-tokens", text: "0" }), " tokens",
    ]));
  }

  function showReplyError(node, message) {
    node.append(el("div", { className: "reply-error", role: "alert", testid: "reply-error", text: message }));
    node.dataset.state = "error";
  }

  function lengthHint(turn) {
    if (!turn.trace || turn.trace.end_reason !== "length") return null;
    if (turn.trace.reasoning && turn.trace.reasoning.phase === "reasoning") {
      const text = "The answer never started: the reply stopped while the model was still thinking. Raise Max tokens in Settings.";
      return el("p", { className: "length-hint", testid: "length-hint", text });
    }
    const limit = turn.maxTokens || DEFAULT_MAX_TOKENS;
    const text = (turn.trace.completion_tokens || 0) < limit
      ? "The reply stopped because the model's context is full: start a new chat or edit an earlier message."
      : `The reply stopped at the ${limit}-token limit: raise Max tokens in Settings for longer replies.`;
    return el("p", { className: "length-hint", testid: "length-hint", text });
  }

  function render(current) {
    current.renderQueued = false;
    current.node.querySelector(".content").innerHTML = renderMarkdown(current.text);
    keepShown(current);
    scrollToEnd();
  }

  /** Store the text shown so far (at most every KEEP_MS while it streams): a reload or a
   *  closed tab keeps what the user saw, marked interrupted. */
  const KEEP_MS = 250;
  function keepShown(current, now = false) {
    current.turn.content = current.text;
    if (!now && performance.now() - (current.keptAt || 0) < KEEP_MS) return;
    current.keptAt = performance.now();
    saveStore();
  }

  function queueRender(current) {
    if (current.renderQueued) return;
    current.renderQueued = true;
    requestAnimationFrame(() => render(current));
  }

  function updateLive(current) {
    const node = current.node;
    const tb = current.live;
    if (current.firstAt !== null) {
      node.querySelector('[data-testid="live-ttft"]').textContent = fmtMs(current.firstAt - current.sentAt);
    }
    if (tb) {
      const tokens = tb.completion_tokens || 0;
      node.querySelector('[data-testid="live-buffer"]').textContent = `${tb.buffered}/${tb.capacity}`;
      node.querySelector('[data-testid="live-tokens"]').textContent = String(tokens);
      const seconds = (performance.now() - current.firstAt) / 1000;
      if (tokens > 1 && seconds > 0) {
        node.querySelector('[data-testid="live-rate"]').textContent = ((tokens - 1) / seconds).toFixed(1);
      }
    }
  }

  /** A thinking model's reasoning: collapsed above the reply, opened by a click. */
  function thinkingNode(node) {
    let box = node.querySelector(".thinking");
    if (!box) {
      box = el("details", { className: "thinking", testid: "thinking" }, [
        el("summary", { text: "Thinking" }),
        el("div", { className: "thinking-text", testid: "thinking-text" }),
      ]);
      node.querySelector(".content").before(box);
    }
    return box.querySelector(".thinking-text");
  }

  /** A long prompt's prefill: a bar that fills as the server reads it, gone at the first token. */
  function showPrompt(current, progress) {
    let bar = current.node.querySelector("[data-testid=prompt-progress]");
    if (!bar) {
      bar = el("div", { className: "prompt-progress", testid: "prompt-progress" }, [
        el("progress", { max: 1, value: 0 }),
        el("span", { testid: "prompt-progress-text" }),
      ]);
      current.node.querySelector(".content").before(bar);
    }
    const share = progress.total ? progress.processed / progress.total : 0;
    bar.querySelector("progress").value = share;
    bar.querySelector("span").textContent = `reading the prompt: ${progress.processed} of ${progress.total} tokens` +
      (progress.cache ? ` (${progress.cache} from the cache)` : "");
  }

  function onChunk(chunk, current) {
    const tb = chunk.tokenbelt || {};
    if (chunk.prompt_progress) {
      showPrompt(current, chunk.prompt_progress);
      return;
    }
    current.node.querySelector("[data-testid=prompt-progress]")?.remove();
    const choice = (chunk.choices || [])[0];
    const thought = choice && choice.delta && choice.delta.reasoning_content;
    if (thought) {
      if (current.firstAt === null) current.firstAt = performance.now();
      current.node.dataset.state = "streaming";
      current.thinking = (current.thinking || "") + thought;
      thinkingNode(current.node).textContent = current.thinking;
    }
    const piece = choice && choice.delta && choice.delta.content;
    if (piece) {
      if (current.firstAt === null) current.firstAt = performance.now();
      current.node.dataset.state = "streaming";
      current.text += piece;
      queueRender(current);
    }
    if (tb.trace) {
      current.trace = tb.trace;
    } else if (tb.capacity !== undefined) {
      current.live = tb;
      updateLive(current);
    }
    if (chunk.error) current.error = chunk.error.message;
  }

  async function readEvents(response, current) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onChunk(JSON.parse(data), current);
        }
      }
    }
  }

  function composerSend() {
    const prompt = $("prompt");
    const text = prompt.value;
    if (!text.trim() || state.current) return;
    if (send(text)) prompt.value = "";
  }

  /** Send ``text`` as the next question; false when the settings are invalid. */
  function send(text) {
    if (state.current) return false;
    const settings = readSettings();
    showSettingsErrors(settings.errors);
    const invalid = Object.keys(settings.errors);
    if (invalid.length) {
      $("settings").open = true;
      $(invalid[0]).focus();
      return false;
    }
    hideError();
    const conv = conversation();
    const model = $("model").value;
    const messages = [];
    if (settings.system) messages.push({ role: "system", content: settings.system });
    messages.push(...history(conv.turns), { role: "user", content: text });
    // return_progress: while a long prompt is read, chunks say how far (a progress bar)
    const body = { messages, stream: true, stream_options: { include_usage: true }, return_progress: true, ...settings.values };
    if (body.max_tokens === undefined) body.max_tokens = DEFAULT_MAX_TOKENS;
    if (model) body.model = model;

    const question = { role: "user", content: text };
    const turn = { role: "assistant", content: "", model, maxTokens: body.max_tokens };
    conv.turns.push(question, turn);
    conv.updated = Date.now();
    $("hint")?.remove();
    $("log").querySelectorAll(".turn-actions").forEach((bar) => bar.remove());
    $("log").append(userNode(question));
    const node = el("li", { className: "turn assistant", testid: "reply" }, [
      el("div", { className: "meta", text: model || "" }),
      el("div", { className: "content md", testid: "reply-text" }),
    ]);
    addLive(node);
    node.dataset.state = "waiting";
    $("log").append(node);
    scrollToEnd();
    saveStore();
    renderConversationList();
    const current = {
      id: null,
      turn,
      node,
      controller: new AbortController(),
      stopRequested: false,
      stopInfo: null,
      sentAt: performance.now(),
      firstAt: null,
      text: "",
      live: null,
      trace: null,
      error: null,
      renderQueued: false,
    };
    state.current = current;
    updateButtons();
    stream(current, body);
    return true;
  }

  async function stream(current, body) {
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: apiHeaders(true),
        body: JSON.stringify(body),
        signal: current.controller.signal,
      });
      current.id = response.headers.get("x-request-id");
      if (current.id) {
        current.node.dataset.requestId = current.id;
        state.mine.push(current.id);
      }
      if (!response.ok) {
        current.error = await errorText(response);
        return;
      }
      // Stop was pressed before the server answered: now there is an id to cancel.
      if (current.stopRequested) cancelThenAbort(current);
      await readEvents(response, current);
    } catch (err) {
      if (!(err.name === "AbortError" && current.stopRequested)) {
        current.error = `The request failed: ${err.message}`;
      }
    } finally {
      await finish(current);
    }
  }

  // -- stopping ----------------------------------------------------------------------------

  async function stop(event) {
    const current = state.current;
    if (!current || current.stopRequested) return;
    // When the user acted, by the event's own clock: what a test compares with the
    // server's release time.
    const at = event && event.timeStamp ? performance.timeOrigin + event.timeStamp : now();
    current.stopRequested = true;
    current.stopInfo = { requestId: current.id, clickedAt: at, cancelSentAt: null, cancelAnsweredAt: null, cancel: null };
    state.lastStop = current.stopInfo;
    current.node.classList.add("stopping");
    updateButtons();
    if (current.id) await cancelThenAbort(current);
  }

  async function cancelThenAbort(current) {
    const info = current.stopInfo;
    info.requestId = current.id;
    info.cancelSentAt = now();
    try {
      const response = await fetch(`v1/requests/${encodeURIComponent(current.id)}/cancel`, {
        method: "POST",
        headers: apiHeaders(false),
      });
      info.cancel = response.ok ? await response.json() : { error: await errorText(response) };
    } catch (err) {
      info.cancel = { error: err.message };
    }
    info.cancelAnsweredAt = now();
    // Only now stop listening: the server has recorded user_cancel, so the disconnect
    // that follows cannot become the end reason.
    current.controller.abort();
  }

  async function finalTrace(id, trace) {
    // After an abort the stream's last chunk never arrived: ask the server, and give the
    // engine a moment to release (the cancel call returns before the release).
    const deadline = performance.now() + 3000;
    let latest = trace;
    for (let delay = 20; ; delay = Math.min(delay * 2, 250)) {
      try {
        latest = await getJson(`v1/requests/${encodeURIComponent(id)}`);
      } catch (_) {
        return latest;
      }
      if (latest.timeline_ms && latest.timeline_ms.released !== null) return latest;
      if (performance.now() + delay > deadline) return latest;
      await sleep(delay);
    }
  }

  const MARKS = [
    ["enqueued", "enqueued"],
    ["admitted", "admitted"],
    ["first_token", "first token"],
    ["last_token", "last token"],
    ["cancel_requested", "stop asked"],
    ["released", "released"],
  ];

  function renderTimeline(trace) {
    const t = trace.timeline_ms || {};
    const present = MARKS.filter(([key]) => t[key] !== null && t[key] !== undefined);
    const end = Math.max(1, ...present.map(([key]) => t[key]));
    const bar = el("div", { className: "bar", "aria-hidden": "true" },
      present.map(([key]) => {
        const tick = el("span", { className: `tick tick-${key}`, title: `${key} ${fmtMs(t[key])}` });
        tick.style.left = `${(100 * t[key]) / end}%`;
        return tick;
      }));
    const marks = el("ol", { className: "marks" }, present.map(([key, label]) => {
      const item = el("li", { className: `mark mark-${key}` }, [`${label} `, el("b", { text: fmtMs(t[key]) })]);
      item.dataset.mark = key;
      item.dataset.ms = String(t[key]);
      return item;
    }));
    const reason = el("span", { className: `reason reason-${trace.end_reason}`, testid: "end-reason", text: trace.end_reason || "unknown" });
    const facts = [reason];
    if (trace.time_to_first_token_ms !== null) facts.push(` first token ${fmtMs(trace.time_to_first_token_ms)}`);
    if (trace.decode_tok_s !== null) facts.push(` · ${trace.decode_tok_s.toFixed(1)} tok/s`);
    facts.push(` · ${trace.completion_tokens} tokens`);
    if (trace.cancel_to_release_ms !== null) {
      facts.push(" · stop→release ", el("b", { testid: "cancel-to-release", text: fmtMs(trace.cancel_to_release_ms) }));
    }
    return el("div", { className: "timeline", testid: "timeline" }, [
      el("div", { className: "facts", testid: "figures" }, facts),
      bar,
      marks,
    ]);
  }

  /** The trace, one click away: a one-line summary, the timeline inside. */
  function traceDetails(trace) {
    const parts = [trace.end_reason || "unknown", `${trace.completion_tokens} tokens`];
    if (trace.decode_tok_s !== null && trace.decode_tok_s !== undefined) parts.push(`${trace.decode_tok_s.toFixed(1)} tok/s`);
    const box = el("details", { className: "trace", testid: "trace" }, [
      el("summary", { text: `Trace · ${parts.join(" · ")}` }),
      renderTimeline(trace),
    ]);
    return box;
  }

  async function finish(current) {
    if (state.leaving) {
      keepShown(current, true);
      return;
    }
    render(current);
    const node = current.node;
    const turn = current.turn;
    let trace = current.trace;
    if (current.id && !current.error && (!trace || trace.timeline_ms.released === null)) {
      trace = await finalTrace(current.id, trace);
    }
    // One set of figures per reply: the live line gives way to the server's own.
    node.querySelector(".live")?.remove();
    turn.content = current.text;
    if (current.thinking) turn.thinking = current.thinking;
    turn.requestId = current.id;
    if (current.error) {
      turn.error = current.error;
      showReplyError(node, current.error);
    }
    if (trace && trace.end_reason) {
      turn.trace = trace;
      turn.endReason = trace.end_reason;
      if (!current.error || current.text) {
        node.append(traceDetails(trace));
        const hint = lengthHint(turn);
        if (hint) node.append(hint);
      }
      node.dataset.endReason = trace.end_reason;
    }
    markPartial(node, turn);
    node.classList.remove("stopping");
    if (!current.error) node.dataset.state = "done";
    conversation().updated = Date.now();
    saveStore();
    state.current = null;
    renderActions();
    updateContext();
    scrollToEnd();
    refreshRecent();
    $("prompt").focus();
  }

  // -- requests: this page's by default, every client's on a toggle -------------------------

  async function refreshRecent() {
    refreshCompletions();
    const list = $("recent");
    const all = $("all-requests").checked;
    let data;
    try {
      data = (await getJson(`v1/requests?limit=${all ? 50 : 200}`)).data || [];
    } catch (err) {
      list.replaceChildren(el("li", { className: "empty", text: err.message }));
      return;
    }
    if (!all) {
      const mine = new Set(state.mine);
      data = data.filter((trace) => mine.has(trace.request_id)).slice(0, 50);
    }
    if (!data.length) {
      list.replaceChildren(el("li", { className: "empty", testid: "recent-empty", text: all ? "No requests yet." : "No requests from this page yet." }));
    } else {
      list.replaceChildren(...data.map((trace) => {
        const reason = trace.end_reason || "running";
        const peers = trace.batched_with || [];
        const parts = [
          el("span", { className: `reason reason-${reason}`, text: reason }),
          el("span", { className: "id", title: trace.request_id, text: trace.request_id }),
          el("span", { className: "figures", text: `first token ${fmtMs(trace.time_to_first_token_ms)} · ${trace.completion_tokens} tokens · stop→release ${fmtMs(trace.cancel_to_release_ms)}` }),
        ];
        if (peers.length) {
          // The requests that shared a batched decode step with this one.
          parts.push(el("span", { className: "peers", testid: "batched-with", title: peers.join("\n"), text: `ran with ${peers.length} other${peers.length > 1 ? "s" : ""}` }));
        }
        const item = el("li", { className: "request" }, parts);
        item.dataset.requestId = trace.request_id;
        item.dataset.endReason = reason;
        return item;
      }));
    }
    list.dataset.refreshedAt = String(now());
  }

  // -- code completions: what editors' keystrokes cost each model (from /health) -----------

  async function refreshCompletions() {
    let statuses;
    try {
      // /health answers 503 while a model loads; its body still says where each one stands.
      const response = await fetch("health", { headers: apiHeaders(false), cache: "no-store" });
      statuses = Object.values((await response.json()).model_status || {});
    } catch (_) {
      return; // the request list says what went wrong
    }
    const served = statuses.filter((s) => s.completions && (s.completions.completions || s.completions.superseded));
    $("completions").hidden = !served.length;
    $("completions-list").replaceChildren(...served.map((s) => {
      const c = s.completions;
      const item = el("li", {}, [
        el("span", { className: "id", text: s.name }),
        el("span", { className: "figures", testid: "completion-counts", text: `${c.completions} served · ${c.superseded} superseded · ${c.stale_tokens} stale tokens` }),
        el("span", { className: "figures", testid: "completion-first-token", text: `keystroke to first token p50 ${fmtMs(c.first_token_p50_ms)} · p95 ${fmtMs(c.first_token_p95_ms)}` }),
      ]);
      item.dataset.model = s.name;
      return item;
    }));
  }

  // -- wiring ------------------------------------------------------------------------------

  function start() {
    restoreSettings();
    loadStore();
    if (window.matchMedia("(max-width: 720px)").matches) {
      // A phone: the chat first, the side panels folded away.
      $("conversations-panel").open = false;
      $("recent-panel").open = false;
    }
    $("settings-form").addEventListener("submit", (event) => event.preventDefault());
    $("settings-form").addEventListener("input", () => {
      saveSettings();
      showSettingsErrors(readSettings().errors);
    });
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      composerSend();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        composerSend();
      }
    });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && state.current) {
        event.preventDefault();
        stop(event);
      }
    });
    $("stop").addEventListener("click", (event) => stop(event));
    $("model").addEventListener("change", () => {
      updateButtons();
      updateContext();
    });
    $("refresh").addEventListener("click", (event) => {
      event.preventDefault();
      refreshRecent();
    });
    $("all-requests").addEventListener("change", refreshRecent);
    $("new-chat").addEventListener("click", () => {
      if (state.current) return;
      const conv = conversation();
      if (!conv || conv.turns.length) newConversation();
      renderAll();
      $("prompt").focus();
    });
    $("api-key").addEventListener("change", () => {
      refreshModels();
      refreshRecent();
    });
    window.addEventListener("storage", (event) => {
      // Another tab changed the conversations: show them, unless a reply is streaming here.
      if (event.key === STORE_KEY && !state.current) {
        loadStore();
        renderAll();
      }
    });
    window.addEventListener("pagehide", () => {
      // Leaving mid-reply: what was shown is stored now, and the fetch the browser is about
      // to drop is no error of the reply's (the next load marks it interrupted).
      state.leaving = true;
      if (state.current) keepShown(state.current, true);
    });
    window.addEventListener("pageshow", (event) => {
      if (event.persisted) state.leaving = false; // back from the page cache: still here
    });
    window.addEventListener("unhandledrejection", (event) => {
      showError(`Something went wrong: ${event.reason && event.reason.message ? event.reason.message : event.reason}`);
    });
    renderAll();
    refreshModels();
  }

  // For tests and curious users: the renderer, the form's limits, the timing of the last Stop.
  window.tokenbelt = {
    renderMarkdown,
    escapeHtml,
    limits: LIMITS,
    defaults: { max_tokens: DEFAULT_MAX_TOKENS },
    get lastStop() {
      return state.lastStop;
    },
    get busy() {
      return state.current !== null;
    },
  };

  start();
})();
