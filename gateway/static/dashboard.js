// The Memory Gateway dashboard: reads the gateway's own API with the key typed in the login field.
"use strict";

const KINDS = ["goal", "constraints", "decisions", "tech_stack", "architecture", "preferences", "open_tasks", "facts"];
const PAGE = 25;
const $ = (id) => document.getElementById(id);
let session = { key: sessionStorage.getItem("gw-key") || "", tenant: sessionStorage.getItem("gw-tenant") || "" };
let unit = "tokens", offset = 0, lastStats = null, current = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "width") node.style.width = v; // through the CSSOM: the CSP forbids style attributes
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return node;
}

function say(text, error, action) {
  // An action's outcome is also said beside the conversation's buttons, where the user clicked.
  for (const s of action ? [$("status"), $("conv-status")] : [$("status")]) {
    s.textContent = text;
    s.classList.toggle("error", !!error);
  }
}

async function api(path, method, body) {
  const url = new URL(path, location.origin);
  if (session.tenant) url.searchParams.set("tenant", session.tenant);
  const opts = { method: method || "GET", headers: { Authorization: "Bearer " + session.key } };
  if (body !== undefined) { opts.body = JSON.stringify(body); opts.headers["Content-Type"] = "application/json"; }
  const r = await fetch(url, opts);
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    const message = (data.error && data.error.message) || r.statusText;
    throw new Error(r.status + ": " + message);
  }
  return data;
}

const fmt = (n) => Number(n || 0).toLocaleString("en-US");
const usd = (n) => "$" + Number(n || 0).toFixed(n >= 1 ? 2 : 4);
const pct = (saved, total) => (total > 0 ? Math.round((100 * saved) / total) + "%" : "–");
function when(t) {
  if (!t) return "never";
  const d = new Date(t * 1000);
  const today = d.toDateString() === new Date().toDateString();
  return today ? d.toLocaleTimeString() : d.toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
}

function card(label, value, sub) {
  return el("div", { class: "card" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value),
    el("div", { class: "sub" }, sub || ""));
}

function renderCards(s) {
  const saved = s.tokens_original - s.tokens_forwarded;
  const folds = Object.values(s.folds || {}).reduce((a, b) => a + b, 0);
  $("cards").replaceChildren(
    card("requests with memory", fmt(s.requests), s.admin ? (s.tenant ? "tenant " + s.tenant : "all tenants") : "this key"),
    card("tokens original", fmt(s.tokens_original), "what the clients sent"),
    card("tokens forwarded", fmt(s.tokens_forwarded), "what went upstream"),
    card("tokens saved", fmt(saved), pct(saved, s.tokens_original) + " of the original"),
    s.cost_original || !s.tokens_original
      ? card("estimated input cost", usd(s.cost_forwarded), "instead of " + usd(s.cost_original))
      : card("estimated input cost", "–", "no price configured for these models (models.<name> in the config)"),
    card("folds", fmt(folds), "summaries written by this process"));
}

function drawChart(series) {
  const svg = $("chart"), W = 900, H = 260, L = 64, R = 12, T = 12, B = 28;
  const ns = "http://www.w3.org/2000/svg";
  const node = (tag, attrs, text) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  };
  svg.replaceChildren();
  const o = unit === "tokens" ? "tokens_original" : "cost_original";
  const f = unit === "tokens" ? "tokens_forwarded" : "cost_forwarded";
  if (!series.length) {
    svg.append(node("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" },
      "No requests with a conversation id yet: send one with an X-Conversation-Id header."));
    svg.dataset.points = "0";
    return;
  }
  // Cumulative sums: the gap between the two lines is what the gateway saved so far.
  let so = 0, sf = 0;
  const lead = Math.max(1, Math.min(60, (series[series.length - 1].t - series[0].t) / 20));
  const pts = [{ t: series[0].t - lead, o: 0, f: 0 }];
  for (const p of series) { so += p[o]; sf += p[f]; pts.push({ t: p.t, o: so, f: sf }); }
  const t0 = pts[0].t, t1 = Math.max(pts[pts.length - 1].t, t0 + 1), ymax = Math.max(so, 1e-9) * 1.08;
  const clock = t1 - t0 < 3600 ? { hour: "2-digit", minute: "2-digit", second: "2-digit" }
    : t1 - t0 < 86400 ? { hour: "2-digit", minute: "2-digit" } : { month: "short", day: "numeric", hour: "2-digit" };
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4, yy = y(v);
    svg.append(node("line", { x1: L, x2: W - R, y1: yy, y2: yy, class: "grid" }));
    svg.append(node("text", { x: L - 6, y: yy + 4, "text-anchor": "end", class: "axis" },
      unit === "tokens" ? fmt(Math.round(v)) : usd(v)));
  }
  for (const [t, anchor] of [[t0, "start"], [(t0 + t1) / 2, "middle"], [t1, "end"]]) {
    svg.append(node("text", { x: x(t), y: H - 8, "text-anchor": anchor, class: "axis" },
      new Date(t * 1000).toLocaleString([], clock)));
  }
  const line = (k) => pts.map((p, i) => (i ? "L" : "M") + x(p.t).toFixed(1) + "," + y(p[k]).toFixed(1)).join(" ");
  svg.append(node("path", { d: line("o") + ` L${x(pts[pts.length - 1].t).toFixed(1)},${y(0)} L${x(t0)},${y(0)} Z`, class: "original-area" }));
  svg.append(node("path", { d: line("o"), class: "original" }));
  svg.append(node("path", { d: line("f"), class: "forwarded" }));
  svg.dataset.points = String(pts.length);
}

