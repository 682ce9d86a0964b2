// The inferplane console: one page, hash routes, every figure from the gateway's own JSON APIs,
// called with the session cookie and its CSRF header. Text from the server is only ever set as
// textContent (never parsed as HTML): a key's or a model's name cannot inject a script.
"use strict";

const PAGE_SIZE = 50;
let session = null; // GET /console/api/session: role, tenant, scopes, csrf

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value === true) node.setAttribute(name, "");
    else if (value !== false && value !== null && value !== undefined) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// A request with the session's CSRF header; an ApiError carrying the server's message unless it succeeded.
async function send(method, path, body) {
  const headers = { "X-CSRF-Token": session ? session.csrf : "" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, credentials: "same-origin",
                                       body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) {
    const text = await response.text();
    let data = null;
    try { data = JSON.parse(text); } catch (e) { /* the raw text */ }
    const detail = data && data.error ? data.error.message : (data && data.detail ? JSON.stringify(data.detail) : text);
    throw new ApiError(response.status, `${response.status}: ${detail}`);
  }
  return response;
}

async function api(method, path, body) {
  const text = await (await send(method, path, body)).text();
  try { return text ? JSON.parse(text) : null; } catch (e) { return { raw: text }; }
}

const can = (scope) => session && session.scopes.includes(scope);
const isAdmin = () => session && session.role === "platform-admin";
const fmt = (value) => value === null || value === undefined ? "—" : String(value);
const when = (iso) => iso ? new Date(iso).toLocaleString() : "—";

function pages() {
  if (!session) return [];
  if (isAdmin()) {
    return [["deployments", "Deployments", deploymentsPage], ["models", "Models", modelsPage],
            ["tenants", "Tenants", tenantsPage], ["keys", "Keys", keysPage], ["health", "Health", healthPage]];
  }
  const list = [["playground", "Playground", playgroundPage], ["usage", "Usage", usagePage]];
  if (can("admin")) list.push(["keys", "Keys", keysPage], ["adapters", "Adapters", adaptersPage]);
  list.push(["alerts", "Alerts", alertsPage]);
  return list;
}

function errorBox(error) { return el("p", { class: "error", role: "alert" }, error.message || String(error)); }

let refreshTimer = null;

