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

  // -- models and the loading state --------------------------------------------------------

  const state = { history: [], current: null, lastStop: null, modelsTimer: null };

  function usable(entry) {
    const tb = entry.tokenbelt || {};
    if (tb.loaded) return true;
    // A path or alias that loaded under another name is listed again with a finished
    // load; the loaded name is the one to pick.
    return Boolean(tb.load && tb.load.state !== "ready");
  }

  function scheduleModels(ms) {
    clearTimeout(state.modelsTimer);
    state.modelsTimer = setTimeout(refreshModels, ms);
  }

  async function refreshModels() {
    let data;
    try {
      data = (await getJson("v1/models")).data || [];
    } catch (err) {
      showError(`Could not list the models: ${err.message}`);
      scheduleModels(2000);
      return;
    }
    const entries = data.filter(usable);
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
    if (loading.length) {
      const parts = loading.map((e) => {
        const load = e.tokenbelt.load;
        const dl = load.download;
        const bytes = dl && dl.total_bytes
          ? ` (downloaded ${(dl.received_bytes / 1e6).toFixed(1)} of ${(dl.total_bytes / 1e6).toFixed(1)} MB)`
          : "";
        return `${e.id}: ${load.elapsed_s.toFixed(1)} s${bytes}`;
      });
      banner.replaceChildren(el("span", { className: "spinner", "aria-hidden": "true" }),
        `Loading model ${parts.join(", ")}`);
      banner.dataset.state = "loading";
      banner.hidden = false;
      scheduleModels(500);
    } else if (failed.length) {
      banner.textContent = failed.map((e) => `${e.id} failed to load: ${e.tokenbelt.load.error}`).join("; ");
      banner.classList.add("error");
      banner.dataset.state = "failed";
      banner.hidden = false;
    } else if (!loaded.length) {
      banner.textContent = "No model is loaded on this server.";
      banner.dataset.state = "none";
      banner.hidden = false;
      scheduleModels(2000);
    } else {
      banner.hidden = true;
      banner.dataset.state = "ready";
    }
    updateButtons();
  }

  function updateButtons() {
    const busy = state.current !== null;
    const picker = $("model");
    const ready = Boolean(picker.value) && !(picker.selectedOptions[0] || {}).disabled;
    $("send").disabled = busy || !ready;
    $("stop").disabled = !busy || state.current.stopRequested;
    document.body.dataset.busy = busy ? "true" : "false";
  }

  // -- the conversation --------------------------------------------------------------------

  function scrollToEnd() {
    const log = $("log");
    log.lastElementChild?.scrollIntoView({ block: "end" });
  }

  function addUserTurn(text) {
    $("hint")?.remove();
    $("log").append(el("li", { className: "turn user", testid: "user-turn" }, [
      el("div", { className: "content", text }),
    ]));
  }

  function addReply(model) {
    const live = el("div", { className: "live", testid: "live" }, [
      "first token ", el("span", { testid: "live-ttft", text: "…" }),
      " · ", el("span", { testid: "live-rate", text: "–" }), " tok/s",
      " · belt ", el("span", { testid: "live-buffer", text: "–" }),
      " · ", el("span", { testid: "live-tokens", text: "0" }), " tokens",
    ]);
    const node = el("li", { className: "turn assistant", testid: "reply" }, [
      el("div", { className: "meta", text: model || "" }),
      el("div", { className: "content md", testid: "reply-text" }),
      live,
    ]);
    node.dataset.state = "waiting";
    $("log").append(node);
    scrollToEnd();
    return node;
  }

  function showReplyError(current, message) {
    current.node.append(el("div", { className: "reply-error", role: "alert", testid: "reply-error", text: message }));
    current.node.dataset.state = "error";
    current.failed = true;
  }

  function render(current) {
    current.renderQueued = false;
    current.node.querySelector(".content").innerHTML = renderMarkdown(current.text);
    scrollToEnd();
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

  function onChunk(chunk, current) {
    const tb = chunk.tokenbelt || {};
    const choice = (chunk.choices || [])[0];
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
    if (chunk.error) showReplyError(current, chunk.error.message);
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

  async function send() {
    if (state.current) return;
    const prompt = $("prompt");
    const text = prompt.value;
    if (!text.trim()) return;
    hideError();
    const model = $("model").value;
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    const user = { role: "user", content: text };
    messages.push(...state.history, user);
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (model) body.model = model;
    const maxTokens = $("max-tokens").value.trim();
    if (maxTokens !== "") body.max_tokens = Number(maxTokens);
    const temperature = $("temperature").value.trim();
    if (temperature !== "") body.temperature = Number(temperature);

    prompt.value = "";
    addUserTurn(text);
    const current = {
      id: null,
      user,
      node: addReply(model),
      controller: new AbortController(),
      stopRequested: false,
      stopInfo: null,
      sentAt: performance.now(),
      firstAt: null,
      text: "",
      live: null,
      trace: null,
      failed: false,
      renderQueued: false,
    };
    state.current = current;
    updateButtons();
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: apiHeaders(true),
        body: JSON.stringify(body),
        signal: current.controller.signal,
      });
      current.id = response.headers.get("x-request-id");
      if (current.id) current.node.dataset.requestId = current.id;
      if (!response.ok) {
        showReplyError(current, await errorText(response));
        return;
      }
      // Stop was pressed before the server answered: now there is an id to cancel.
      if (current.stopRequested) cancelThenAbort(current);
      await readEvents(response, current);
    } catch (err) {
      if (!(err.name === "AbortError" && current.stopRequested)) {
        showReplyError(current, `The request failed: ${err.message}`);
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
    const strip = el("div", { className: "timeline", testid: "timeline" }, [
      el("div", { className: "facts" }, facts),
      bar,
      marks,
    ]);
    return strip;
  }

  async function finish(current) {
    render(current);
    const node = current.node;
    let trace = current.trace;
    if (current.id && (!trace || trace.timeline_ms.released === null)) {
      trace = await finalTrace(current.id, trace);
    }
    if (trace) {
      node.append(renderTimeline(trace));
      node.dataset.endReason = trace.end_reason || "";
      if ((trace.end_reason === "stop" || trace.end_reason === "length") && !current.failed) {
        state.history.push(current.user, { role: "assistant", content: current.text });
      }
    }
    node.classList.remove("stopping");
    node.querySelector(".live").classList.add("done");
    if (!current.failed) node.dataset.state = "done";
    state.current = null;
    updateButtons();
    scrollToEnd();
    refreshRecent();
    $("prompt").focus();
  }

  // -- recent requests ---------------------------------------------------------------------

  async function refreshRecent() {
    const body = $("recent");
    let data;
    try {
      data = (await getJson("v1/requests?limit=20")).data || [];
    } catch (err) {
      body.replaceChildren(el("tr", {}, [el("td", { colspan: "5", text: err.message })]));
      return;
    }
    body.replaceChildren(...data.map((trace) => {
      const reason = trace.end_reason || "running";
      const row = el("tr", {}, [
        el("td", { className: "id", title: trace.request_id, text: trace.request_id }),
        el("td", {}, [el("span", { className: `reason reason-${reason}`, text: reason })]),
        el("td", { text: fmtMs(trace.time_to_first_token_ms) }),
        el("td", { text: String(trace.completion_tokens) }),
        el("td", { text: fmtMs(trace.cancel_to_release_ms) }),
      ]);
      row.dataset.requestId = trace.request_id;
      row.dataset.endReason = reason;
      return row;
    }));
    body.dataset.refreshedAt = String(now());
  }

  // -- wiring ------------------------------------------------------------------------------

  function start() {
    $("settings-form").addEventListener("submit", (event) => event.preventDefault());
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        send();
      }
    });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && state.current) {
        event.preventDefault();
        stop(event);
      }
    });
    $("stop").addEventListener("click", (event) => stop(event));
    $("model").addEventListener("change", updateButtons);
    $("refresh").addEventListener("click", (event) => {
      event.preventDefault();
      refreshRecent();
    });
    $("clear").addEventListener("click", () => {
      if (state.current) return;
      state.history = [];
      $("log").replaceChildren();
    });
    $("api-key").addEventListener("change", () => {
      refreshModels();
      refreshRecent();
    });
    window.addEventListener("unhandledrejection", (event) => {
      showError(`Something went wrong: ${event.reason && event.reason.message ? event.reason.message : event.reason}`);
    });
    updateButtons();
    refreshModels();
    refreshRecent();
  }

  // For tests and curious users: the renderer and the timing of the last Stop.
  window.tokenbelt = {
    renderMarkdown,
    escapeHtml,
    get lastStop() {
      return state.lastStop;
    },
    get busy() {
      return state.current !== null;
    },
  };

  start();
})();
