// The chat playground: models from /v1/models, answers streamed from /v1/chat/completions,
// conversations kept in local storage. Model output is only ever put in the page as text
// (textContent), never as HTML.
"use strict";

const STORE = "tokenmill.conversations";
let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = null;
let controller = null;

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

// Markdown as DOM nodes: fenced code blocks, paragraphs, `inline code` and **bold**.
function renderMarkdown(text, el) {
  el.replaceChildren();
  const parts = text.split(/```/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {  // inside a fence: the first line may name the language
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      const nl = part.indexOf("\n");
      const lang = nl > 0 ? part.slice(0, nl).trim() : "";
      if (lang && /^[\w+-]+$/.test(lang)) code.dataset.lang = lang;
      code.textContent = nl >= 0 && /^[\w+-]*$/.test(part.slice(0, nl).trim())
        ? part.slice(nl + 1) : part;
      pre.appendChild(code);
      el.appendChild(pre);
      return;
    }
    for (const para of part.split(/\n{2,}/)) {
      if (!para.trim()) continue;
      const p = document.createElement("p");
      for (const piece of para.split(/(`[^`\n]+`|\*\*[^*\n]+\*\*)/)) {
        if (!piece) continue;
        if (piece.startsWith("`") && piece.endsWith("`") && piece.length > 2) {
          const c = document.createElement("code");
          c.textContent = piece.slice(1, -1);
          p.appendChild(c);
        } else if (piece.startsWith("**") && piece.endsWith("**") && piece.length > 4) {
          const b = document.createElement("strong");
          b.textContent = piece.slice(2, -2);
          p.appendChild(b);
        } else {
          p.appendChild(document.createTextNode(piece));
        }
      }
      el.appendChild(p);
    }
  });
}

function messageElement(role, text, stats) {
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
  return box;
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
  for (const m of (current ? current.messages : [])) {
    box.appendChild(messageElement(m.role, m.content, m.stats));
  }
  box.scrollTop = box.scrollHeight;
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
    tasks = (await (await api("/stats")).json()).models;
  } catch (e) { /* older server: offer them all */ }
  select.replaceChildren();
  for (const id of models) {
    if (tasks[id] && tasks[id].task !== "generate") continue;
    const option = document.createElement("option");
    option.value = option.textContent = id;
    select.appendChild(option);
  }
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
    body = requestBody(current.messages.map((m) => ({ role: m.role, content: m.content })));
  } catch (e) {
    setText("error", "JSON schema: " + e.message);
    current.messages.pop();
    return;
  }
  showConversation();
  const answer = { role: "assistant", content: "", stats: "" };
  const el = messageElement("assistant", "", "waiting...");
  document.getElementById("messages").appendChild(el);
  const content = el.querySelector(".content");
  const stats = el.querySelector(".stats");
  controller = new AbortController();
  document.getElementById("send").disabled = true;
  document.getElementById("stop").disabled = false;
  const started = performance.now();
  let first = null;
  let tokens = 0;
  let finish = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || response.statusText);
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          if (first === null) first = performance.now();
          answer.content += choice.delta.content;
          renderMarkdown(answer.content, content);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      stats.textContent = "streaming...";
    });
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else setText("error", String(e.message || e));
  } finally {
    const end = performance.now();
    const parts = [];
    if (first !== null) parts.push("TTFT " + ((first - started) / 1000).toFixed(2) + " s");
    if (tokens > 1 && first !== null && end > first) {
      parts.push((((tokens - 1) * 1000) / (end - first)).toFixed(1) + " tokens/s");
    }
    parts.push(tokens + " tokens");
    if (finish) parts.push(finish);
    answer.stats = parts.join(" · ");
    stats.textContent = answer.stats;
    current.messages.push(answer);
    save();
    controller = null;
    document.getElementById("send").disabled = false;
    document.getElementById("stop").disabled = true;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("send").onclick = send;
  document.getElementById("stop").onclick = () => { if (controller) controller.abort(); };
  document.getElementById("new-chat").onclick = newConversation;
  document.getElementById("key-button").onclick = () => askForKey("The server's --api-key:");
  document.getElementById("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  current = conversations[0] || null;
  showConversation();
  loadModels().catch((e) => setText("error", "cannot list models: " + e.message));
});
