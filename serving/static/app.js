// vit-service web page: predictions with attention heatmaps, and training jobs.
// Plain JS, no build step; talks to the same server's REST API.
"use strict";

const $ = (sel) => document.querySelector(sel);
const state = { image: null, imageResult: null, textResult: null, key: sessionStorage.getItem("vitKey") || "",
  picked: new Set(JSON.parse(localStorage.getItem("vitPicked") || "[]")), series: {}, jobs: [] };
const COLORS = ["#2f6fed", "#e4572e", "#17a589", "#9b59b6", "#f39c12", "#34495e", "#c0392b", "#16a085"];
const esc = (t) => String(t).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));

function showError(msg) {
  const box = $("#error");
  box.textContent = msg;
  box.hidden = !msg;
}

async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (opts.auth && state.key) headers["Authorization"] = "Bearer " + state.key;
  let resp;
  try {
    resp = await fetch(path, Object.assign({}, opts, { headers }));
  } catch (e) {
    throw new Error("cannot reach the server: " + e.message);
  }
  const body = await resp.json().catch(() => null);
  if (!resp.ok) {
    let detail = body && body.detail;
    if (Array.isArray(detail)) detail = detail.map((d) => (d.loc || []).join(".") + ": " + d.msg).join("; ");
    throw new Error(`${resp.status}: ${detail || resp.statusText}`);
  }
  return body;
}

// ---- tabs ------------------------------------------------------------------------------------
document.querySelectorAll(".tab").forEach((btn) =>
  btn.addEventListener("click", () => {
    document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("active", b === btn));
    ["image", "text", "jobs"].forEach((t) => ($("#panel-" + t).hidden = t !== btn.dataset.tab));
    if (btn.dataset.tab === "jobs") refreshJobs();
  })
);

// ---- models & info -----------------------------------------------------------------------------
async function loadModels() {
  try {
    const info = await api("/v1/info");
    if (info.mlflow_ui_url) {
      const a = $("#mlflow-link");
      a.href = info.mlflow_ui_url;
      a.hidden = false;
    }
    const { models } = await api("/v1/models");
    state.models = models;
    for (const [task, sel] of [["image", "#image-model"], ["text", "#text-model"]]) {
      const opts = models.filter((m) => !m.task || m.task === task);
      $(sel).innerHTML = opts
        .map((m) => `<option value="${esc(m.name)}">${esc(m.name)}${m.loaded ? " v" + (m.version || "local") : " (not loaded)"}</option>`)
        .join("");
      const loaded = opts.some((m) => m.loaded && m.task === task);
      $(`#${task}-empty`).hidden = loaded;
      if (loaded) loadCard(task); else $(`#${task}-card`).hidden = true;
    }
  } catch (e) {
    showError(e.message);
  }
}