async function route() {
  clearInterval(refreshTimer);
  const main = document.getElementById("main");
  const name = location.hash.replace(/^#\/?/, "") || "";
  if (!session) { renderNav(); main.replaceChildren(signInPage()); return; }
  const available = pages();
  const page = available.find(([id]) => id === name);
  renderNav(name);
  if (!page) {
    if (name && name !== "signin") {
      main.replaceChildren(el("section", {}, el("h1", {}, "Not available"),
        el("p", { class: "error", role: "alert" }, `This session (${session.role}) has no page "${name}".`)));
      return;
    }
    location.hash = `#/${available[0][0]}`;
    return;
  }
  // Each visit renders into a view of its own: a page still loading when the user moves on fills a
  // view no longer on the screen, never the next page's.
  const view = el("div", { class: "view" }, el("p", {}, "Loading…"));
  main.replaceChildren(view);
  try {
    await page[2](view);
  } catch (error) {
    if (!view.isConnected) return;
    if (error.status === 401) { session = null; route(); return; }
    view.replaceChildren(errorBox(error));
  }
}

function renderNav(current) {
  const nav = document.getElementById("nav");
  nav.replaceChildren(...pages().map(([id, label]) =>
    el("a", { href: `#/${id}`, class: id === current ? "active" : null, "data-page": id }, label)));
  document.getElementById("who").textContent = session
    ? (isAdmin() ? "platform admin" : `tenant ${session.tenant} (${session.scopes.join(", ")})`) : "";
  document.getElementById("sign-out").hidden = !session;
}

// -- sign-in ------------------------------------------------------------------------------------

function signInPage() {
  const input = el("input", { type: "password", id: "credential", autocomplete: "off",
                              placeholder: "ip_... API key, the admin key, or an admin token" });
  const message = el("p", { class: "error", role: "alert" });
  const form = el("form", { onsubmit: async (event) => {
    event.preventDefault();
    message.textContent = "";
    try {
      session = await api("POST", "/console/api/session", { key: input.value });
      input.value = "";
      location.hash = "#/";
      route();
    } catch (error) { message.textContent = error.message; }
  } }, el("label", {}, "Credential", input), el("button", { type: "submit", id: "sign-in" }, "Sign in"), message);
  return el("section", { class: "signin" }, el("h1", {}, "Sign in to inferplane"),
    el("p", { class: "muted" }, "The key is sent once and exchanged for a session; it is not kept in the page."), form);
}

async function signOut() {
  try { await api("DELETE", "/console/api/session"); } catch (e) { /* signed out either way */ }
  session = null;
  location.hash = "#/signin";
  route();
}

// -- playground ---------------------------------------------------------------------------------

async function playgroundPage(main) {
  const models = (await api("GET", "/v1/models")).data;
  const model = el("select", { id: "model" }, models.map((m) =>
    el("option", { value: m.id }, m.parent ? `${m.id} (adapter on ${m.parent})` : m.id)));
  const mode = el("select", { id: "mode" }, el("option", { value: "chat" }, "chat"),
    el("option", { value: "completion" }, "completion"));
  const temperature = el("input", { id: "temperature", type: "number", step: "0.1", min: "0", max: "2", value: "0.8" });
  const topP = el("input", { id: "top_p", type: "number", step: "0.05", min: "0", max: "1", value: "0.95" });
  const maxTokens = el("input", { id: "max_tokens", type: "number", min: "1", value: "64" });
  const schema = el("textarea", { id: "schema", rows: "3", placeholder: "optional JSON schema for structured output" });
  const prompt = el("textarea", { id: "prompt", rows: "4" }, "Write a haiku about GPUs.");
  const output = el("div", { id: "output", "aria-live": "polite" });
  const stats = el("div", { class: "stats", id: "stats" });
  const send = el("button", { id: "send" }, "Send");
  send.addEventListener("click", async () => {
    send.disabled = true;
    output.textContent = "";
    stats.textContent = "";
    delete stats.dataset.done;
    try {
      await stream({ model: model.value, mode: mode.value, temperature: Number(temperature.value),
                     top_p: Number(topP.value), max_tokens: Number(maxTokens.value), schema: schema.value.trim(),
                     prompt: prompt.value }, output, stats);
    } catch (error) {
      output.append(errorBox(error));
      stats.dataset.done = "error";
    } finally { send.disabled = false; }
  });
  main.replaceChildren(el("section", {}, el("h1", {}, "Playground"),
    el("div", {}, el("label", {}, "Model", model), el("label", {}, "Mode", mode),
       el("label", {}, "Temperature", temperature), el("label", {}, "top_p", topP),
       el("label", {}, "max_tokens", maxTokens)),
    el("label", { style: "display:flex" }, "Prompt", prompt), el("label", { style: "display:flex" }, "JSON schema", schema),
    send, el("h2", { style: "margin-top:12px" }, "Answer"), output, stats));
}

async function stream(settings, output, stats) {
  const body = { model: settings.model, max_tokens: settings.max_tokens, temperature: settings.temperature,
                 top_p: settings.top_p, stream: true, stream_options: { include_usage: true } };
  if (settings.mode === "chat") body.messages = [{ role: "user", content: settings.prompt }];
  else body.prompt = settings.prompt;
  if (settings.schema) {
    let parsed;
    try { parsed = JSON.parse(settings.schema); } catch (e) { throw new Error(`JSON schema: not JSON (${e.message})`); }
    body.response_format = { type: "json_schema", json_schema: { name: "console", schema: parsed } };
  }
  const path = settings.mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const started = performance.now();
  const response = await send("POST", path, body);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "", first = null, pieces = 0, usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const text = settings.mode === "chat" ? (choice.delta && choice.delta.content) : choice.text;
          if (text) {
            if (first === null) first = performance.now();
            pieces += 1;
            output.append(text);
          }
        }
      }
    }
  }
  const finished = performance.now();
  const tokens = usage ? usage.completion_tokens : pieces;
  const decodeSeconds = first === null ? 0 : (finished - first) / 1000;
  stats.textContent = `TTFT ${first === null ? "—" : Math.round(first - started) + " ms"} · ` +
    `${tokens} tokens · ${decodeSeconds > 0 && tokens > 1 ? ((tokens - 1) / decodeSeconds).toFixed(1) : "—"} tokens/s`;
  stats.dataset.done = "true";
}

