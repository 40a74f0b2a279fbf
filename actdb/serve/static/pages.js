// The inputs page and the cell page: small enough to share a file.
"use strict";

// The inputs' own columns beside text: an image store's file names (and video, audio).
const MEDIA = actdb.MEDIA;
const COLUMNS_SQL = "SELECT * FROM prompts LIMIT 0";

function promptsSql(media) {
  const shown = ["p.text", ...media.map(m => `p.${m}`)];
  return `SELECT p.prompt_id, ${shown.join(", ")}, count(*) AS n_tokens
FROM prompts AS p JOIN tokens AS t ON t.prompt_id = p.prompt_id
WHERE t.model = $model
  AND contains(lower(concat_ws(' ', ${shown.join(", ")})), lower($search))
GROUP BY ALL
ORDER BY p.prompt_id
LIMIT 500`;
}

actdb.inputsPage = async function inputsPage() {
  const {el, query, records, showSql, showError, params, link} = actdb;
  actdb.nav("/");
  try {
    const all = await actdb.models();
    if (!all.length) throw new Error("the store holds no model yet");
    const q = params();
    let model = all.some(m => m.model === q.get("model")) ? q.get("model") : all[0].model;
    const modelSelect = actdb.select("model-select", all.map(m => [m.model, `${m.model} (${m.architecture}, ${m.n_layers} layers, d=${m.d_model})`]), model);
    const search = el("input", {type: "search", id: "search", placeholder: "search the prompts", value: q.get("search") || ""});
    actdb.fill(document.getElementById("controls"),
      el("label", {}, "model ", modelSelect), el("label", {}, search));
    showSql("columns", "The inputs' columns", COLUMNS_SQL, null);
    const columns = (await query(COLUMNS_SQL, null)).columns;
    const media = MEDIA.filter(m => columns.includes(m));
    const PROMPTS_SQL = promptsSql(media);
    const list = document.getElementById("content");
    let pending = 0;
    const load = async () => {
      const ticket = ++pending;
      const values = {model, search: search.value};
      showSql("prompts", "The prompts", PROMPTS_SQL, values);
      try {
        const answer = await query(PROMPTS_SQL, values);
        if (ticket !== pending) return;  // a newer search is on its way
        showError("");
        const rows = records(answer);
        actdb.fill(list,
          el("p", {class: "note", id: "prompt-count"}, `${rows.length} prompt${rows.length === 1 ? "" : "s"}` +
             (rows.length === 500 ? " (the first 500)" : "")),
          el("table", {class: "data prompts"},
            el("tr", {}, el("th", {}, "id"), el("th", {}, media.length ? `text or ${media.join(" or ")}` : "text"),
               el("th", {}, "positions"), el("th", {}, "")),
            rows.map(r => el("tr", {},
              el("td", {class: "num"}, r.prompt_id),
              el("td", {}, el("a", {class: "prompt-link", href: link("/input", {model, prompt_id: r.prompt_id})}, actdb.inputName(r))),
              el("td", {class: "num"}, r.n_tokens),
              el("td", {}, el("a", {href: link("/trajectory", {model, prompt_id: r.prompt_id})}, "trajectory"))))));
      } catch (e) {
        showError(e.message);
      }
    };
    modelSelect.addEventListener("change", () => { model = modelSelect.value; load(); });
    let timer = null;
    search.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(load, 200); });
    await load();
  } catch (e) {
    showError(e.message);
  }
};

actdb.cellPage = async function cellPage() {
  const {params, showError} = actdb;
  actdb.nav("");
  const q = params();
  const cell = {model: q.get("model"), prompt_id: Number(q.get("prompt_id") || 0),
                position: Number(q.get("position") || 0), site: q.get("site") || "final",
                role: q.get("role") || "pre_attn", token: q.get("token")};
  if (!cell.model) {
    const all = await actdb.models().catch(e => { showError(e.message); return []; });
    if (!all.length) return;
    cell.model = all[0].model;
  }
  if (cell.token !== null && /^#\d+$/.test(cell.token)) cell.token = Number(cell.token.slice(1));
  document.getElementById("title").append(
    actdb.el("a", {href: actdb.link("/input", {model: cell.model, prompt_id: cell.prompt_id, role: cell.role})}, "back to the lens grid"));
  await actdb.renderCell(document.getElementById("cell-details"), cell);
};