// ---- model cards and empty states -----------------------------------------------------------------
async function loadCard(task) {
  const name = $(task === "image" ? "#image-model" : "#text-model").value;
  const box = $(`#${task}-card`);
  if (!name) { box.hidden = true; return; }
  try {
    const c = await api(`/v1/models/${encodeURIComponent(name)}/card`);
    const pct = (v) => (v == null ? "–" : (100 * v).toFixed(1) + " %");
    const mins = (s) => (s == null ? "–" : s < 90 ? `${Math.round(s)} s` : `${(s / 60).toFixed(1)} min`);
    let html = `<h3>${esc(c.name)} <span class="muted">v${esc(c.version || "local")}${c.alias ? " @" + esc(c.alias) : ""}</span></h3>`;
    html += `<dl><dt>recipe</dt><dd>${esc(c.recipe || "–")}</dd><dt>parameters</dt><dd>${c.parameters.toLocaleString("en")}</dd>` +
      `<dt>validation accuracy</dt><dd class="val-acc">${pct(c.val_acc)}</dd><dt>training time</dt><dd>${mins(c.training_s)}</dd>` +
      `<dt>steps</dt><dd>${c.step == null ? "–" : c.step}</dd>` +
      `<dt>classes</dt><dd class="classes" title="${esc(c.classes.join(", "))}">${esc(c.classes.slice(0, 12).join(", "))}${c.classes.length > 12 ? ` … (${c.classes.length})` : ""}</dd></dl>`;
    if (c.run_url) html += `<a href="${esc(c.run_url)}" target="_blank" rel="noopener">MLflow run ↗</a>`;
    if (c.per_class) {
      html += `<table class="recall"><tr><th>class</th><th>recall</th></tr>` +
        c.per_class.map((r) => `<tr><td>${esc(r.label)}</td><td><span class="bar" style="width:${Math.round(80 * r.recall)}px"></span> ${pct(r.recall)}</td></tr>`).join("") + "</table>";
    }
    if (c.confusion) {
      const max = Math.max(...c.confusion.flat(), 1);
      html += `<div class="muted">confusion matrix (rows: true, columns: predicted)</div><table class="confusion">` +
        c.confusion.map((row, i) => `<tr><th title="${esc(c.classes[i])}">${esc(c.classes[i].slice(0, 5))}</th>` +
          row.map((v) => `<td title="${v}" style="background: rgba(47,111,237,${(v / max).toFixed(2)})">${v}</td>`).join("") + "</tr>").join("") + "</table>";
    }
    if (c.mlflow_error) html += `<div class="muted">MLflow run unavailable: ${esc(c.mlflow_error)}</div>`;
    box.innerHTML = html;
    box.hidden = false;
  } catch (e) {
    box.hidden = true;
  }
}
$("#image-model").addEventListener("change", () => loadCard("image"));
$("#text-model").addEventListener("change", () => loadCard("text"));

async function trainFirst(recipe, budget) {
  if (!state.key) {
    showError("Training needs the API key: open the Training jobs tab and paste it there (the server prints it at start, or set VIT_SERVICE_API_KEY).");
    return;
  }
  try {
    const job = await api("/v1/jobs", { method: "POST", auth: true, headers: { "Content-Type": "application/json" },
      // a button's data-budget caps a long recipe for a first model; without it, the recipe as shipped
      body: JSON.stringify({ recipe, name: "first model", overrides: budget ? { budget_minutes: Number(budget) } : {} }) });
    pick(job.id, true);
    document.querySelector('.tab[data-tab="jobs"]').click();
  } catch (e) {
    showError("Launch failed — " + e.message);
  }
}
document.querySelectorAll("button.train-first").forEach((b) => b.addEventListener("click", () => trainFirst(b.dataset.recipe, b.dataset.budget)));

// ---- colour map and heatmap ---------------------------------------------------------------------
function colormap(t) { // a compact "turbo"-like ramp, t in [0, 1]
  const r = Math.round(255 * Math.min(1, Math.max(0, 1.5 - Math.abs(4 * t - 3))));
  const g = Math.round(255 * Math.min(1, Math.max(0, 1.5 - Math.abs(4 * t - 2))));
  const b = Math.round(255 * Math.min(1, Math.max(0, 1.5 - Math.abs(4 * t - 1))));
  return [r, g, b];
}

function currentImageMap() {
  const att = state.imageResult && state.imageResult.attention;
  if (!att) return null;
  const v = $("#attn-view").value;
  if (v === "rollout") return att.rollout;
  if (v === "relevance") return att.relevance;
  const [, l, h] = v.split(":").map(Number);
  if (v.startsWith("layer:")) return att.layers[l];
  return att.heads[l][h];
}

function draw() {
  const canvas = $("#canvas");
  const ctx = canvas.getContext("2d");
  if (!state.image) return;
  canvas.hidden = false;
  ctx.imageSmoothingEnabled = true;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.globalAlpha = 1;
  ctx.drawImage(state.image, 0, 0, canvas.width, canvas.height);
  const map = currentImageMap();
  if (!map) return;
  const rows = map.length, cols = map[0].length;
  const flat = map.flat();
  const lo = Math.min(...flat), hi = Math.max(...flat);
  const off = document.createElement("canvas");
  off.width = cols; off.height = rows;
  const octx = off.getContext("2d");
  const img = octx.createImageData(cols, rows);
  flat.forEach((v, i) => {
    const [r, g, b] = colormap(hi > lo ? (v - lo) / (hi - lo) : 0);
    img.data.set([r, g, b, 255], i * 4);
  });
  octx.putImageData(img, 0, 0);
  ctx.globalAlpha = Number($("#opacity").value);
  ctx.drawImage(off, 0, 0, canvas.width, canvas.height);
  ctx.globalAlpha = 1;
  canvas.dataset.rendered = "heatmap";
  drawFaithfulness($("#faith"), state.imageResult.faithfulness, $("#attn-view").value, "patches");
}

