// The dashboard's projects panel (servers started with --admin-key): with the admin key typed
// in (kept in sessionStorage: this tab only, gone when it closes), a project selector, each
// project's chat/completions usage and cost of the last USAGE_DAYS days, and the usage CSV.
// Shown only where the server has projects.
"use strict";

const ADMIN_STORE = "tokenmill.adminKey";
const USAGE_DAYS = 30;

function adminFetch(path) {
  const key = sessionStorage.getItem(ADMIN_STORE) || "";
  return fetch("/v1/organization" + path, { headers: { Authorization: "Bearer " + key } });
}

function usageSince() {
  return Math.floor(Date.now() / 1000) - USAGE_DAYS * 86400;
}

// Requests, tokens and cost per project id, summed over the daily buckets of both pages.
async function projectUsage() {
  const query = "?start_time=" + usageSince() + "&bucket_width=1d&limit=" + (USAGE_DAYS + 1)
    + "&group_by=project_id";
  const [usage, costs] = await Promise.all([adminFetch("/usage/completions" + query),
                                            adminFetch("/costs" + query)]);
  if (!usage.ok || !costs.ok) throw new Error("usage: HTTP " + (usage.ok ? costs : usage).status);
  const totals = {};
  const of = (id) => totals[id] || (totals[id] = { requests: 0, input: 0, output: 0, cost: 0 });
  for (const bucket of (await usage.json()).data) {
    for (const r of bucket.results) {
      const t = of(r.project_id);
      t.requests += r.num_model_requests;
      t.input += r.input_tokens;
      t.output += r.output_tokens;
    }
  }
  for (const bucket of (await costs.json()).data) {
    for (const r of bucket.results) of(r.project_id).cost += r.amount.value;
  }
  return totals;
}

function fillProjectSelect(projects) {
  const select = document.getElementById("p-project");
  const chosen = select.value;
  select.replaceChildren();
  const all = document.createElement("option");
  all.value = "";
  all.textContent = "all projects";
  select.appendChild(all);
  for (const p of projects) {
    const o = document.createElement("option");
    o.value = p.id;
    o.textContent = p.name + " (" + p.id + ")";
    select.appendChild(o);
  }
  if (projects.some((p) => p.id === chosen)) select.value = chosen;
}

function showProjectTable(projects, totals) {
  const table = document.getElementById("p-usage");
  table.replaceChildren();
  const head = table.insertRow();
  for (const title of ["project", "requests", "input tokens", "output tokens", "cost"]) {
    const th = document.createElement("th");
    th.textContent = title;
    head.appendChild(th);
  }
  const chosen = document.getElementById("p-project").value;
  for (const p of projects) {
    if (chosen && p.id !== chosen) continue;
    const t = totals[p.id] || { requests: 0, input: 0, output: 0, cost: 0 };
    const row = table.insertRow();
    row.dataset.project = p.id;
    for (const v of [p.name, t.requests, t.input, t.output, money(t.cost)]) {
      row.insertCell().textContent = String(v);
    }
  }
}

// Read the projects and their usage; the selector and table only where projects exist.
async function loadProjects() {
  const panel = document.getElementById("p-panel");
  setText("p-error", "");
  if (!sessionStorage.getItem(ADMIN_STORE)) { panel.hidden = true; return; }
  const response = await adminFetch("/projects?limit=100");
  if (!response.ok) {
    panel.hidden = true;
    setText("p-error", response.status === 404 ? "this server has no projects (no --admin-key)"
      : "the admin key was refused (HTTP " + response.status + ")");
    return;
  }
  const projects = (await response.json()).data;
  panel.hidden = projects.length === 0;
  if (!projects.length) { setText("p-error", "no projects yet"); return; }
  fillProjectSelect(projects);
  const totals = await projectUsage();
  showProjectTable(projects, totals);
  document.getElementById("p-project").onchange = () => showProjectTable(projects, totals);
}

// The usage rows of the last USAGE_DAYS days as CSV text (the chosen project's, or all).
async function exportCsv() {
  const project = document.getElementById("p-project").value;
  const response = await adminFetch("/usage/export?format=csv&start_time=" + usageSince()
    + (project ? "&project_ids=" + encodeURIComponent(project) : ""));
  if (!response.ok) throw new Error("export: HTTP " + response.status);
  return response.text();
}

async function downloadCsv() {
  const text = await exportCsv();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([text], { type: "text/csv" }));
  link.download = "tokenmill-usage.csv";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

document.addEventListener("DOMContentLoaded", () => {
  const report = (e) => setText("p-error", String(e.message || e));
  document.getElementById("admin-key-save").onclick = () => {
    sessionStorage.setItem(ADMIN_STORE, document.getElementById("admin-key").value.trim());
    loadProjects().catch(report);
  };
  document.getElementById("p-refresh").onclick = () => loadProjects().catch(report);
  document.getElementById("p-download").onclick = () => downloadCsv().catch(report);
  loadProjects().catch(report);
});
