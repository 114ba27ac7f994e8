// tokenbelt web chat: the microphone. Records with the browser's MediaRecorder (WebM
// Opus), sends the recording to /v1/audio/transcriptions with stream=true, and writes
// the text into the message box as each segment is decoded. While it transcribes, the
// button is a Stop: it asks the server to cancel (user_cancel) and then stops
// listening, as the chat's Stop does. Shown only when the server serves a speech model.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const button = $("mic");
  const status = $("mic-status");
  let state = "idle";
  let recorder = null;
  let controller = null;
  let requestId = null;

  function headers() {
    const field = $("api-key");
    const key = field ? field.value.trim() : "";
    return key ? { authorization: `Bearer ${key}` } : {};
  }

  function say(text) {
    status.textContent = text;
    status.hidden = !text;
  }

  function set(next, label) {
    state = next;
    button.textContent = label;
    button.dataset.state = next;
    button.setAttribute("aria-pressed", String(next === "recording"));
  }

  async function speechModel() {
    try {
      const response = await fetch("v1/models", { headers: headers() });
      if (!response.ok) return null;
      const data = (await response.json()).data || [];
      const found = data.find((m) => m.tokenbelt && m.tokenbelt.info && m.tokenbelt.info.kind === "speech");
      return found ? found.id : null;
    } catch {
      return null;
    }
  }

  async function record() {
    let media;
    try {
      media = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (error) {
      say(`Microphone: ${error.message}`);
      return;
    }
    const chunks = [];
    recorder = new MediaRecorder(media);
    recorder.ondataavailable = (event) => {
      if (event.data.size) chunks.push(event.data);
    };
    recorder.onstop = () => {
      media.getTracks().forEach((track) => track.stop());
      transcribe(new Blob(chunks, { type: recorder.mimeType || "audio/webm" }));
    };
    recorder.start();
    say("Recording… press Done when you have finished.");
    set("recording", "Done");
  }

  function write(prompt, before, text) {
    const gap = before && !/\s$/.test(before) ? " " : "";
    prompt.value = before + gap + text;
    prompt.dispatchEvent(new Event("input", { bubbles: true }));
  }

  async function transcribe(blob) {
    const model = await speechModel();
    controller = new AbortController();
    requestId = `mic-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
    // Until the answer's head arrives the request may not be queued yet: Stop aborts.
    set("sending", "Stop");
    say("Transcribing…");
    const form = new FormData();
    form.append("file", blob, "speech.webm");
    form.append("model", model || "");
    form.append("stream", "true");
    const prompt = $("prompt");
    const before = prompt.value;
    let text = "";
    try {
      const response = await fetch("v1/audio/transcriptions", {
        method: "POST",
        body: form,
        headers: { ...headers(), "x-request-id": requestId },
        signal: controller.signal,
      });
      set("transcribing", "Stop");
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        say(`Transcription: ${(body.error && body.error.message) || response.status}`);
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        const lines = buffer.split("\n");
        buffer = lines.pop();
        for (const line of lines) {
          if (!line.startsWith("data: {")) continue;
          const event = JSON.parse(line.slice(6));
          if (event.type === "transcript.text.delta") {
            text += event.delta;
            write(prompt, before, text);
          } else if (event.type === "transcript.text.done") {
            write(prompt, before, event.text);
            say("");
          } else if (event.type === "error") {
            say(`Transcription ended: ${event.error.code}`);
          }
        }
      }
    } catch (error) {
      say(error.name === "AbortError" ? "Transcription stopped." : `Transcription: ${error.message}`);
    } finally {
      controller = null;
      set("idle", "Mic");
      prompt.focus();
    }
  }

  async function stop() {
    // Cancel first (user_cancel), then stop listening: aborting first would be a disconnect.
    try {
      await fetch(`v1/requests/${encodeURIComponent(requestId)}/cancel`, {
        method: "POST",
        headers: headers(),
      });
    } catch {
      // the abort below stops it as a disconnect
    }
    if (controller) controller.abort();
  }

  button.addEventListener("click", () => {
    if (state === "idle") record();
    else if (state === "recording") recorder.stop();
    else if (state === "transcribing") stop();
    else if (state === "sending" && controller) controller.abort();
  });

  if (navigator.mediaDevices && window.MediaRecorder) {
    speechModel().then((model) => {
      button.hidden = !model;
    });
  }
})();
