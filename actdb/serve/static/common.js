// actdb explorer: what every page shares. Text from the store (prompts, tokens) is only ever
// set as textContent, never as HTML, so a token like "<script>" is shown, not run.
"use strict";

const actdb = (() => {
  const PAGES = [["/", "Inputs"], ["/input", "Lens"], ["/trajectory", "Trajectory"], ["/sql", "SQL"]];

  // POST /api/query; resolves to {columns, rows, row_count, truncated, max_rows} and rejects
  // with an Error carrying the server's words (the CLI's error text).
  async function query(sql, params) {
    return post("/api/query", {sql, params: params || null});
  }

  async function post(path, body) {
    const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
                                 body: JSON.stringify(body)});
    let data;
    try { data = await r.json(); } catch (e) { throw new Error(`the server answered ${r.status} without JSON`); }
    if (!r.ok) throw new Error(data.error || `the server answered ${r.status}`);
    return data;
  }

  // Rows as objects keyed by column name.
  function records(answer) {
    return answer.rows.map(row => Object.fromEntries(answer.columns.map((c, i) => [c, row[i]])));
  }

  // el("td", {class: "num", title: "x"}, "text", childNode, ...)
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k === "dataset") Object.assign(node.dataset, v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  // Replace a node's children (arrays flattened, null and undefined left out).
  function fill(node, ...children) {
    node.replaceChildren();
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  // A token with its whitespace made visible, as the CLI and the pictures show it.
  function visible(token) {
    if (token === null || token === undefined) return "";
    return String(token).replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  }

  function fmt(x, digits) {
    if (x === null || x === undefined) return "NULL";
    if (typeof x !== "number") return String(x);
    return Number.isInteger(x) ? String(x) : x.toPrecision(digits || 4);
  }

  function params() { return new URLSearchParams(window.location.search); }

  function link(path, values) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(values)) if (v !== null && v !== undefined && v !== "") q.set(k, v);
    return `${path}?${q.toString()}`;
  }

  function showError(message) {
    const box = document.getElementById("error");
    box.textContent = message;
    box.hidden = !message;
  }

  // The SQL behind what the page shows, under a key (a later query of the same key
  // replaces the earlier one), with a copy button and a link to run it on the SQL page.
  function showSql(key, title, sql, values) {
    const panel = document.getElementById("sql-list");
    if (!panel) return;
    let block = panel.querySelector(`[data-key="${CSS.escape(key)}"]`);
    if (!block) {
      block = el("div", {class: "sql-block", dataset: {key}});
      panel.append(block);
    }
    const bound = values && Object.keys(values).length ? values : null;
    const text = sql.trim();
    const copyButton = el("button", {class: "plain copy", type: "button"}, "Copy");
    copyButton.addEventListener("click", () => copy(text, copyButton));
    fill(block,
      el("div", {class: "tools"}, el("strong", {}, title), copyButton,
         el("a", {href: link("/sql", {sql: text, params: bound ? JSON.stringify(bound) : ""})},
            "open in the SQL page")),
      el("pre", {class: "sql"}, text),
      bound ? el("div", {class: "note"}, "parameters: " + JSON.stringify(bound)) : null);
  }

  async function copy(text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (e) {  // no clipboard API (e.g. plain http beyond localhost): select and copy
      const area = el("textarea", {style: "position:fixed;opacity:0"});
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    if (button) { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1200); }
  }

  function nav(active) {
    const header = document.getElementById("nav");
    fill(header, el("span", {class: "brand"}, "actdb explorer"),
      ...PAGES.map(([href, name]) => el("a", {href, class: href === active ? "active" : null}, name)));
  }

  // The store's models, in the order they were ingested.
  async function models() {
    const sql = "SELECT model, architecture, n_layers, d_model, has_lm_head FROM models ORDER BY model_id";
    showSql("models", "The store's models", sql, null);
    return records(await query(sql, null));
  }

  // The roles a model's lens can be read at (the tensor functions' lens is NULL elsewhere).
  async function roles(model) {
    const sql = `SELECT DISTINCT role, min(layer) AS first_layer FROM sites
WHERE model = $model AND role NOT IN ('inner', 'q_norm', 'k_norm', 'final')
GROUP BY role ORDER BY first_layer, role`;
    showSql("roles", "Roles with a lens", sql, {model});
    return records(await query(sql, {model})).map(r => r.role);
  }

  function select(id, options, value) {
    const node = el("select", {id});
    for (const o of options) {
      const [v, label] = Array.isArray(o) ? o : [o, o];
      node.append(el("option", {value: v, selected: String(v) === String(value)}, label));
    }
    return node;
  }

  // Blue by probability (or cosine): white at 0, dark blue at 1.
  function shade(p) {
    const x = Math.max(0, Math.min(1, p || 0));
    const light = 97 - 60 * Math.sqrt(x);
    return {background: `hsl(212, 70%, ${light}%)`, color: light < 60 ? "#fff" : "#1d2330"};
  }

  return {query, post, records, el, fill, svg, visible, fmt, params, link, showError, showSql,
          copy, nav, models, roles, select, shade};
})();

// The columns naming an input beside its text (an image store's file names; video, audio).
actdb.MEDIA = ["image", "video", "audio"];

// What names an input: its text, else its image (video, audio) as given at ingest.
actdb.inputName = function inputName(row) {
  for (const k of ["text", ...actdb.MEDIA]) if (row[k] !== null && row[k] !== undefined) return String(row[k]);
  return "";
};
