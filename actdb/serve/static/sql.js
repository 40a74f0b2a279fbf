// SQL: an editor with the tensor functions' docs, the results as a table with the row count,
// CSV download, and the CLI's errors.
"use strict";

const SAMPLE_SQL = `SELECT layer, site, token,
       list_transform(top_logits(vec, 3), lambda t: t.token) AS top_3,
       round(uniform_angle(vec), 1) AS uniform_deg
FROM acts
WHERE prompt_id = 0 AND position = 1 AND head IS NULL
ORDER BY model, layer, site`;

(async () => {
  const {el, query, showSql, showError, params, fmt} = actdb;
  actdb.nav("/sql");
  const q = params();
  const editor = document.getElementById("sql-editor");
  const paramsBox = document.getElementById("params-editor");
  editor.value = q.get("sql") || SAMPLE_SQL;
  paramsBox.value = q.get("params") || "";
  let last = null;

  async function run() {
    showError("");
    const meta = document.getElementById("result-meta");
    const out = document.getElementById("result");
    meta.textContent = "running ...";
    actdb.fill(out);
    let bound = null;
    if (paramsBox.value.trim()) {
      try { bound = JSON.parse(paramsBox.value); } catch (e) {
        meta.textContent = "";
        showError(`the parameters are not JSON: ${e.message}`);
        return;
      }
    }
    const sql = editor.value;
    showSql("query", "This query", sql, bound);
    const started = performance.now();
    try {
      const answer = await query(sql, bound);
      last = answer;
      const ms = performance.now() - started;
      actdb.fill(meta,
        el("span", {id: "row-count"}, `${answer.row_count} row${answer.row_count === 1 ? "" : "s"}`),
        answer.truncated ? el("span", {class: "note", id: "truncated"}, ` (cut at the server's limit of ${answer.max_rows} rows: add a LIMIT or a WHERE)`) : null,
        el("span", {class: "note"}, ` in ${fmt(ms / 1000, 2)} s `),
        el("button", {type: "button", class: "plain", id: "csv", onclick: download}, "Download CSV"));
      actdb.fill(out, table(answer));
    } catch (e) {
      meta.textContent = "";
      showError(e.message);
    }
  }

  function cell(v) {
    if (v === null || v === undefined) return "NULL";
    if (typeof v === "object") return JSON.stringify(v);
    return typeof v === "number" ? fmt(v, 6) : String(v);
  }

  function table(answer) {
    return el("table", {class: "data", id: "result-table"},
      el("tr", {}, answer.columns.map(c => el("th", {}, c))),
      answer.rows.map(row => el("tr", {}, row.map(v => el("td", {class: typeof v === "number" ? "num" : null}, cell(v))))));
  }

  function csvField(v) {
    const s = v === null || v === undefined ? "" : typeof v === "object" ? JSON.stringify(v) : String(v);
    return /[",\n\r]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
  }

  function download() {
    if (!last) return;
    const lines = [last.columns.map(csvField).join(",")].concat(last.rows.map(r => r.map(csvField).join(",")));
    const blob = new Blob([lines.join("\n") + "\n"], {type: "text/csv"});
    const a = el("a", {href: URL.createObjectURL(blob), download: "actdb-query.csv"});
    document.body.append(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
  }

  document.getElementById("run").addEventListener("click", run);
  editor.addEventListener("keydown", ev => {
    if ((ev.ctrlKey || ev.metaKey) && ev.key === "Enter") { ev.preventDefault(); run(); }
  });

  try {
    const r = await fetch("/api/functions");
    const docs = (await r.json()).functions;
    actdb.fill(document.getElementById("functions"),
      el("h2", {}, "Tensor functions"),
      el("p", {class: "note"}, "as `actdb functions` prints them; click a name to insert it"),
      docs.map(f => {
        const name = el("code", {}, f.signature);
        name.addEventListener("click", () => {
          const at = editor.selectionStart;
          editor.setRangeText(`${f.name}(`, at, editor.selectionEnd, "end");
          editor.focus();
        });
        return el("div", {class: "function"}, name, el("div", {class: "note"}, f.doc));
      }));
  } catch (e) {
    showError(e.message);
  }
  if (q.get("run") !== "0") await run();
})();