// ---- faithfulness: the deletion curve of the map on show, against a random order -----------------
function drawFaithfulness(box, faith, view, what) {
  if (!faith) { box.hidden = true; return; }
  box.hidden = false;
  const name = ["relevance", "rollout", "ngram"].includes(view) ? view : null;
  const W = 320, H = 130, L = 34, B = 22, T = 8, R = 8;
  const x = (f) => L + f * (W - L - R), y = (p) => T + (1 - p) * (H - T - B);
  const path = (pts) => pts.map((p, i) => `${i ? "L" : "M"}${x(faith.fractions[i]).toFixed(1)},${y(p).toFixed(1)}`).join(" ");
  let svg = `<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" role="img">`;
  svg += `<line x1="${L}" y1="${y(0)}" x2="${W - R}" y2="${y(0)}" stroke="#999"/><line x1="${L}" y1="${T}" x2="${L}" y2="${y(0)}" stroke="#999"/>`;
  svg += `<text x="${L - 4}" y="${y(1) + 4}" text-anchor="end" font-size="10">1</text><text x="${L - 4}" y="${y(0)}" text-anchor="end" font-size="10">0</text>`;
  svg += `<text x="${(L + W) / 2}" y="${H - 4}" text-anchor="middle" font-size="10">share of ${what} removed, most relevant first</text>`;
  svg += `<path d="${path(faith.maps.random.deletion)}" fill="none" stroke="#9ca3af" stroke-dasharray="4 3" stroke-width="2"/>`;
  let text = `p(${esc(faith.target.label)}) as ${what} are deleted · random order dashed, AUC ${faith.maps.random.deletion_auc.toFixed(3)}`;
  if (name && faith.maps[name]) {
    const m = faith.maps[name];
    svg += `<path class="curve" d="${path(m.deletion)}" fill="none" stroke="#2f6fed" stroke-width="2"/>`;
    text = `${name}: deletion AUC <b>${m.deletion_auc.toFixed(3)}</b> vs random ${faith.maps.random.deletion_auc.toFixed(3)} ` +
      `(ratio ${faith.deletion_ratio[name].toFixed(2)}, lower is better) · most faithful here: ${faith.most_faithful}`;
  } else {
    text += " · curves are computed for rollout, relevance and the n-gram head";
  }
  box.innerHTML = svg + `</svg><div class="muted">${text}</div>`;
  box.dataset.map = name || "";
}

function renderPreds(list, preds) {
  list.innerHTML = preds
    .map((p) => `<li><b>${esc(p.label)}</b> ${(100 * p.probability).toFixed(1)}%<span class="bar" style="width:${Math.round(150 * p.probability)}px"></span></li>`)
    .join("");
}

function fillViews(sel, layers, heads, relevance, ngram) {
  let html = '<option value="rollout">rollout</option>';
  if (relevance) html += '<option value="relevance">relevance (gradient-weighted)</option>';
  if (ngram) html += '<option value="ngram">n-gram head (signed share of the logit)</option>';
  layers.forEach((_, l) => (html += `<option value="layer:${l}">layer ${l + 1} (mean of heads)</option>`));
  (heads || []).forEach((hs, l) => hs.forEach((_, h) => (html += `<option value="head:${l}:${h}">layer ${l + 1}, head ${h + 1}</option>`)));
  sel.innerHTML = html;
}

