// The dtrain web view: renders what /api returns; data is only ever set as text, never as HTML.
"use strict";

const POLL_MS = 2000;
const COLOURS = ["#2f6fdb", "#23884b", "#c0392b", "#b26a00", "#7b3fb6", "#0f8a8a", "#7a8699"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

function seconds(value) {
  if (value < 10) return `${value.toFixed(1)}s`;
  const s = Math.round(value);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  return `${Math.floor(m / 60)}h ${m % 60}m`;
}

function when(epoch) {
  return epoch ? new Date(epoch * 1000).toLocaleString() : "-";
}

function isoTime(iso) {
  return iso ? new Date(iso).toLocaleTimeString() : "-";
}

function bytes(size) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = size, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return unit ? `${value.toFixed(1)} ${units[unit]}` : `${value} B`;
}

function number(value) {
  return Math.abs(value) >= 1e4 || (value !== 0 && Math.abs(value) < 1e-3)
    ? value.toExponential(3) : String(Number(value.toPrecision(5)));
}

function statusBadge(status) {
  return el("span", { class: `status ${status}` }, status);
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => el("tr", {}, ...cells.map((cell) =>
    cell instanceof Node && cell.tagName === "TD" ? cell : el("td", {}, cell)))));
}

function jobPath(name) {
  return `/jobs/${encodeURIComponent(name)}`;
}

// --- the jobs table ----------------------------------------------------------------------

async function refreshJobs() {
  const jobs = await getJSON("/api/jobs");
  document.getElementById("empty").hidden = jobs.length > 0;
  fillRows(document.querySelector("#jobs tbody"), jobs.map((job) => [
    el("a", { href: jobPath(job.name) }, job.name),
    statusBadge(job.status),
    job.secondary_status,
    when(job.creation_time),
    el("td", { class: "num" }, seconds(job.elapsed)),
    job.layout,
    Object.entries(job.last_metrics).map(([name, value]) => `${name}=${number(value)}`).join("  ")
      || "-",
    job.step_rate ? job.step_rate.text : "-",
  ]));
}

// --- a job's page --------------------------------------------------------------------------

const job = document.body.dataset.job;
const api = `/api/jobs/${encodeURIComponent(job)}`;
const charts = new Map();
let logSource = null, logOffset = null, terminal = false;
let logPicked = false;  // the reader chose a log: the page no longer chooses for them

function renderJob(detail) {
  const d = detail.description;
  terminal = detail.terminal;
  document.getElementById("status").replaceChildren(statusBadge(detail.status));
  const failure = document.getElementById("failure");
  failure.hidden = !d.FailureReason;
  failure.textContent = d.FailureReason || "";
  const summary = [
    ["Secondary status", d.SecondaryStatus],
    ["Elapsed", seconds(detail.elapsed)],
    ["Hosts × processes", detail.layout],
    ["Entry point", d.AlgorithmSpecification.EntryPoint],
    ["Instance type", d.ResourceConfig.InstanceType],
    ["Created", isoTime(d.CreationTime)],
    ["Hyperparameters", JSON.stringify(d.HyperParameters)],
    ["Job folder", d.JobFolder],
  ];
  document.getElementById("summary").replaceChildren(
    ...summary.flatMap(([key, value]) => [el("dt", {}, key), el("dd", {}, value ?? "-")]));
  fillRows(document.querySelector("#transitions tbody"), d.SecondaryStatusTransitions.map((t) => [
    t.Status, isoTime(t.StartTime),
    el("td", { class: "num" }, t.EndTime
      ? seconds((Date.parse(t.EndTime) - Date.parse(t.StartTime)) / 1000) : "…"),
    t.StatusMessage,
  ]));
  fillRows(document.querySelector("#hosts tbody"), d.Hosts.map((h) => [
    h.Name, h.Address, h.Interface, h.Hostname, (detail.host_ranks[h.Name] || []).join(", ") || "-",
  ]));
  renderLogSources(detail.logs, detail.failed_log);
  document.getElementById("model-artifacts").textContent = d.ModelArtifacts.S3ModelArtifacts
    ? `Model archive: ${d.ModelArtifacts.S3ModelArtifacts}` : "";
  fillRows(document.querySelector("#files tbody"), detail.files.map((f) => [
    el("a", { href: `${jobPath(job)}/files/${f.path.split("/").map(encodeURIComponent).join("/")}` },
      f.path),
    el("td", { class: "num" }, bytes(f.size)),
    when(f.modified),
  ]));
  document.getElementById("files-truncated").hidden = !detail.files_truncated;
  document.getElementById("describe").textContent = JSON.stringify(d, null, 2);
}