// Whether the next request carries an edit: only a rewritten request holds state and summary; one sent
// whole (under the thresholds, or cheaper with the provider's cache) goes as the client sent it.
function carried() {
  const last = current && current.last;
  return last && last.context === "rewritten"
    ? "the next request of this conversation carries it."
    : "it goes into this conversation's requests once they are rewritten (its last one was sent "
      + (last ? last.context + (last.reason ? ", " + last.reason : "") : "whole") + ").";
}

function decision(last) {
  if (!last) return el("span", { class: "muted" }, "–");
  const tag = el("span", { class: "tag " + last.context }, last.context);
  return el("span", {}, tag, " ", el("span", { class: "muted" }, last.reason || ""));
}

function renderTable(list) {
  const rows = list.data.map((c) => {
    const saved = c.tokens_original - c.tokens_forwarded;
    const share = c.tokens_original ? c.tokens_forwarded / c.tokens_original : 1;
    const covered = c.messages ? c.summary.covers / c.messages : 0;
    const tr = el("tr", { "data-id": c.id, "data-tenant": c.tenant },
      el("td", {}, el("code", {}, c.id), session.tenant || !document.body.classList.contains("admin") ? "" :
        el("div", { class: "muted" }, c.tenant)),
      el("td", { class: "num" }, fmt(c.messages)),
      el("td", {}, `${fmt(c.summary.covers)} of ${fmt(c.messages)}`,
        el("span", { class: "bar" }, el("i", { width: `${Math.round(covered * 100)}%` }))),
      el("td", { class: "num" }, `${fmt(c.tokens_original)} → ${fmt(c.tokens_forwarded)}`,
        el("div", { class: "muted" }, saved > 0 ? `saved ${pct(saved, c.tokens_original)}` : `${Math.round(share * 100)}% sent`)),
      el("td", { class: "num" }, c.summarizer_tokens ? usd(c.summarizer_usd) : "none",
        el("div", { class: "muted" }, c.summarizer_tokens ? fmt(c.summarizer_tokens) + " tokens" : "local summarizer")),
      el("td", {}, c.summary.version ? when(c.summary.folded_at) : "never",
        c.summary.edited ? el("div", { class: "muted" }, "summary edited") : ""),
      el("td", {}, decision(c.last)),
      el("td", {}, when(c.last_used)));
    tr.addEventListener("click", () => openConversation(c.id, c.tenant));
    return tr;
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No conversations for this key yet.")));
  $("conversations").tBodies[0].replaceChildren(...rows);
  $("conv-count").textContent = `(${fmt(list.total)})`;
  $("prev").disabled = offset === 0;
  $("next").disabled = offset + PAGE >= list.total;
}

async function refresh(done) {
  if (!session.key) return;
  try {
    const stats = await api("/gateway/stats");
    lastStats = stats;
    document.body.classList.toggle("admin", !!stats.admin);
    renderCards(stats);
    drawChart(stats.series);
    renderTable(await api(`/gateway/conversations?offset=${offset}&limit=${PAGE}`));
    $("overview").hidden = false;
    $("logout").hidden = false;
    say(done || `Updated ${new Date().toLocaleTimeString()}. Click a conversation to see what the gateway keeps of it.`);
  } catch (e) {
    say("Could not load: " + e.message, true);
  }
}

function messageText(m) {
  const c = m.content ?? m.output ?? "";
  if (typeof c === "string") return c;
  if (Array.isArray(c)) return c.map((b) => b.text ?? (b.type ? `[${b.type}]` : "")).join(" ");
  return JSON.stringify(c);
}

async function openConversation(id, tenant) {
  const saved = session.tenant;
  if (document.body.classList.contains("admin")) session.tenant = tenant;
  try {
    const c = await api(`/gateway/conversations/${encodeURIComponent(id)}`);
    current = { id, tenant, state: {}, last: c.last };
    $("conv-status").textContent = "";
    $("conv-id").textContent = id;
    const s = c.stats || {};
    $("conv-facts").textContent = `${c.dialect || "?"} · ${fmt(c.messages)} messages, ${fmt(c.tokens)} tokens stored · ` +
      `${fmt(s.requests)} requests, ${fmt(s.tokens_original)} → ${fmt(s.tokens_forwarded)} tokens · ` +
      `summarizer ${s.summarizer_tokens_in ? usd(c.summarizer_usd) : "local, no tokens"} · last request: ` +
      (c.last ? c.last.context + (c.last.reason ? " (" + c.last.reason + ")" : "") : "–");
    $("summary").value = c.summary ? c.summary.text : "";
    $("summary-meta").textContent = c.summary ?
      `covers messages 0–${c.summary.covers - 1}, version ${c.summary.version}${c.summary.edited ? ", edited" : ""}` +
      (c.last_fold ? `, last fold ${when(c.last_fold)}` : "") : "(none yet)";
    const boxes = KINDS.map((k) => {
      const items = (c.state[k] || []).filter((i) => !i.superseded_by).map((i) => i.text);
      current.state[k] = items.join("\n");
      // Tall enough for its items as they wrap (about 60 characters a line at this width).
      const lines = items.reduce((n, t) => n + Math.ceil(Math.max(t.length, 1) / 60), 0);
      const box = el("textarea", { id: "state-" + k, rows: Math.max(1, lines), "data-kind": k });
      box.value = current.state[k];
      return el("div", {}, el("label", { for: "state-" + k }, k.replace("_", " ")), box);
    });
    $("state").replaceChildren(...boxes);
    const w = c.window;
    $("window-meta").textContent = `messages ${w.start}–${w.end - 1} are sent verbatim (at least the last ${w.keep_recent})`;
    const from = Math.max(w.start, w.end - 50);
    const page = await api(`/gateway/conversations/${encodeURIComponent(id)}/messages?offset=${from}&limit=50`);
    $("window").replaceChildren(...page.data.map((d) => el("li", {}, el("b", {}, `#${d.index} ${d.role}`), messageText(d.message))));
    $("excerpts").textContent = (c.last && c.last.excerpts) || "none: its last request recalled no earlier excerpts";
    $("conversation").hidden = false;
    $("conversation").scrollIntoView({ behavior: "instant", block: "start" });
  } catch (e) {
    say("Could not open " + id + ": " + e.message, true);
  } finally {
    session.tenant = saved;  // the admin's own filter (or none) again
  }
}

async function act(label, fn) {
  if (!current) return;
  const saved = session.tenant;
  if (document.body.classList.contains("admin")) session.tenant = current.tenant;
  try {
    say(await fn(), false, true);
  } catch (e) {
    say(label + " failed: " + e.message, true, true);
  } finally {
    session.tenant = saved;
  }
}

const convPath = () => `/gateway/conversations/${encodeURIComponent(current.id)}`;

function wire() {
  $("key").value = session.key;
  $("tenant").value = session.tenant;
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    session = { key: $("key").value.trim(), tenant: $("tenant").value.trim() };
    sessionStorage.setItem("gw-key", session.key);
    sessionStorage.setItem("gw-tenant", session.tenant);
    offset = 0;
    $("conversation").hidden = true;
    refresh();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.clear();
    location.reload();
  });
  for (const b of document.querySelectorAll(".toggle button")) {
    b.addEventListener("click", () => {
      unit = b.dataset.unit;
      for (const o of document.querySelectorAll(".toggle button")) o.classList.toggle("on", o === b);
      if (lastStats) drawChart(lastStats.series);
    });
  }
  $("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); refresh(); });
  $("next").addEventListener("click", () => { offset += PAGE; refresh(); });
  $("close").addEventListener("click", () => { $("conversation").hidden = true; current = null; });
  $("save-summary").addEventListener("click", () => act("Saving the summary", async () => {
    await api(convPath() + "/summary", "PUT", { text: $("summary").value });
    return "Summary saved: " + carried();
  }));
  $("save-state").addEventListener("click", () => act("Saving the state", async () => {
    const edits = {};
    for (const k of KINDS) {
      const value = $("state-" + k).value;
      if (value !== current.state[k]) edits[k] = value.split("\n").map((s) => s.trim()).filter(Boolean);
    }
    if (!Object.keys(edits).length) return "Nothing changed in the state.";
    await api(convPath() + "/state", "PUT", edits);
    for (const k of Object.keys(edits)) current.state[k] = $("state-" + k).value;
    return "State saved (" + Object.keys(edits).join(", ") + "): " + carried();
  }));
  $("fold").addEventListener("click", () => act("Folding", async () => {
    const r = await api(convPath() + "/fold", "POST");
    return r.queued ? "Fold queued: older turns are being summarised." : "A fold is already queued.";
  }));
  $("forget").addEventListener("click", () => act("Forgetting", async () => {
    if (!confirm(`Forget conversation ${current.id}? Its stored history, summary and stats are deleted.`)) return "Kept.";
    await api(convPath(), "DELETE");
    $("conversation").hidden = true;
    const id = current.id;
    current = null;
    const done = `Conversation ${id} forgotten.`;
    setTimeout(() => refresh(done));
    return done;
  }));
  if (session.key) refresh();
}

document.addEventListener("DOMContentLoaded", wire);