async function predictImage(file) {
  showError("");
  state.imageResult = null; // the previous image's maps must not be drawn over this one
  $("#faith").hidden = true;
  const url = URL.createObjectURL(file);
  const img = new Image();
  img.onload = () => { state.image = img; draw(); };
  img.src = url;
  const form = new FormData();
  form.append("file", file, file.name);
  const model = encodeURIComponent($("#image-model").value || "");
  try {
    const q = "attention=heads&attention=relevance&faithfulness=true&top_k=5";
    const out = await api(`/v1/predict/image?${q}${model ? "&model=" + model : ""}`, { method: "POST", body: form });
    const r = out.results[0];
    state.imageResult = r;
    $("#image-model-info").textContent = `${out.model.name} v${out.model.version || "local"} · ${r.width}×${r.height} input · ${r.attention.grid.join("×")} patches`;
    renderPreds($("#image-preds"), r.predictions);
    fillViews($("#attn-view"), r.attention.layers, r.attention.heads, r.attention.relevance);
    draw();
  } catch (e) {
    state.imageResult = null;
    $("#image-preds").innerHTML = "";
    showError("Prediction failed — " + e.message);
  }
}

const drop = $("#drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  if (e.dataTransfer.files[0]) predictImage(e.dataTransfer.files[0]);
});
$("#file").addEventListener("change", (e) => e.target.files[0] && predictImage(e.target.files[0]));
$("#attn-view").addEventListener("change", draw);
$("#opacity").addEventListener("input", draw);

// ---- text ------------------------------------------------------------------------------------
function renderTokens() {
  const r = state.textResult;
  if (!r) return;
  const v = $("#text-attn-view").value;
  let w = r.attention.rollout;
  if (v === "relevance") w = r.attention.relevance;
  if (v.startsWith("layer:")) w = r.attention.layers[Number(v.split(":")[1])];
  if (v.startsWith("head:")) { const [, l, h] = v.split(":").map(Number); w = r.attention.heads[l][h]; }
  if (v === "ngram") w = r.attention.ngram; // signed: blue for the class explained, red against
  const hi = Math.max(...w.map(Math.abs), 1e-9);
  const colour = (x) => (x >= 0 ? `rgba(47,111,237,${(x / hi).toFixed(3)})` : `rgba(220,38,38,${(-x / hi).toFixed(3)})`);
  $("#tokens").innerHTML = r.tokens
    .map((t, i) => `<span title="${w[i].toFixed(4)}" style="background: ${colour(w[i])}">${esc(t)}</span>`)
    .join("") + (r.truncated ? ' <em class="muted">(truncated to the model\'s max length)</em>' : "");
  drawFaithfulness($("#text-faith"), r.faithfulness, v, "tokens");
}

$("#classify").addEventListener("click", async () => {
  showError("");
  try {
    const body = { text: $("#review").value, attention: ["heads", "relevance"], faithfulness: true, top_k: 2 };
    if ($("#text-model").value) body.model = $("#text-model").value;
    const out = await api("/v1/predict/text", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    state.textResult = out.results[0];
    renderPreds($("#text-preds"), state.textResult.predictions);
    const a = state.textResult.attention;
    fillViews($("#text-attn-view"), a.layers, a.heads, a.relevance, a.ngram);
    renderTokens();
  } catch (e) {
    showError("Prediction failed — " + e.message);
  }
});
$("#text-attn-view").addEventListener("change", renderTokens);

// ---- jobs ------------------------------------------------------------------------------------
$("#api-key").value = state.key;
$("#save-key").addEventListener("click", () => {
  state.key = $("#api-key").value.trim();
  sessionStorage.setItem("vitKey", state.key);
  loadRecipes();
  refreshJobs();
});

async function loadRecipes() {
  if (!state.key) return;
  try {
    const { recipes } = await api("/v1/recipes", { auth: true });
    $("#recipe").innerHTML = recipes.map((r) => `<option value="${esc(r.name)}" title="${esc(r.description)}">${esc(r.name)}</option>`).join("");
    showError("");
  } catch (e) {
    showError("Recipes — " + e.message);
  }
}

function parseOverrides(text) {
  const out = {};
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line) continue;
    const eq = line.indexOf("=");
    if (eq < 1) throw new Error(`override "${line}" is not key=value`);
    const key = line.slice(0, eq).trim(), val = line.slice(eq + 1).trim();
    if (/^-?\d+$/.test(val)) out[key] = parseInt(val, 10);
    else if (/^-?(\d+\.?\d*|\.\d+)(e-?\d+)?$/i.test(val)) out[key] = parseFloat(val);
    else if (val === "true" || val === "false") out[key] = val === "true";
    else out[key] = val;
  }
  return out;
}