// -- tables with pages ---------------------------------------------------------------------------

function pagedTable(columns, rows, id) {
  const holder = el("div", { id });
  let page = 0;
  const pagesCount = Math.max(1, Math.ceil(rows.length / PAGE_SIZE));
  function draw() {
    const shown = rows.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE);
    const table = el("table", {}, el("thead", {}, el("tr", {}, columns.map(([label]) => el("th", {}, label)))),
      el("tbody", {}, shown.map((row) => el("tr", {}, columns.map(([, cell]) => el("td", {}, cell(row)))))));
    const pager = rows.length > PAGE_SIZE ? el("div", { class: "pager" },
      el("button", { class: "plain", disabled: page === 0, onclick: () => { page -= 1; draw(); } }, "Previous"),
      `page ${page + 1} of ${pagesCount} (${rows.length} rows)`,
      el("button", { class: "plain", disabled: page + 1 >= pagesCount, onclick: () => { page += 1; draw(); } }, "Next"))
      : el("div", { class: "pager" }, `${rows.length} rows`);
    holder.replaceChildren(table, pager);
  }
  draw();
  return holder;
}

// -- keys ---------------------------------------------------------------------------------------

async function keysPage(main) {
  const keys = (await api("GET", "/admin/v1/keys")).data;
  keys.sort((a, b) => (b.created_at || "").localeCompare(a.created_at || ""));
  const shown = el("div", { id: "new-key" });
  const fields = {
    tenant_id: el("input", { id: "key-tenant", value: session.tenant || "", disabled: !isAdmin() }),
    name: el("input", { id: "key-name", placeholder: "ci-bot" }),
    requests_per_minute: el("input", { id: "key-rpm", type: "number", min: "1" }),
    tokens_per_minute: el("input", { id: "key-tpm", type: "number", min: "1" }),
    max_concurrent_sequences: el("input", { id: "key-seqs", type: "number", min: "1" }),
  };
  const band = el("select", { id: "key-band" }, ["", ...session.bands].map((b) =>
    el("option", { value: b }, b || "(tenant's)")));
  const scopes = ["infer", "models:read", "admin"].map((scope) =>
    el("input", { type: "checkbox", value: scope, checked: scope !== "admin", "data-scope": scope }));
  const create = el("form", { id: "create-key", onsubmit: async (event) => {
    event.preventDefault();
    const body = { scopes: scopes.filter((box) => box.checked).map((box) => box.value) };
    for (const [name, input] of Object.entries(fields)) {
      if (input.value === "") continue;
      body[name] = input.type === "number" ? Number(input.value) : input.value;
    }
    if (!isAdmin()) delete body.tenant_id;
    if (band.value) body.priority = band.value;
    try {
      const created = await api("POST", "/admin/v1/keys", body);
      await keysPage(main);
      document.getElementById("new-key").replaceChildren(el("p", {}, "New key (shown once, copy it now):"),
        el("div", { class: "secret", id: "new-key-secret" }, created.key));
    } catch (error) { shown.replaceChildren(errorBox(error)); }
  } }, Object.entries(fields).map(([name, input]) => el("label", {}, name, input)), el("label", {}, "priority", band),
    el("div", {}, scopes.map((box) => el("label", { style: "flex-direction:row;gap:4px" }, box, box.value))),
    el("button", { type: "submit", id: "create-key-button" }, "Create key"));
  const columns = [
    ["id", (k) => k.id], ["tenant", (k) => k.tenant_id], ["name", (k) => fmt(k.name)], ["scopes", (k) => k.scopes.join(" ")],
    ["limits", (k) => `${fmt(k.requests_per_minute)} req/min · ${fmt(k.tokens_per_minute)} tok/min · ` +
                      `${fmt(k.max_concurrent_sequences)} seqs · band ${fmt(k.priority)}`],
    ["last used", (k) => when(k.last_used_at)],
    ["state", (k) => k.revoked_at ? el("span", { class: "bad" }, "revoked") : el("span", { class: "ok" }, "active")],
    ["", (k) => k.revoked_at ? "" : el("button", { class: "plain", "data-revoke": k.id, onclick: async () => {
      if (!confirm(`Revoke key ${k.id}? Requests with it are refused at once.`)) return;
      try { await api("DELETE", `/admin/v1/keys/${encodeURIComponent(k.id)}`); await keysPage(main); }
      catch (error) { shown.replaceChildren(errorBox(error)); }
    } }, "Revoke")],
  ];
  main.replaceChildren(el("section", {}, el("h1", {}, "API keys"), create, shown),
    el("section", {}, el("h2", {}, "Keys"), pagedTable(columns, keys, "keys-table")));
}