function renderLogSources(logs, failedLog) {
  const select = document.getElementById("log-source");
  const options = logs.map((r) => ({
    value: `${r.attempt}:${r.rank}`,
    label: `[${r.host || "?"},${r.rank}]` + (r.attempt > 1 ? ` attempt ${r.attempt}` : ""),
  }));
  options.push({ value: "controller", label: "controller" });
  const known = [...select.options].map((o) => o.value).join();
  if (known !== options.map((o) => o.value).join()) {
    const chosen = select.value;
    select.replaceChildren(...options.map((o) => el("option", { value: o.value }, o.label)));
    if (options.some((o) => o.value === chosen)) select.value = chosen;
  }
  // A failed job opens on the log of the rank that failed: the others show only what followed.
  if (failedLog && !logPicked && logSource !== failedLog
      && options.some((o) => o.value === failedLog)) {
    select.value = failedLog;
    chooseLog(failedLog);
  } else if (logSource === null) chooseLog(select.value);
}

function chooseLog(value) {
  logSource = value;
  logOffset = null;
  document.getElementById("log").textContent = "";
  refreshLog();
}

let logFetch = null;  // the read under way: {source, promise}

function refreshLog() {
  // One read of a log at a time: two from the same offset would show its lines twice.
  if (logFetch && logFetch.source === logSource) return logFetch.promise;
  const source = logSource;
  const promise = appendLog(source).finally(() => {
    if (logFetch && logFetch.promise === promise) logFetch = null;
  });
  logFetch = { source, promise };
  return promise;
}

async function appendLog(source) {
  const [attempt, rank] = source === "controller" ? ["", ""] : source.split(":");
  const params = new URLSearchParams({ attempt, rank });
  if (logOffset !== null) params.set("offset", logOffset);
  const chunk = await getJSON(`${api}/logs?${params}`);
  if (source !== logSource) return;  // another log was chosen meanwhile
  logOffset = chunk.offset;
  if (chunk.text) {
    const pre = document.getElementById("log");
    pre.append(document.createTextNode(chunk.text));
    if (document.getElementById("log-follow").checked) pre.scrollTop = pre.scrollHeight;
  }
}

function renderMetrics(series) {
  const names = Object.keys(series).sort();
  document.getElementById("no-metrics").hidden = names.length > 0;
  const box = document.getElementById("charts");
  names.forEach((name, index) => {
    const data = [series[name].step, series[name].value];
    if (charts.has(name)) { charts.get(name).setData(data); return; }
    const holder = el("div", { class: "chart", "data-metric": name }, el("h3", {}, name));
    box.append(holder);
    charts.set(name, new uPlot({
      width: 420, height: 220,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, {}],
      series: [{ label: "step" }, { label: name, stroke: COLOURS[index % COLOURS.length], width: 2 }],
    }, data, holder));
  });
}

async function renderViews() {
  const views = await getJSON(`${api}/views`);
  const plans = document.getElementById("plans");
  const timelines = document.getElementById("timelines");
  plans.replaceChildren();
  timelines.replaceChildren();
  for (const view of views) {
    if (view.kind === "plan-text") {
      plans.append(el("h3", {}, `printed in ${view.path}`), el("pre", { class: "plan" }, view.text));
      continue;
    }
    const content = await getJSON(`${api}/view?${new URLSearchParams({ path: view.path })}`);
    if (view.kind === "plan") plans.append(el("h3", {}, view.path), planTable(content.plan));
    else timelines.append(el("h3", {}, view.path), timelineSvg(content.events));
  }
  document.getElementById("plan-section").hidden = !plans.childElementCount;
  document.getElementById("timeline-section").hidden = !timelines.childElementCount;
}

