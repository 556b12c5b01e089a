// The gpuctl web view: no framework, no inline script, no data in the page itself.
// Every request carries the bearer token from sessionStorage; the event stream is read
// with fetch() (EventSource cannot send a header). Data reaches the DOM through
// textContent and properties only, never innerHTML.
"use strict";

const KEY = "gpuctl.token";
const MAX_EVENTS = 40;
const $ = (id) => document.getElementById(id);

let state = null;
let refreshTimer = 0;
let pollTimer = 0;
let streamAbort = null;
let lastEventId = 0;
let retryMs = 1000;

function token() { return sessionStorage.getItem(KEY) || ""; }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

async function api(path, init) {
  const headers = { Authorization: "Bearer " + token(), ...((init && init.headers) || {}) };
  return fetch(path, { ...(init || {}), headers, cache: "no-store" });
}

async function reason(response) {
  try {
    const body = await response.json();
    return body.hint ? `${body.error} (${body.hint})` : body.error || response.statusText;
  } catch (e) {
    return response.statusText;
  }
}

// ------------------------------------------------------------------ sign in and out

function showLogin(message) {
  stopAll();
  sessionStorage.removeItem(KEY);
  $("view").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setConn("Not connected", "");
  $("token").focus();
}

function stopAll() {
  if (streamAbort) streamAbort.abort();
  streamAbort = null;
  clearTimeout(refreshTimer);
  clearTimeout(pollTimer);
}

async function start() {
  $("login").hidden = true;
  $("view").hidden = false;
  $("logout").hidden = false;
  const ok = await refresh();
  if (!ok) return;
  await loadEvents();
  follow();
}

function loginFailed(status, text) {
  if (status === 401) {
    showLogin("The agent refused this token (401): it is not the agent's token. " +
      "Use the value of GPUCTL_AGENT_TOKEN or GPUCTL_AGENT_READ_TOKEN on the GPU host.");
  } else {
    showLogin(`The agent answered ${status}: ${text}`);
  }
}

// ------------------------------------------------------------------ state

async function refresh() {
  clearTimeout(refreshTimer);
  clearTimeout(pollTimer);
  let response;
  try {
    response = await api("/ui/state");
  } catch (e) {
    setConn("Disconnected: the agent does not answer; retrying", "down");
    pollTimer = setTimeout(refresh, 3000);
    return false;
  }
  if (response.status === 401 || response.status === 403) {
    loginFailed(response.status, await reason(response));
    return false;
  }
  if (!response.ok) {
    $("notice").textContent = `The agent answered ${response.status}: ${await reason(response)}`;
    pollTimer = setTimeout(refresh, 3000);
    return true;
  }
  state = await response.json();
  render();
  // A start under way moves its bar every second; otherwise the events drive updates,
  // with a slow poll for what tells no event (another user's process on the GPU).
  pollTimer = setTimeout(refresh, loading() ? 1000 : 5000);
  return true;
}

function soon() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, 150);
}

function loading() {
  const svc = services();
  return svc.some((s) => s.decision === "LOADING" || s.phase === "starting" || s.phase === "stopping");
}

function host() {
  if (state.status && state.status.hosts.length) return state.status.hosts[0];
  return state.snapshot;
}

function recordOf(name) {
  return state.records.find((r) => r.service === name) || null;
}

// The rows of the services table: the config's services, else what the records hold.
function services() {
  if (!state) return [];
  if (state.status) {
    return state.status.services.map((s) => ({ ...s, phase: (recordOf(s.name) || {}).phase || "stopped" }));
  }
  return state.records.filter((r) => !r.service.startsWith("_")).map((r) => ({
    name: r.service, decision: null, reason: r.failed ? "its last start failed" : "",
    phase: r.phase, yields: null, idle_s: null, pids: r.pid ? [r.pid] : [],
  }));
}

// ------------------------------------------------------------------ drawing

function mib(v) {
  if (v === null || v === undefined) return "?";
  return v >= 1024 ? `${(v / 1024).toFixed(1)} GiB` : `${v} MiB`;
}

function span(s) {
  if (s === null || s === undefined) return "";
  s = Math.max(0, Math.round(s));
  if (s < 90) return `${s}s`;
  if (s < 5400) return `${Math.round(s / 60)}m`;
  if (s < 172800) return `${(s / 3600).toFixed(1)}h`;
  return `${Math.round(s / 86400)}d`;
}

function shortCommand(cmd) {
  const text = String(cmd || "");
  return text.length > 72 ? text.slice(0, 71) + "…" : text;
}

function render() {
  const h = host();
  const name = h && h.host ? h.host.hostname : h && h.name;
  $("host").textContent = name ? `· ${name}` : "";
  $("no-config").hidden = !!state.config;
  $("notice").textContent = h && h.error ? `${h.error}${h.hint ? " (" + h.hint + ")" : ""}` : $("notice").textContent;
  renderGpus(h);
  renderServices();
  renderQueue();
  // The first drawing with data, for bench/ui_bench.py (Navigation Timing's clock).
  if (!performance.getEntriesByName("gpuctl:first-render").length) performance.mark("gpuctl:first-render");
}

