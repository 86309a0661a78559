// The live dashboard: /stats every second, numbers and small canvas charts of the last
// POINTS seconds for the chosen model. The charts start from the server's own history
// (/stats/history), so a new tab shows the last minutes at once.
"use strict";

const POINTS = 300;
// The narrowest time window drawn: a young server's few samples are not squeezed into a
// corner of a five-minute chart.
const MIN_POINTS = 60;
const COLORS = ["#2f6fed", "#e8832a", "#2a9d5c"];
const chartHistory = {};  // model -> array of its /stats entries (or history samples)

function fmt(x, digits) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
}

function pct(x) {
  return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%";
}

function triple(p, scale, digits) {
  if (!p || p.p50 === undefined) return "-";
  return [p.p50, p.p90, p.p99].map((v) => (v * scale).toFixed(digits)).join(" / ");
}

// A money amount in a few significant digits ("$0.0042", "$1.25"), never "$0.000000".
function money(x) {
  if (x === null || x === undefined) return "no price set";
  if (x === 0) return "$0";
  return "$" + (x >= 1 ? x.toFixed(2) : Number(x.toPrecision(2)).toString());
}

// The y axis of values (numbers; nulls and NaNs ignored): its top, a round number (1, 2, 4,
// 8 or 10 times a power of ten) above the largest value with room to spare (1 when there is
// nothing above 0: an idle chart), and the labels of its 5 grid lines from 0.
function axisTicks(values) {
  const seen = values.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
  const max = Math.max(0, ...seen) * 1.1;
  let top = 1;
  if (max > 0) {
    const power = Math.pow(10, Math.floor(Math.log10(max)));
    top = [1, 2, 4, 8, 10].map((m) => m * power).find((t) => t >= max);
  }
  const labels = [0, 1, 2, 3, 4].map((i) => Number(((i / 4) * top).toPrecision(3)).toString());
  return { top, labels };
}

// Lines of series (arrays of numbers or nulls) on one canvas, from 0 to a round top.
function drawChart(id, series) {
  const canvas = document.getElementById(id);
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 40, left = 70;
  ctx.clearRect(0, 0, w, h);
  const { top, labels } = axisTicks(series.flat());
  ctx.strokeStyle = "#ccd";
  ctx.fillStyle = "#667";
  ctx.font = "20px system-ui";
  ctx.textAlign = "right";
  for (let i = 0; i <= 4; i++) {
    const y = h - pad - (i / 4) * (h - 2 * pad);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w - 10, y); ctx.stroke();
    ctx.fillText(labels[i], left - 8, y + 7);
  }
  // The time axis: one sample a second, the newest at the right edge.
  const span = series[0].length;
  ctx.fillText("now", w - 10, h - 6);
  ctx.textAlign = "left";
  ctx.fillText(span >= 120 ? Math.round(span / 60) + " min ago" : span + " s ago", left, h - 6);
  series.forEach((data, k) => {
    ctx.strokeStyle = COLORS[k % COLORS.length];
    ctx.lineWidth = 3;
    ctx.beginPath();
    let started = false;
    data.forEach((v, i) => {
      if (v === null || v === undefined) { started = false; return; }
      const x = left + (i / (data.length - 1)) * (w - left - 10);
      const y = h - pad - (v / top) * (h - 2 * pad);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    });
    ctx.stroke();
  });
}

function showDrift(entry) {
  const table = document.getElementById("d-drift");
  table.replaceChildren();
  const scores = entry.drift_scores;
  if (!scores) return;
  const head = table.insertRow();
  for (const title of ["drift signal", "score (PSI)", ""]) {
    const th = document.createElement("th");
    th.textContent = title;
    head.appendChild(th);
  }
  for (const [signal, score] of Object.entries(scores)) {
    const row = table.insertRow();
    row.insertCell().textContent = signal;
    row.insertCell().textContent = score === null ? "not yet" : score.toFixed(3);
    const flag = row.insertCell();
    if (score !== null && score >= entry.drift_threshold) {
      flag.textContent = "above " + entry.drift_threshold;
      flag.className = "alert";
    }
  }
}

function show(name, entry) {
  setText("d-output-tps", fmt(entry.output_tokens_per_s, 1));
  setText("d-prompt-tps", fmt(entry.prompt_tokens_per_s, 1));
  setText("d-running", entry.running + " / " + entry.waiting);
  setText("d-kv", pct(entry.kv_cache_usage));
  setText("d-prefix", pct(entry.prefix_cache_hit_rate));
  setText("d-spec", pct(entry.spec_acceptance_rate));
  setText("d-ttft", triple(entry.ttft_seconds, 1, 2));
  setText("d-itl", triple(entry.itl_seconds, 1000, 0));
  setText("d-finished", String(entry.finished_total));
  setText("d-output-total", String(entry.output_tokens_total));
  const est = entry.energy_estimated ? " (est.)" : "";
  setText("d-energy", entry.joules_per_1k_output_tokens === null ? "-"
    : fmt(entry.joules_per_1k_output_tokens, 1) + " J" + est);
  setText("d-cost", money(entry.usd_per_1k_output_tokens));
  showDrift(entry);
  const h = chartHistory[name] || [];
  // The newest sample at the right edge of a window of MIN_POINTS to POINTS samples.
  const span = Math.min(POINTS, Math.max(MIN_POINTS, h.length));
  const col = (f) => Array(Math.max(0, span - h.length)).fill(null).concat(h.map(f)).slice(-span);
  drawChart("c-throughput", [col((e) => e.output_tokens_per_s), col((e) => e.prompt_tokens_per_s)]);
  drawChart("c-requests", [col((e) => e.running), col((e) => e.waiting)]);
  drawChart("c-latency", [col((e) => (e.ttft_seconds.p50 ?? null)),
                          col((e) => (e.ttft_seconds.p90 ?? null)),
                          col((e) => (e.itl_seconds.p50 ?? null))]);
  drawChart("c-kv", [col((e) => 100 * e.kv_cache_usage)]);
}

async function poll() {
  try {
    const response = await api("/stats");
    const stats = await response.json();
    const select = document.getElementById("d-model");
    const names = Object.keys(stats.models);
    if (select.options.length !== names.length) {
      select.replaceChildren();
      for (const n of names) {
        const o = document.createElement("option");
        o.value = o.textContent = n + (stats.models[n].task === "embed" ? " (embeddings)" : "");
        o.value = n;
        select.appendChild(o);
      }
    }
    showKeyButton(stats.api_key_required);
    for (const n of names) {
      chartHistory[n] = (chartHistory[n] || []).concat([stats.models[n]]).slice(-POINTS);
    }
    const name = select.value || names[0];
    if (name) show(name, stats.models[name]);
    setText("d-updated", "updated " + new Date(stats.time * 1000).toLocaleTimeString());
    setText("error", "");
  } catch (e) {
    setText("error", "cannot read /stats: " + e.message);
  }
}

// The server's last minutes of samples, before the first poll adds the present.
async function loadHistory() {
  try {
    const response = await api("/stats/history");
    if (!response.ok) return;  // an older server: the charts start empty
    for (const [name, samples] of Object.entries((await response.json()).models)) {
      chartHistory[name] = samples.slice(-POINTS);
    }
  } catch (e) {
    setText("error", "cannot read /stats/history: " + e.message);
  }
}

document.addEventListener("DOMContentLoaded", async () => {
  document.getElementById("key-button").onclick = () => askForKey("The server's --api-key:");
  await loadHistory();
  poll();
  setInterval(poll, 1000);
});