$("#job-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  showError("");
  try {
    const body = { recipe: $("#recipe").value, name: $("#job-name").value, overrides: parseOverrides($("#overrides").value) };
    const budget = $("#budget").value.trim();
    if (budget) body.overrides.budget_minutes = Number(budget);
    const job = await api("/v1/jobs", { method: "POST", auth: true, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    pick(job.id, true);
    refreshJobs();
  } catch (err) {
    showError("Launch failed — " + err.message);
  }
});

function fmtMetrics(m) {
  const keys = ["val_acc", "val_loss", "loss", "throughput"];
  return keys.filter((k) => k in m).map((k) => `${k} ${Number(m[k]).toPrecision(3)}`).join(" · ");
}

function fmtEta(s) {
  if (s == null) return "";
  return s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
}

function pick(id, on) {
  if (on) state.picked.add(id); else state.picked.delete(id);
  localStorage.setItem("vitPicked", JSON.stringify([...state.picked]));
}

async function refreshJobs() {
  $("#jobs-nokey").hidden = !!state.key;
  if (!state.key || state.refreshing) return; // one refresh at a time
  state.refreshing = true;
  try {
    const { jobs } = await api("/v1/jobs?limit=20", { auth: true });
    state.jobs = jobs;
    $("#jobs-none").hidden = jobs.length > 0;
    $("#jobs tbody").innerHTML = jobs
      .map((j) => {
        const p = j.progress;
        let prog = p.total_steps ? `step ${p.step || 0}/${p.total_steps}` + (p.epoch != null ? `, epoch ${p.epoch + 1}` : "") : "";
        if (j.state === "running" && p.metrics.eta_s != null) prog += ` · <span class="eta">ETA ${fmtEta(p.metrics.eta_s)}</span>`;
        const c = p.cluster;  // a multi-node (Ray Train) job: its workers' nodes, restarts
        if (c && c.workers) prog += ` · <span class="cluster" title="${esc(Object.entries(c.workers).map(([r, w]) => `rank ${r}: ${w.host} ${String(w.node_id).slice(0, 8)}`).join("\n"))}">${Object.keys(c.workers).length} workers on ${c.nodes} node${c.nodes === 1 ? "" : "s"}${c.attempt > 1 ? `, restart ${c.attempt - 1}` : ""}</span>`;
        if (j.state === "queued" && j.queue_position) prog = `<span class="queue">#${j.queue_position} in queue · waiting for ${esc(j.waiting_for || "")}</span>`;
        const on = state.picked.has(j.id) ? "checked" : "";
        const check = `<input type="checkbox" class="pick" data-id="${j.id}" ${on} title="plot this job">`;
        const link = j.mlflow_run_url ? `<a href="${esc(j.mlflow_run_url)}" target="_blank" rel="noopener">run</a>` : "";
        const cancel = ["queued", "running"].includes(j.state) ? `<button class="cancel" data-id="${j.id}">Cancel</button>` : "";
        return `<tr data-id="${j.id}"><td>${check}</td><td title="${j.id}">${esc(j.name)}</td><td class="owner">${esc(j.owner || "")}</td><td>${esc(j.recipe)}</td><td class="state-${j.state}">${j.state}${j.reason ? ` <span class="muted">(${esc(j.reason)})</span>` : ""}</td><td>${prog}</td><td>${fmtMetrics(p.metrics)}</td><td>${link}</td><td>${cancel}</td></tr>`;
      })
      .join("");
    await loadSeries(jobs);
    drawJobCharts();
  } catch (e) {
    showError("Jobs — " + e.message);
  } finally {
    state.refreshing = false;
  }
}

// one listener each for the table's checkboxes and cancel buttons (rows are re-rendered)
$("#jobs tbody").addEventListener("change", (e) => {
  const c = e.target.closest("input.pick");
  if (c) { pick(c.dataset.id, c.checked); loadSeries(state.jobs).then(drawJobCharts); }
});
$("#jobs tbody").addEventListener("click", async (e) => {
  const b = e.target.closest("button.cancel");
  if (!b) return;
  b.disabled = true;
  try { await api(`/v1/jobs/${b.dataset.id}/cancel`, { method: "POST", auth: true }); refreshJobs(); }
  catch (err) { showError("Cancel failed — " + err.message); }
});

// ---- live curves and comparison -----------------------------------------------------------------
async function loadSeries(jobs) {
  for (const j of jobs.filter((j) => state.picked.has(j.id))) {
    const cached = state.series[j.id];
    const live = ["queued", "running"].includes(j.state);
    if (cached && cached.final && !live) continue; // finished: its series no longer changes
    try {
      const m = await api(`/v1/jobs/${j.id}/metrics?max_points=300`, { auth: true });
      m.final = !live;
      state.series[j.id] = m;
    } catch (e) { /* the table shows the job's state; a missing log is not an error here */ }
  }
}

function overridesText(o) {
  return Object.entries(o || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "recipe defaults";
}

function lineChart(el, title, lines, yfmt) {
  const W = 300, H = 170, L = 44, R = 10, T = 20, B = 22;
  const pts = lines.flatMap((l) => l.points);
  if (!pts.length) { el.innerHTML = `<div class="muted">${title}: no points yet</div>`; el.dataset.points = "0"; return; }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 - y0 < 1e-12) { y0 -= 0.5 * Math.abs(y0 || 1); y1 += 0.5 * Math.abs(y1 || 1); }
  const sx = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - R), sy = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  let svg = `<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}"><text x="${L}" y="12" font-size="11" font-weight="600">${title}</text>`;
  svg += `<line x1="${L}" y1="${sy(y0)}" x2="${W - R}" y2="${sy(y0)}" stroke="#bbb"/><line x1="${L}" y1="${T}" x2="${L}" y2="${sy(y0)}" stroke="#bbb"/>`;
  svg += `<text x="${L - 3}" y="${sy(y1) + 4}" text-anchor="end" font-size="9">${yfmt(y1)}</text><text x="${L - 3}" y="${sy(y0)}" text-anchor="end" font-size="9">${yfmt(y0)}</text>`;
  svg += `<text x="${L}" y="${H - 6}" font-size="9">step ${x0}</text><text x="${W - R}" y="${H - 6}" text-anchor="end" font-size="9">${x1}</text>`;
  for (const l of lines) {
    if (!l.points.length) continue;
    const d = l.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg += `<path class="series" data-job="${l.id}" d="${d}" fill="none" stroke="${l.color}" stroke-width="1.8"/>`;
    if (l.points.length < 40) l.points.forEach((p) => (svg += `<circle cx="${sx(p[0]).toFixed(1)}" cy="${sy(p[1]).toFixed(1)}" r="2.2" fill="${l.color}"/>`));
  }
  el.innerHTML = svg + "</svg>";
  el.dataset.points = String(pts.length);
}