// -- usage --------------------------------------------------------------------------------------

async function usagePage(main) {
  const usage = await api("GET", "/v1/usage?days=7");
  const limits = usage.limits || {};
  const models = [...new Set(usage.data.map((r) => r.model))].sort();
  const minutes = [...new Set(usage.data.map((r) => r.minute))].sort();
  const times = minutes.map((m) => Date.parse(m) / 1000);
  const series = (field) => models.map((model) => minutes.map((minute) => {
    const row = usage.data.find((r) => r.model === model && r.minute === minute);
    return row ? (field === "tokens" ? row.prompt_tokens + row.completion_tokens : row.requests) : 0;
  }));
  const totals = usage.totals;
  const limitRows = [["requests per minute (key)", limits.requests_per_minute],
    ["tokens per minute (key)", limits.tokens_per_minute], ["sequences in flight (key)", limits.max_concurrent_sequences],
    ["sequences in flight (tenant)", limits.tenant_max_concurrent_sequences], ["priority band", limits.priority],
    ["monthly token quota", limits.monthly_token_quota], ["tokens used this month", limits.monthly_tokens_used]]
    .map(([label, value], i) => [label, value === null || value === undefined ? (i < 4 || i === 5 ? "no limit" : "—") : value]);
  const chartTokens = el("div", { id: "chart-tokens" });
  const chartRequests = el("div", { id: "chart-requests" });
  main.replaceChildren(
    el("section", {}, el("h1", {}, `Usage of tenant ${usage.tenant}`),
      el("p", { id: "usage-totals" }, `Last 7 days: ${totals.requests} requests, ${totals.prompt_tokens} prompt tokens, `
        + `${totals.completion_tokens} completion tokens.`)),
    el("section", {}, el("h2", {}, "Tokens per minute, by model"), chartTokens,
      el("h2", {}, "Requests per minute, by model"), chartRequests),
    el("section", {}, el("h2", {}, "Limits"), el("table", { id: "limits" }, el("tbody", {},
      limitRows.map(([label, value]) => el("tr", {}, el("th", {}, label), el("td", {}, fmt(value))))))),
    el("section", {}, el("h2", {}, "By model"), pagedTable([["model", (r) => r[0]], ["requests", (r) => r[1]],
      ["prompt tokens", (r) => r[2]], ["completion tokens", (r) => r[3]]],
      models.map((model) => usage.data.filter((r) => r.model === model).reduce((acc, r) =>
        [model, acc[1] + r.requests, acc[2] + r.prompt_tokens, acc[3] + r.completion_tokens], [model, 0, 0, 0])),
      "usage-table")));
  if (times.length) {
    chart(chartTokens, times, models, series("tokens"), "tokens");
    chart(chartRequests, times, models, series("requests"), "requests");
  } else {
    chartTokens.textContent = chartRequests.textContent = "No requests yet.";
  }
}

const PALETTE = ["#2357c6", "#c2410c", "#15803d", "#7e22ce", "#b91c1c", "#0e7490"];

