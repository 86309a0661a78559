// The chat playground: models from /v1/models, answers streamed from /v1/chat/completions,
// conversations kept in local storage. Model output is only ever put in the page as text
// nodes (markdown.js builds elements around them), never as HTML.
"use strict";

const STORE = "tokenmill.conversations";
let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = null;
let controller = null;

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function messageElement(role, text, stats, thinking, thought) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  renderMarkdown(text, content);
  const line = document.createElement("div");
  line.className = "stats";
  line.textContent = stats || "";
  box.append(who, content, line);
  if (thinking) setThinking(box, thinking, thought || "Thought");
  return box;
}

// A reasoning model's thinking: folded away above the answer, shown as plain text only (it is
// unfinished model output; markdown would guess at half-written structure).
function setThinking(box, text, summary) {
  let details = box.querySelector("details.thinking");
  if (!details) {
    details = document.createElement("details");
    details.className = "thinking";
    const title = document.createElement("summary");
    const body = document.createElement("div");
    body.className = "thinking-text";
    details.append(title, body);
    box.insertBefore(details, box.querySelector(".content"));
  }
  details.querySelector("summary").textContent = summary;
  details.querySelector(".thinking-text").textContent = text;
}

function showConversation() {
  const list = document.getElementById("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    li.textContent = c.title || "New chat";
    if (c === current) li.className = "current";
    li.onclick = () => { current = c; showConversation(); };
    list.appendChild(li);
  }
  const box = document.getElementById("messages");
  box.replaceChildren();
  const messages = current ? current.messages : [];
  for (const m of messages) {
    box.appendChild(messageElement(m.role, m.content, m.stats, m.thinking, m.thought));
  }
  if (!messages.length) box.appendChild(emptyHint());
  box.scrollTop = box.scrollHeight;
}

// What an empty conversation shows instead of nothing.
function emptyHint() {
  const hint = document.createElement("div");
  hint.id = "empty-hint";
  const model = document.getElementById("model").value;
  const title = document.createElement("strong");
  title.textContent = model ? "Ask " + model + " anything." : "Ask the model anything.";
  const how = document.createElement("p");
  how.textContent = "Type below: Enter sends, Shift+Enter starts a new line, Stop ends an "
    + "answer early. Sampling settings are on the right; conversations stay in this browser.";
  hint.append(title, how);
  return hint;
}

function newConversation() {
  current = { id: Date.now(), title: "", messages: [] };
  conversations.unshift(current);
  save();
  showConversation();
}

async function loadModels() {
  const select = document.getElementById("model");
  const response = await api("/v1/models");
  const models = (await response.json()).data.map((m) => m.id);
  // The dashboard's stats say which models generate text; embedding models are left out.
  let tasks = {};
  try {
    const stats = await (await api("/stats")).json();
    tasks = stats.models;
    showKeyButton(stats.api_key_required);
  } catch (e) { /* older server: offer them all */ }
  select.replaceChildren();
  for (const id of models) {
    if (tasks[id] && tasks[id].task !== "generate") continue;
    const option = document.createElement("option");
    option.value = option.textContent = id;
    select.appendChild(option);
  }
  if (!current || !current.messages.length) showConversation();  // the hint names the model
}

function requestBody(messages) {
  const body = { model: document.getElementById("model").value, messages, stream: true,
                 stream_options: { include_usage: true } };
  const system = document.getElementById("system").value.trim();
  if (system) body.messages = [{ role: "system", content: system }].concat(messages);
  const num = (id) => document.getElementById(id).value;
  if (num("temperature") !== "") body.temperature = Number(num("temperature"));
  if (num("top-p") !== "") body.top_p = Number(num("top-p"));
  if (num("max-tokens") !== "") body.max_tokens = Number(num("max-tokens"));
  if (num("seed") !== "") body.seed = Number(num("seed"));
  const stops = num("stop-strings").split("\n").filter((s) => s.length > 0);
  if (stops.length) body.stop = stops;
  if (document.getElementById("json-mode").checked) {
    body.response_format = { type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse(num("json-schema") || "{}") } };
  }
  return body;
}

