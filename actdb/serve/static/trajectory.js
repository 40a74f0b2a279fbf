// Trajectory: positions' paths across layers on a 2-D projection of the sphere (PCA fitted by
// the server to the model's stored unit directions), with the anchors they pass near.
"use strict";

const TOKENS_SQL = "SELECT position, token FROM tokens WHERE model = $model AND prompt_id = $prompt_id ORDER BY position";
const COLOURS = ["#1f5fa8", "#c0392b", "#2e8b57", "#8e44ad", "#d35400", "#16a085", "#7f8c8d", "#b7950b"];

(async () => {
  const {el, svg, query, records, post, showSql, showError, params, visible, fmt} = actdb;
  actdb.nav("/trajectory");
  const q = params();
  try {
    const all = await actdb.models();
    if (!all.length) throw new Error("the store holds no model yet");
    const model = all.some(m => m.model === q.get("model")) ? q.get("model") : all[0].model;
    const promptId = Number(q.get("prompt_id") || 0);
    const roles = await actdb.roles(model);
    const role = q.get("role") || (roles.includes("pre_attn") ? "pre_attn" : roles[0] || "final");
    showSql("tokens", "The input's tokens", TOKENS_SQL, {model, prompt_id: promptId});
    const tokens = records(await query(TOKENS_SQL, {model, prompt_id: promptId}));
    if (!tokens.length) throw new Error(`prompt ${promptId} has no tokens for model ${model}`);
    let positions = (q.get("positions") || "").split(",").filter(s => s !== "").map(Number)
      .filter(p => tokens.some(t => t.position === p));
    if (!positions.length) positions = tokens.slice(-3).map(t => t.position);

    const reload = changes => {
      const next = {model, prompt_id: promptId, role, positions: positions.join(","), ...changes};
      window.location.search = new URLSearchParams(next).toString();
    };
    const modelSelect = actdb.select("model-select", all.map(m => m.model), model);
    modelSelect.addEventListener("change", () => reload({model: modelSelect.value, positions: ""}));
    const promptInput = el("input", {type: "number", id: "prompt-input", min: 0, value: promptId, style: "width:6em"});
    promptInput.addEventListener("change", () => reload({prompt_id: promptInput.value, positions: ""}));
    const roleSelect = actdb.select("role-select", roles.length ? roles : [role], role);
    roleSelect.addEventListener("change", () => reload({role: roleSelect.value}));
    const boxes = tokens.map(t => {
      const box = el("input", {type: "checkbox", class: "position-box", value: t.position, checked: positions.includes(t.position)});
      box.addEventListener("change", () => {
        const picked = [...document.querySelectorAll(".position-box")].filter(b => b.checked).map(b => b.value);
        if (picked.length) reload({positions: picked.join(",")});
      });
      return el("label", {title: `position ${t.position}`}, box, el("span", {class: "tok"}, visible(t.token)));
    });
    actdb.fill(document.getElementById("controls"),
      el("label", {}, "model ", modelSelect), el("label", {}, "prompt ", promptInput),
      el("label", {}, "site role ", roleSelect), el("span", {}, "positions: ", ...boxes));

    const data = await post("/api/trajectory", {model, prompt_id: promptId, positions, role});
    data.sql.forEach((s, i) => showSql(`trajectory-${i}`, i === 0 ? "The paths" : "The sample the projection is fitted to (and the anchors' cosines with it)", s.sql, s.params));
    const pr = data.projection;
    document.getElementById("projection").textContent =
      `Projection: ${pr.method} fitted to ${pr.fitted_on} unit directions x/||x|| of ${model} at its ${role} sites and final norm ` +
      `(the first rows by hash(prompt_id, position, site)); the axes hold ${fmt(100 * pr.explained[0], 3)}% and ` +
      `${fmt(100 * pr.explained[1], 3)}% of their variance. Anchors (LM-head rows, normalized) are placed by the same map; ` +
      `each point is labelled with its layer, and its nearest anchor shows on hover.`;
    actdb.fill(document.getElementById("content"), picture(data));
  } catch (e) {
    showError(e.message);
  }

  function picture(data) {
    const W = 760, H = 520, M = 40;
    const xs = [], ys = [];
    for (const p of data.paths) for (const pt of p.points) { xs.push(pt.x); ys.push(pt.y); }
    for (const a of data.anchors) { xs.push(a.x); ys.push(a.y); }
    const [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    const span = Math.max(x1 - x0, y1 - y0, 1e-9);
    const sx = v => M + (v - x0) / span * (W - 2 * M);
    const sy = v => H - M - (v - y0) / span * (H - 2 * M);
    const chart = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "trajectory"});
    chart.append(svg("rect", {x: 0, y: 0, width: W, height: H, fill: "#fff", stroke: "#d9dde5"}));
    for (const a of data.anchors) {
      chart.append(svg("g", {class: "anchor", "data-token": a.token},
        svg("path", {d: `M ${sx(a.x)} ${sy(a.y) - 5} l 5 5 l -5 5 l -5 -5 z`, fill: "#9aa3b2"}),
        svg("text", {x: sx(a.x) + 7, y: sy(a.y) + 4, fill: "#6b7280"}, visible(a.token)),
        svg("title", {}, `anchor ${visible(a.token)} (id ${a.token_id})`)));
    }
    data.paths.forEach((p, i) => {
      const colour = COLOURS[i % COLOURS.length];
      const g = svg("g", {class: "path", "data-position": p.position});
      g.append(svg("polyline", {fill: "none", stroke: colour, "stroke-width": 2, opacity: 0.8,
                                points: p.points.map(pt => `${sx(pt.x)},${sy(pt.y)}`).join(" ")}));
      p.points.forEach((pt, k) => {
        const last = k === p.points.length - 1;
        g.append(svg("circle", {cx: sx(pt.x), cy: sy(pt.y), r: last ? 5 : 3.5, fill: colour, class: "point"},
                     svg("title", {}, `position ${p.position} ${visible(p.token)} · ${pt.site} (layer ${pt.layer}) · nearest anchor ${visible(pt.near)}`)));
        g.append(svg("text", {x: sx(pt.x) + 5, y: sy(pt.y) - 5, fill: colour}, pt.layer));
      });
      chart.append(g);
    });
    const legend = el("div", {class: "controls legend"}, data.paths.map((p, i) => el("span", {style: `color:${COLOURS[i % COLOURS.length]}`},
      `\u25cf position ${p.position} `, el("span", {class: "tok"}, visible(p.token)))));
    return el("div", {}, legend, chart);
  }
})();
