// vit-service web page: predictions with attention heatmaps, and training jobs.
// Plain JS, no build step; talks to the same server's REST API.
"use strict";

const $ = (sel) => document.querySelector(sel);
const state = { image: null, imageResult: null, textResult: null, key: localStorage.getItem("vitKey") || "" };

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
    for (const [task, sel] of [["image", "#image-model"], ["text", "#text-model"]]) {
      const opts = models.filter((m) => !m.task || m.task === task);
      $(sel).innerHTML = opts
        .map((m) => `<option value="${m.name}">${m.name}${m.loaded ? " v" + (m.version || "local") : " (not loaded)"}</option>`)
        .join("");
    }
  } catch (e) {
    showError(e.message);
  }
}

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
}

function renderPreds(list, preds) {
  list.innerHTML = preds
    .map((p) => `<li><b>${p.label}</b> ${(100 * p.probability).toFixed(1)}%<span class="bar" style="width:${Math.round(150 * p.probability)}px"></span></li>`)
    .join("");
}

function fillViews(sel, layers, heads) {
  let html = '<option value="rollout">rollout</option>';
  layers.forEach((_, l) => (html += `<option value="layer:${l}">layer ${l + 1} (mean of heads)</option>`));
  (heads || []).forEach((hs, l) => hs.forEach((_, h) => (html += `<option value="head:${l}:${h}">layer ${l + 1}, head ${h + 1}</option>`)));
  sel.innerHTML = html;
}

async function predictImage(file) {
  showError("");
  const url = URL.createObjectURL(file);
  const img = new Image();
  img.onload = () => { state.image = img; draw(); };
  img.src = url;
  const form = new FormData();
  form.append("file", file, file.name);
  const model = encodeURIComponent($("#image-model").value || "");
  try {
    const out = await api(`/v1/predict/image?attention=heads&top_k=5${model ? "&model=" + model : ""}`, { method: "POST", body: form });
    const r = out.results[0];
    state.imageResult = r;
    $("#image-model-info").textContent = `${out.model.name} v${out.model.version || "local"} · ${r.width}×${r.height} input · ${r.attention.grid.join("×")} patches`;
    renderPreds($("#image-preds"), r.predictions);
    fillViews($("#attn-view"), r.attention.layers, r.attention.heads);
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
  if (v.startsWith("layer:")) w = r.attention.layers[Number(v.split(":")[1])];
  if (v.startsWith("head:")) { const [, l, h] = v.split(":").map(Number); w = r.attention.heads[l][h]; }
  const hi = Math.max(...w, 1e-9);
  $("#tokens").innerHTML = r.tokens
    .map((t, i) => `<span title="${w[i].toFixed(4)}" style="background: rgba(47,111,237,${(w[i] / hi).toFixed(3)})">${t.replace(/</g, "&lt;")}</span>`)
    .join("") + (r.truncated ? ' <em class="muted">(truncated to the model\'s max length)</em>' : "");
}

$("#classify").addEventListener("click", async () => {
  showError("");
  try {
    const body = { text: $("#review").value, attention: "heads", top_k: 2 };
    if ($("#text-model").value) body.model = $("#text-model").value;
    const out = await api("/v1/predict/text", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    state.textResult = out.results[0];
    renderPreds($("#text-preds"), state.textResult.predictions);
    fillViews($("#text-attn-view"), state.textResult.attention.layers, state.textResult.attention.heads);
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
  localStorage.setItem("vitKey", state.key);
  loadRecipes();
  refreshJobs();
});

async function loadRecipes() {
  if (!state.key) return;
  try {
    const { recipes } = await api("/v1/recipes", { auth: true });
    $("#recipe").innerHTML = recipes.map((r) => `<option value="${r.name}" title="${r.description}">${r.name}</option>`).join("");
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
    await api("/v1/jobs", { method: "POST", auth: true, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    refreshJobs();
  } catch (err) {
    showError("Launch failed — " + err.message);
  }
});

function fmtMetrics(m) {
  const keys = ["val_acc", "val_loss", "loss", "throughput"];
  return keys.filter((k) => k in m).map((k) => `${k} ${Number(m[k]).toPrecision(3)}`).join(" · ");
}

async function refreshJobs() {
  if (!state.key) return;
  try {
    const { jobs } = await api("/v1/jobs?limit=20", { auth: true });
    $("#jobs tbody").innerHTML = jobs
      .map((j) => {
        const p = j.progress;
        const prog = p.total_steps ? `step ${p.step || 0}/${p.total_steps}` + (p.epoch != null ? `, epoch ${p.epoch + 1}` : "") : "";
        const link = j.mlflow_run_url ? `<a href="${j.mlflow_run_url}" target="_blank" rel="noopener">run</a>` : "";
        const cancel = ["queued", "running"].includes(j.state) ? `<button class="cancel" data-id="${j.id}">Cancel</button>` : "";
        return `<tr data-id="${j.id}"><td title="${j.id}">${j.name}</td><td>${j.recipe}</td><td class="state-${j.state}">${j.state}${j.reason ? ` <span class="muted">(${j.reason})</span>` : ""}</td><td>${prog}</td><td>${fmtMetrics(p.metrics)}</td><td>${link}</td><td>${cancel}</td></tr>`;
      })
      .join("");
    document.querySelectorAll("button.cancel").forEach((b) =>
      b.addEventListener("click", async () => {
        try { await api(`/v1/jobs/${b.dataset.id}/cancel`, { method: "POST", auth: true }); refreshJobs(); }
        catch (e) { showError("Cancel failed — " + e.message); }
      })
    );
  } catch (e) {
    showError("Jobs — " + e.message);
  }
}

setInterval(() => { if (!$("#panel-jobs").hidden) refreshJobs(); }, 2000);
loadModels();
loadRecipes();