function drawJobCharts() {
  const jobs = state.jobs.filter((j) => state.picked.has(j.id) && state.series[j.id]);
  $("#charts").hidden = jobs.length === 0;
  if (!jobs.length) return;
  const lines = (key) => jobs.map((j, i) => ({ id: j.id, color: COLORS[i % COLORS.length], points: (state.series[j.id].series[key] || []) }));
  lineChart($("#chart-loss"), "training loss", lines("loss"), (v) => v.toPrecision(3));
  lineChart($("#chart-lr"), "learning rate", lines("lr"), (v) => v.toExponential(1));
  lineChart($("#chart-val"), "validation accuracy", lines("val_acc"), (v) => (100 * v).toFixed(1) + "%");
  $("#chart-legend").innerHTML = jobs.map((j, i) => {
    const va = (state.series[j.id].series.val_acc || []).slice(-1)[0];
    return `<li><span class="swatch" style="background:${COLORS[i % COLORS.length]}"></span><b>${esc(j.name || j.id)}</b> ` +
      `${esc(j.recipe)} · <span class="muted">${esc(overridesText(j.overrides))}</span>${va ? ` · val ${(100 * va[1]).toFixed(1)}%` : ""}</li>`;
  }).join("");
}

setInterval(() => { if (!$("#panel-jobs").hidden) refreshJobs(); }, 2000);
loadModels();
loadRecipes();
