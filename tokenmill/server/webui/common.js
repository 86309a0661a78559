// Shared by both pages: the API key (kept in this browser's local storage) and fetch with it.
"use strict";

const KEY_STORE = "tokenmill.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// Ask for the key in the page's own dialog; resolves once the user saved one. Callers that
// ask while the dialog is open wait for the same answer.
let keyPrompt = null;

function askForKey(message) {
  if (keyPrompt) return keyPrompt;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message || "This server needs an API key.";
  input.value = apiKey();
  dialog.hidden = false;
  input.focus();
  keyPrompt = new Promise((resolve) => {
    document.getElementById("key-save").onclick = () => {
      localStorage.setItem(KEY_STORE, input.value.trim());
      dialog.hidden = true;
      keyPrompt = null;
      resolve();
    };
  });
  return keyPrompt;
}

// The key button (hidden in the HTML): shown only where the server wants a key, as its
// /stats says or a 401 shows.
function showKeyButton(required) {
  const button = document.getElementById("key-button");
  if (button) button.hidden = !required;
}

// fetch() with the key; a 401 asks for the key and tries again.
async function api(path, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    opts.headers = authHeaders(opts.headers);
    const response = await fetch(path, opts);
    if (response.status !== 401) return response;
    showKeyButton(true);
    await askForKey(apiKey() ? "That key was refused: type the server's --api-key."
                             : "This server needs an API key (its --api-key).");
  }
}

function setText(id, text) {
  const el = document.getElementById(id);
  if (el) el.textContent = text;
}