function chart(target, times, names, values, unit) {
  const opts = { width: Math.min(1000, target.parentElement.clientWidth - 32), height: 220,
    series: [{}, ...names.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length], width: 2,
                                               points: { show: true } }))],
    scales: { x: { time: true, range: (u, min, max) => [min - 1800, max + 300] } },
    axes: [{}, { label: unit }] };
  new uPlot(opts, [times, ...values], target);
}

// -- adapters and alerts -------------------------------------------------------------------------

async function adaptersPage(main) {
  const adapters = (await api("GET", "/admin/v1/adapters")).data;
  main.replaceChildren(el("section", {}, el("h1", {}, "LoRA adapters"), pagedTable([
    ["name", (a) => a.name], ["version", (a) => fmt(a.version)], ["base", (a) => fmt(a.base_model)],
    ["rank", (a) => fmt(a.lora_rank)], ["status", (a) => fmt(a.status)], ["visibility", (a) => fmt(a.visibility)],
    ["created", (a) => when(a.created_at)],
  ], adapters, "adapters-table")));
}

async function alertsPage(main) {
  const alerts = (await api("GET", "/v1/alerts")).data;
  const sections = [el("section", {}, el("h1", {}, "Alerts"), pagedTable([
    ["alert", (a) => fmt(a.labels.alertname)], ["status", (a) => fmt(a.status)], ["severity", (a) => fmt(a.labels.severity)],
    ["summary", (a) => fmt(a.annotations.summary)], ["since", (a) => when(a.starts_at)],
    ["deliveries", (a) => a.deliveries.length ? a.deliveries.map((d) => el("div", {},
      `${d.webhook_url}: ${d.state}, ${fmt(d.outcome)} after ${d.attempts} attempt(s)`)) : "none"],
  ], alerts, "alerts-table"))];
  if (can("admin")) {
    const hooks = (await api("GET", `/admin/v1/tenants/${encodeURIComponent(session.tenant)}/webhooks`)).data;
    const url = el("input", { id: "webhook-url", type: "url", placeholder: "https://hooks.example.com/inferplane", size: "50" });
    const message = el("p", {});
    sections.push(el("section", {}, el("h2", {}, "Webhook"),
      pagedTable([["url", (h) => h.url], ["created", (h) => when(h.created_at)]], hooks, "webhooks-table"),
      el("form", { id: "webhook-form", onsubmit: async (event) => {
        event.preventDefault();
        try {
          const set = await api("PUT", `/admin/v1/tenants/${encodeURIComponent(session.tenant)}/webhooks`,
                                { url: url.value });
          await alertsPage(main);
          if (set && set.secret) {  // generated here: shown this once, as a new key is
            document.getElementById("webhooks-table").after(el("p", {}, "Signing secret (shown once, copy it now):"),
              el("div", { class: "secret", id: "webhook-secret" }, set.secret));
          }
        } catch (error) { message.replaceChildren(errorBox(error)); }
      } }, el("label", {}, "Webhook URL", url), el("button", { type: "submit", id: "set-webhook" }, "Set webhook"),
        message)));
  }
  main.replaceChildren(...sections);
}

// -- operator pages -------------------------------------------------------------------------------