// Read a server-sent-event stream, calling onData with each parsed JSON event.
async function readEvents(response, onData) {
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
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function send() {
  const input = document.getElementById("input");
  const text = input.value.trim();
  if (!text || controller) return;
  setText("error", "");
  if (!current) newConversation();
  current.messages.push({ role: "user", content: text });
  if (!current.title) current.title = text.slice(0, 40);
  input.value = "";
  let body;
  try {
    // Empty assistant turns (a failed answer saved by an older page) are not sent back.
    body = requestBody(current.messages.filter((m) => m.role !== "assistant" || m.content)
      .map((m) => ({ role: m.role, content: m.content })));
  } catch (e) {
    setText("error", "JSON schema: " + e.message);
    current.messages.pop();
    return;
  }
  showConversation();
  const el = messageElement("assistant", "", "waiting...");
  document.getElementById("messages").appendChild(el);
  controller = new AbortController();
  document.getElementById("send").disabled = true;
  document.getElementById("stop").disabled = false;
  const run = { started: performance.now(), first: null, usage: null, deltas: 0, finish: null,
                content: "", thinking: "", thinkingDeltas: 0, thinkingUsage: null,
                failed: false, convo: current };
  try {
    await stream(body, run, el);
  } catch (e) {
    if (e.name === "AbortError") run.finish = "stopped";
    else { run.failed = true; setText("error", String(e.message || e)); }
  } finally {
    keep(run, el, text);
    controller = null;
    document.getElementById("send").disabled = false;
    document.getElementById("stop").disabled = true;
  }
}

// Stream the answer into el, noting in run what arrived.
async function stream(body, run, el) {
  const content = el.querySelector(".content");
  const stats = el.querySelector(".stats");
  const response = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body), signal: controller.signal });
  if (!response.ok) {
    const err = await response.json().catch(() => ({}));
    throw new Error((err.error && err.error.message) || response.statusText);
  }
  await readEvents(response, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) {
      run.usage = chunk.usage.completion_tokens;
      const details = chunk.usage.completion_tokens_details;
      if (details && details.reasoning_tokens) run.thinkingUsage = details.reasoning_tokens;
    }
    for (const choice of chunk.choices || []) {
      const thinking = choice.delta && (choice.delta.reasoning_content || choice.delta.reasoning);
      if (thinking) {
        if (run.first === null) run.first = performance.now();
        run.deltas++;
        run.thinkingDeltas++;
        run.thinking += thinking;
        setThinking(el, run.thinking, "Thinking\u2026");
      }
      if (choice.delta && choice.delta.content) {
        if (run.first === null) run.first = performance.now();
        run.deltas++;
        run.content += choice.delta.content;
        renderMarkdown(run.content, content);
      }
      if (choice.finish_reason) run.finish = choice.finish_reason;
    }
    stats.textContent = "streaming...";
  });
}

// The answer's line: TTFT, speed, tokens (the server's count; a stopped or failed stream sends
// none, so the deltas counted, about one token each) and how it ended.
function statsLine(run) {
  const end = performance.now();
  const tokens = run.usage !== null ? run.usage : run.deltas;
  const parts = [];
  if (run.first !== null) parts.push("TTFT " + ((run.first - run.started) / 1000).toFixed(2) + " s");
  if (tokens > 1 && run.first !== null && end > run.first) {
    parts.push((((tokens - 1) * 1000) / (end - run.first)).toFixed(1) + " tokens/s");
  }
  parts.push((run.usage !== null ? "" : "~") + tokens + " tokens");
  if (run.failed) parts.push("error");
  else if (run.finish) parts.push(run.finish);
  return parts.join(" · ");
}

// The folded thinking's title once the answer is done: the server's count of thinking tokens
// when it sent usage, else the deltas counted.
function thoughtLine(run) {
  const tokens = run.thinkingUsage !== null ? run.thinkingUsage : "~" + run.thinkingDeltas;
  return "Thought for " + tokens + " tokens";
}

// Save the finished answer. With no text at all (a refused request, Stop before the first
// token) neither turn is kept: the question goes back into the input box, and the next
// request does not carry an empty answer.
function keep(run, el, question) {
  const convo = run.convo;  // the user may have opened another conversation meanwhile
  if (!run.content) {
    convo.messages.pop();
    if (!convo.messages.length) convo.title = "";
    const input = document.getElementById("input");
    if (!input.value) input.value = question;
    if (!run.failed) setText("error", "Stopped before the first token.");
    save();
    showConversation();
    return;
  }
  // The thinking is kept for showing only: requestBody sends back role and content alone.
  const answer = { role: "assistant", content: run.content, stats: statsLine(run) };
  el.querySelector(".stats").textContent = answer.stats;
  if (run.thinking) {
    answer.thinking = run.thinking;
    answer.thought = thoughtLine(run);
    setThinking(el, run.thinking, answer.thought);
  }
  convo.messages.push(answer);
  save();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("send").onclick = send;
  document.getElementById("stop").onclick = () => { if (controller) controller.abort(); };
  document.getElementById("new-chat").onclick = newConversation;
  document.getElementById("model").onchange = () => {
    if (!current || !current.messages.length) showConversation();  // the hint names it
  };
  document.getElementById("key-button").onclick = () => askForKey("The server's --api-key:");
  document.getElementById("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  current = conversations[0] || null;
  showConversation();
  loadModels().catch((e) => setText("error", "cannot list models: " + e.message));
});
