// One input: the lens grid (sites x positions), each cell the top token by colour; hovering
// shows the top 5; a click shows the cell's details below. Several models side by side.
"use strict";

const LENS_SQL = {
  // the probabilities from one log-sum-exp per cell (the top token's logprob), where prob()
  // of each listed token would take a vocabulary-wide softmax per token
  logit: `WITH cells AS (
  SELECT site, layer, position, token, vec, top_logits(vec, 5) AS top
  FROM acts
  WHERE model = $model AND prompt_id = $prompt_id AND role IN ($role, 'final')
    AND head IS NULL
), shifted AS (
  SELECT *, logprob(vec, top[1].token_id) - top[1].logit AS shift FROM cells
)
SELECT site, layer, position, token,
       list_transform(top, lambda t: struct_pack(
           token_id := t.token_id, token := t.token, p := exp(t.logit + shift))) AS top
FROM shifted
ORDER BY layer DESC, site DESC, position`,
  anchor: `SELECT site, layer, position, token,
       list_transform(nearest_anchors(vec, 5), lambda a: struct_pack(
           token_id := a.token_id, token := a.token, p := a.cosine)) AS top
FROM acts
WHERE model = $model AND prompt_id = $prompt_id AND role IN ($role, 'final')
  AND head IS NULL
ORDER BY layer DESC, site DESC, position`,
};

const PROMPT_SQL = "SELECT * FROM prompts WHERE prompt_id = $prompt_id";

(async () => {
  const {el, query, records, showSql, showError, params, visible, fmt, shade} = actdb;
  actdb.nav("/input");
  const q = params();
  const promptId = Number(q.get("prompt_id") || 0);
  const lens = q.get("lens") === "anchor" ? "anchor" : "logit";
  const role = q.get("role") || "pre_attn";
  try {
    const all = await actdb.models();
    if (!all.length) throw new Error("the store holds no model yet");
    const names = all.map(m => m.model);
    let chosen = (q.get("model") || names[0]).split(",").filter(m => names.includes(m));
    if (!chosen.length) chosen = [names[0]];
    const roles = await actdb.roles(chosen[0]);
    showSql("prompt", "The prompt", PROMPT_SQL, {prompt_id: promptId});
    const prompt = records(await query(PROMPT_SQL, {prompt_id: promptId}));
    document.getElementById("title").textContent =
      prompt.length ? `Input ${promptId}: ${actdb.inputName(prompt[0])}` : `Input ${promptId} is not in the store`;

    const reload = changes => {
      const next = {model: chosen.join(","), prompt_id: promptId, role, lens, ...changes};
      window.location.search = new URLSearchParams(next).toString();
    };
    const roleSelect = actdb.select("role-select", roles.length ? roles : [role], role);
    roleSelect.addEventListener("change", () => reload({role: roleSelect.value}));
    const lensSelect = actdb.select("lens-select", [["logit", "by logit (probability)"], ["anchor", "by anchor (cosine)"]], lens);
    lensSelect.addEventListener("change", () => reload({lens: lensSelect.value}));
    const modelBoxes = names.map(m => {
      const box = el("input", {type: "checkbox", value: m, checked: chosen.includes(m), class: "model-box"});
      box.addEventListener("change", () => {
        const picked = [...document.querySelectorAll(".model-box")].filter(b => b.checked).map(b => b.value);
        if (picked.length) reload({model: picked.join(",")});
      });
      return el("label", {}, box, m);
    });
    actdb.fill(document.getElementById("controls"),
      el("label", {}, "site role ", roleSelect, " (and the final norm on top)"),
      el("label", {}, "lens ", lensSelect),
      el("span", {}, "models: ", ...modelBoxes),
      el("a", {href: actdb.link("/trajectory", {model: chosen[0], prompt_id: promptId, role})}, "trajectories of this input"));

    const grids = document.getElementById("grids");
    const details = document.getElementById("cell-details");
    const tip = document.getElementById("tip");
    for (const model of chosen) {
      const values = {model, prompt_id: promptId, role};
      showSql(`lens-${model}`, `The lens grid of ${model}`, LENS_SQL[lens], values);
      const answer = await query(LENS_SQL[lens], values);
      grids.append(grid(model, records(answer), answer.truncated));
    }

    function grid(model, rows, truncated) {
      const positions = [...new Map(rows.map(r => [r.position, r.token])).entries()].sort((a, b) => a[0] - b[0]);
      const sites = [...new Map(rows.map(r => [r.site, r.layer])).keys()];
      const at = new Map(rows.map(r => [`${r.site}|${r.position}`, r]));
      const table = el("table", {class: "lens", "data-model": model},
        el("tr", {}, el("th", {}, ""), positions.map(([p, t]) =>
          el("th", {class: "input-token", "data-position": p, title: `position ${p}`}, el("span", {class: "tok"}, visible(t))))));
      for (const site of sites) {
        const tr = el("tr", {"data-site": site}, el("th", {class: "site"}, site));
        for (const [p] of positions) {
          const r = at.get(`${site}|${p}`);
          const best = r && r.top && r.top.length ? r.top[0] : null;
          const colours = shade(best ? best.p : 0);
          const td = el("td", {class: "cell", style: `background:${colours.background};color:${colours.color}`,
                               dataset: {site, position: p, token: best ? best.token : "", p: best ? best.p : ""}},
            el("span", {class: "tok"}, best ? visible(best.token) : "\u2013"),
            el("span", {class: "p"}, best ? fmt(best.p, 2) : ""));
          td.addEventListener("mouseenter", ev => showTip(ev, r));
          td.addEventListener("mousemove", ev => moveTip(ev));
          td.addEventListener("mouseleave", () => { tip.hidden = true; });
          td.addEventListener("click", () => {
            document.querySelectorAll("td.cell.selected").forEach(c => c.classList.remove("selected"));
            td.classList.add("selected");
            actdb.renderCell(details, {model, prompt_id: promptId, position: p, site, role});
            details.append();
            const own = el("a", {href: actdb.link("/cell", {model, prompt_id: promptId, position: p, site, role})}, "this cell on a page of its own");
            details.dataset.link = own.getAttribute("href");
          });
          tr.append(td);
        }
        table.append(tr);
      }
      return el("div", {class: "grid"},
        el("h2", {}, `${model}: lens ${lens === "logit" ? "by logit (top token, probability)" : "by anchor (nearest, cosine)"}`),
        table,
        truncated ? el("p", {class: "note"}, "the grid is cut at the server's row limit") : null);
    }

    function showTip(ev, r) {
      if (!r || !r.top) { tip.hidden = true; return; }
      actdb.fill(tip, el("div", {}, `${r.site} · position ${r.position}`),
        el("table", {}, r.top.map(t => el("tr", {},
          el("td", {class: "tok"}, visible(t.token)), el("td", {class: "num"}, fmt(t.p, 3))))));
      tip.hidden = false;
      moveTip(ev);
    }
    function moveTip(ev) {
      tip.style.left = `${ev.pageX + 14}px`;
      tip.style.top = `${ev.pageY + 14}px`;
    }
  } catch (e) {
    showError(e.message);
  }
})();