async function deploymentsPage(main) {
  async function draw() {
    const rows = (await api("GET", "/console/api/deployments")).data;
    const table = pagedTable([
      ["model", (d) => d.model], ["deployment", (d) => d.deployment], ["runtime", (d) => fmt(d.runtime)],
      ["kind", (d) => fmt(d.kind)],
      ["replicas ready / desired", (d) => el("span", { "data-replicas": d.deployment }, `${d.ready} / ${d.desired}`)],
      ["autoscaler", (d) => d.autoscaler ? `wants ${d.autoscaler.desired} of max ${d.autoscaler.max}` +
        ` · load ${d.autoscaler.saturation === null ? "—" : d.autoscaler.saturation.toFixed(2)}` +
        (d.autoscaler.panic ? " · panic" : "") : "off"],
      ["conditions", (d) => d.conditions === null ? "—" : d.conditions.map((c) => el("div", { title: fmt(c.message) },
        el("span", { class: c.status === "True" ? "ok" : "bad" }, `${c.type}=${c.status}`), c.reason ? ` (${c.reason})` : ""))],
      ["routing", (d) => fmt(d.routing_policy)], ["context", (d) => fmt(d.max_model_len)],
      ["replicas", (d) => d.replicas.length ? d.replicas.map((r) => el("div", {},
        el("span", { class: r.healthy ? "ok" : "bad", title: r.healthy ? "healthy" : "unhealthy" }, r.healthy ? "●" : "○"),
        ` ${r.address} · ${r.in_flight} in flight · ${fmt(r.running)} running · queue ${fmt(r.waiting)}` +
        ` · KV ${r.kv_blocks_total ? Math.round(100 * r.kv_blocks_used / r.kv_blocks_total) + "%" : "—"}`)) : "none"],
    ], rows, "deployments-table");
    const section = el("section", {}, el("h1", {}, "Deployments"),
      el("p", { class: "muted" }, "Refreshed every 2 s from the gateway's routing table and replicas' health."), table);
    main.replaceChildren(section);
  }
  await draw();
  const timer = refreshTimer = setInterval(() => {
    if (!main.isConnected) { clearInterval(timer); return; }  // another page is shown now
    draw().catch((error) => main.replaceChildren(errorBox(error)));
  }, 2000);
}

async function modelsPage(main) {
  const models = (await api("GET", "/admin/v1/models")).data;
  main.replaceChildren(el("section", {}, el("h1", {}, "Model registry"), pagedTable([
    ["name", (m) => m.name], ["version", (m) => m.version], ["format", (m) => m.format],
    ["architecture", (m) => fmt(m.architecture)], ["kind", (m) => fmt(m.kind)], ["context", (m) => fmt(m.context_length)],
    ["sha256", (m) => m.sha256 ? m.sha256.slice(0, 16) + "…" : "—"], ["status", (m) => fmt(m.status)],
    ["owner", (m) => fmt(m.owner_tenant_id)],
  ], models, "models-table")));
}

async function tenantsPage(main) {
  const tenants = (await api("GET", "/admin/v1/tenants")).data;
  const used = Object.fromEntries((await api("GET", "/admin/v1/usage?days=31")).data.map((u) => [u.tenant_id, u]));
  const usedBy = (t) => used[t.id] || { requests: 0, prompt_tokens: 0, completion_tokens: 0 };
  main.replaceChildren(el("section", {}, el("h1", {}, "Tenants"), pagedTable([
    ["id", (t) => t.id], ["name", (t) => fmt(t.display_name)],
    ["last 31 days", (t) => `${usedBy(t).requests} requests · ` +
      `${usedBy(t).prompt_tokens + usedBy(t).completion_tokens} tokens`],
    ["monthly quota", (t) => fmt(t.monthly_token_quota)],
    ["key ceilings", (t) => `${fmt(t.key_requests_per_minute_max)} req/min · ${fmt(t.key_tokens_per_minute_max)} tok/min`],
    ["band", (t) => fmt(t.priority)], ["sequences", (t) => fmt(t.max_concurrent_sequences)], ["created", (t) => when(t.created_at)],
  ], tenants, "tenants-table")));
}

async function healthPage(main) {
  const health = (await api("GET", "/console/api/health")).components;
  main.replaceChildren(el("section", {}, el("h1", {}, "Health"), pagedTable([
    ["component", (c) => c.component], ["state", (c) => el("span", { class: c.ok ? "ok" : "bad" }, c.ok ? "ok" : "attention")],
    ["detail", (c) => c.detail],
  ], health, "health-table")));
}

// -- start ----------------------------------------------------------------------------------------

async function start() {
  document.getElementById("sign-out").addEventListener("click", signOut);
  window.addEventListener("hashchange", route);
  try { session = await api("GET", "/console/api/session"); } catch (e) { session = null; }
  route();
}

document.addEventListener("DOMContentLoaded", start);