const PEAK_PARTS = ["params", "grads", "master", "optimizer", "buffers", "activations"];

function planTable(plan) {
  const members = (k) => Object.values(plan.owners || {}).filter((owner) => owner === k).length;
  const ms = (value) => (plan.profiled ? (value * 1e3).toFixed(3) : "-");
  const peak = (stage) => (stage.peak_memory
    ? bytes(PEAK_PARTS.reduce((sum, part) => sum + (stage.peak_memory[part] || 0), 0)) : "-");
  const head = ["partition", "modules", "params", "compute ms", "comm ms", "memory",
    "peak in training", "cost"];
  const table = el("table", { class: "grid plan" }, el("thead", {}, el("tr", {},
    ...head.map((h) => el("th", {}, h)))), el("tbody"));
  fillRows(table.tBodies[0], (plan.stages || []).map((stage, k) => [
    String(k), String(members(k)), String(stage.param_count), ms(stage.compute_time),
    ms(stage.comm_time), bytes(stage.memory_bytes), peak(stage),
    plan.profiled ? stage.cost.toFixed(3) : "-",
  ]));
  return table;
}

const KINDS = { F: "forward", B: "backward", I: "input gradients", W: "weight gradients" };

function timelineSvg(events) {
  const NS = "http://www.w3.org/2000/svg";
  const rows = [...new Set(events.map((e) => e.row))]; // in the order the server sorted them
  const start = Math.min(...events.map((e) => e.ts));
  const end = Math.max(...events.map((e) => e.ts + e.dur));
  const width = 1100, label = 130, rowHeight = 26;
  const scale = (width - label - 10) / Math.max(end - start, 1);
  const cats = [...new Set(events.map((e) => e.cat))].sort();
  const svg = document.createElementNS(NS, "svg");
  const height = rows.length * rowHeight + 44;
  for (const [key, value] of Object.entries({ class: "timeline", width, height,
    viewBox: `0 0 ${width} ${height}` })) svg.setAttribute(key, value);
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(NS, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  rows.forEach((row, i) => add("text", { x: 0, y: i * rowHeight + 17 }, row));
  for (const e of events) {
    const x = label + (e.ts - start) * scale, w = Math.max(e.dur * scale, 1);
    const y = rows.indexOf(e.row) * rowHeight + 3;
    const rect = add("rect", { x, y, width: w, height: rowHeight - 6, rx: 2,
      fill: COLOURS[cats.indexOf(e.cat) % COLOURS.length] });
    rect.append(Object.assign(document.createElementNS(NS, "title"),
      { textContent: `${e.name}: ${(e.dur / 1000).toFixed(3)} ms` }));
    if (w > 18) add("text", { x: x + 3, y: y + 14, fill: "#fff" }, e.name);
  }
  const axis = rows.length * rowHeight + 14;
  add("text", { x: label, y: axis }, "0 ms");
  add("text", { x: width - 90, y: axis }, `${((end - start) / 1000).toFixed(2)} ms`);
  cats.forEach((cat, i) => {
    const x = label + i * 150;
    add("rect", { x, y: height - 16, width: 12, height: 12, fill: COLOURS[i % COLOURS.length] });
    add("text", { x: x + 16, y: height - 6 }, KINDS[cat] || cat || "other");
  });
  return svg;
}

async function refreshJob() {
  renderJob(await getJSON(api));
  renderMetrics(await getJSON(`${api}/metrics`));
  await refreshLog();
}

async function startJobPage() {
  document.getElementById("log-source").addEventListener("change", (e) => {
    logPicked = true;
    chooseLog(e.target.value);
  });
  await refreshJob();
  await renderViews();
  document.body.dataset.ready = "true";
  while (!terminal) {
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    await refreshJob();
    if (terminal) await renderViews();  // what the job wrote at its end
  }
}

async function startJobsPage() {
  await refreshJobs();
  document.body.dataset.ready = "true";
  setInterval(refreshJobs, POLL_MS * 2);
}

if (document.body.dataset.page === "jobs") startJobsPage();
else if (document.body.dataset.page === "job") startJobPage();