function renderGpus(h) {
  const box = $("gpus");
  box.replaceChildren();
  if (!h) return;
  const devices = h.devices && h.devices.length ? h.devices : [{ index: 0, name: "GPU", memory_used_mib: h.memory_used_mib, memory_total_mib: h.memory_total_mib }];
  devices.forEach((d, i) => {
    const procs = (h.processes || []).filter((p) => (p.gpu === null || p.gpu === undefined ? 0 : p.gpu) === d.index);
    const used = d.memory_used_mib || 0;
    const total = d.memory_total_mib || h.memory_total_mib || used || 1;
    const held = Math.min(used, procs.reduce((a, p) => a + (p.memory_mib || 0), 0));
    const unattributed = Math.max(0, used - held);
    const promised = Math.min(Math.max(0, total - used), d.memory_promised_mib || 0);
    const free = Math.max(0, total - used - promised);
    const parts = [["held", held], ["promised", promised], ["unattributed", unattributed]];
    const bar = el("div", { class: "bar", role: "img", "aria-label": `GPU ${d.index}: ${mib(held)} held, ${mib(promised)} promised, ${mib(unattributed)} unattributed, ${mib(free)} free of ${mib(total)}` });
    for (const [cls, v] of parts) {
      const seg = el("span", { class: cls });
      seg.style.width = `${(100 * v) / total}%`;
      bar.append(seg);
    }
    const legend = el("ul", { class: "legend" },
      el("li", { class: "held", text: `held ${mib(held)}` }),
      el("li", { class: "promised", text: `promised ${mib(promised)}` }),
      el("li", { class: "unattributed", text: `unattributed ${mib(unattributed)}` }),
      el("li", { class: "free", text: `free ${mib(free)} of ${mib(total)}` }));
    const rows = procs.map((p) => el("tr", {},
      el("td", { class: "num", "data-label": "PID", text: p.pid }),
      el("td", { "data-label": "User", text: p.user || "?" }),
      el("td", { "data-label": "Service", text: p.service || "—" }),
      el("td", { "data-label": "Command", title: p.command || "" }, el("code", { text: shortCommand(p.command) })),
      el("td", { class: "num", "data-label": "Memory", text: mib(p.memory_mib) })));
    const table = el("table", { class: "stack procs" },
      el("caption", { class: "muted", text: procs.length ? `Processes on GPU ${d.index}` : `No process on GPU ${d.index}` }),
      procs.length ? el("thead", {}, el("tr", {}, ...["PID", "User", "Service", "Command", "Memory"].map((t) => el("th", { scope: "col", text: t })))) : null,
      el("tbody", {}, ...rows));
    const extra = [d.utilization_pct, d.temperature_c, d.power_w];
    const figures = [
      extra[0] !== null && extra[0] !== undefined ? `${extra[0]}% busy` : null,
      extra[1] !== null && extra[1] !== undefined ? `${extra[1]} °C` : null,
      extra[2] !== null && extra[2] !== undefined ? `${extra[2]} W` : null,
    ].filter(Boolean).join(" · ");
    box.append(el("article", { class: "card gpu", "aria-label": `GPU ${d.index}` },
      el("h3", { text: `GPU ${d.index}: ${d.name || ""}` }, figures ? el("span", { class: "muted", text: ` ${figures}` }) : null),
      bar, legend, spark(i, total), el("div", { class: "scroll" }, table)));
  });
}

function spark(i, total) {
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 360 40");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  const pts = (state.history.points || []).filter((p) => p[1][i] !== null && p[1][i] !== undefined);
  svg.setAttribute("aria-label", `GPU memory used over the last hour (${pts.length} readings)`);
  const base = document.createElementNS(NS, "line");
  for (const [k, v] of [["x1", 0], ["y1", 39], ["x2", 360], ["y2", 39]]) base.setAttribute(k, v);
  svg.append(base);
  if (pts.length) {
    const now = state.now;
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", pts.map(([t, u]) => {
      const x = Math.max(0, 360 - (now - t) / 10);
      return `${x.toFixed(1)},${(39 - (38 * u[i]) / total).toFixed(1)}`;
    }).join(" "));
    svg.append(line);
  }
  return svg;
}

function progressCell(s) {
  const rec = recordOf(s.name);
  if (!rec || !(s.decision === "LOADING" || rec.phase === "starting")) return el("td", { "data-label": "Progress" });
  const elapsed = Math.max(0, state.now - rec.since);
  if (!rec.expected_s) {
    return el("td", { "data-label": "Progress" }, el("progress", { "aria-label": `${s.name} loading` }), el("span", { text: ` ${span(elapsed)}` }));
  }
  const fraction = Math.min(1, elapsed / rec.expected_s);
  const left = rec.expected_s - elapsed;
  const eta = left > 0 ? `about ${span(left)} left` : `${span(-left)} over the usual`;
  return el("td", { "data-label": "Progress" },
    el("progress", { max: 1, value: fraction.toFixed(3), "aria-label": `${s.name} loading, ${eta}` }),
    el("span", { text: ` ${eta}` }));
}

function canAct() {
  return state.actions && (state.role === "write" || state.role === "open");
}

function actionButtons(s) {
  if (!canAct()) return null;
  const cell = el("td", { class: "actions-col", "data-label": "Actions" });
  const box = el("div", { class: "actions" });
  const ops = state.config ? ["ensure", "stop", "resume"] : ["stop"];
  for (const op of ops) {
    box.append(el("button", { type: "button", "data-op": op, "data-service": s.name, text: op, "aria-label": `${op} ${s.name}`, onclick: () => act(op, s.name) }));
  }
  cell.append(box);
  return cell;
}

function renderServices() {
  const body = $("services").tBodies[0];
  const now = state.now;
  const rows = services().map((s) => {
    const rec = recordOf(s.name);
    const idle = rec && rec.last_used && s.phase === "running" ? now - rec.last_used : s.idle_s;
    return el("tr", { "data-service": s.name },
      el("th", { scope: "row", "data-label": "Service", text: s.name }),
      el("td", { "data-label": "Decision" }, el("span", { class: `decision d-${s.decision || "none"}`, text: s.decision || "—" })),
      el("td", { "data-label": "Phase", class: "phase", text: s.phase || "stopped" }),
      progressCell(s),
      el("td", { "data-label": "Idle", text: idle === null || idle === undefined ? "" : span(idle) }),
      el("td", { "data-label": "Would yield", text: s.yields === null || s.yields === undefined ? "" : s.yields ? "yes" : "no" }),
      el("td", { "data-label": "Reason", text: s.reason || "" }),
      actionButtons(s));
  });
  body.replaceChildren(...rows);
  $("services").classList.add("stack");
  $("services").tHead.rows[0].lastElementChild.hidden = !canAct();
}

function renderQueue() {
  const q = $("queue");
  q.replaceChildren(...state.queue.map((w) => el("li", { text: `${w.name} · ${mib(w.memory_mib)} · priority ${w.priority} · waiting ${span(state.now - w.since)}` })));
  if (!state.queue.length) q.append(el("li", { class: "muted", text: "Nobody waits." }));
}

// ------------------------------------------------------------------ events

function eventText(e) {
  const bits = [e.kind, e.service];
  if (e.before || e.after) bits.push(`${e.before || "?"} → ${e.after || "?"}`);
  if (e.decision) bits.push(e.decision);
  if (e.reason) bits.push(e.reason);
  if (e.who && e.who.entry) bits.push(`by ${e.who.entry}${e.who.user ? " (" + e.who.user + ")" : ""}`);
  return bits.filter(Boolean).join(" · ");
}

function addEvent(e, live) {
  const list = $("events");
  const at = new Date(e.at * 1000);
  const item = el("li", {}, el("time", { datetime: at.toISOString(), text: at.toLocaleTimeString() }), el("span", { text: eventText(e) }));
  list.prepend(item);
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
  if (live) soon();
}

async function loadEvents() {
  $("events").replaceChildren();
  const r = await api("/events?since=1h");
  if (!r.ok) return;
  const body = await r.json();
  for (const e of body.events.slice(-MAX_EVENTS)) addEvent(e, false);
  if (body.events.length) lastEventId = body.events[body.events.length - 1].id;
}

function setConn(text, cls) {
  const c = $("conn");
  c.textContent = text;
  c.className = `conn ${cls}`;
}

async function follow() {
  if (!token()) return;
  streamAbort = new AbortController();
  try {
    const r = await api(`/events?follow=1&since=1h&after=${lastEventId}`, { signal: streamAbort.signal });
    if (r.status === 401 || r.status === 403) { loginFailed(r.status, await reason(r)); return; }
    if (!r.ok || !r.body) throw new Error(`the event stream answered ${r.status}`);
    setConn("Live", "up");
    retryMs = 1000;
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        let data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("data:")) data += line.slice(5).trim();
          else if (line.startsWith("id:")) lastEventId = Number(line.slice(3).trim()) || lastEventId;
        }
        if (data) addEvent(JSON.parse(data), true);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") return;
  }
  if (!token()) return;
  setConn(`Disconnected: reconnecting in ${Math.round(retryMs / 1000)}s`, "down");
  setTimeout(() => { follow(); soon(); }, retryMs);
  retryMs = Math.min(retryMs * 2, 10000);
}

// ------------------------------------------------------------------ actions

async function act(op, service) {
  if (!window.confirm(`${op} ${service}?`)) return;
  $("notice").textContent = `${op} ${service}: asked…`;
  const r = await api(`/actions/${op}`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ service }),
  });
  let text;
  if (r.ok || r.status === 404 || r.status === 409) {
    const body = await r.json();
    text = body.message || body.error || "";
    if (body.hint) text += ` (${body.hint})`;
  } else {
    text = await reason(r);
  }
  $("notice").textContent = `${op} ${service}: ${text}`;
  soon();
}

// ------------------------------------------------------------------ start

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("token").value.trim();
    $("token").value = "";
    if (!value) return;
    sessionStorage.setItem(KEY, value);
    $("login-error").textContent = "";
    start();
  });
  $("logout").addEventListener("click", () => showLogin(""));
  if (token()) start();
  else showLogin("");
});
