// One cell (an input, a position, a site): nearest anchors, the dims pushing toward a token,
// norm and angles, and the token's rank at every layer as a line. Used by the cell page and
// by the lens page's details panel.
"use strict";

const CELL_SQL = `SELECT a.token AS input_token, a.layer, a.role, a.norm, a.mean,
       uniform_angle(a.vec) AS uniform_deg, rotation_angle(a.vec) AS rotation_deg, s.d,
       nearest_anchors(a.vec, 10) AS nearest
FROM acts AS a JOIN sites AS s ON s.model = a.model AND s.site = a.site
WHERE a.model = $model AND a.prompt_id = $prompt_id AND a.position = $position
  AND a.site = $site
ORDER BY a.head NULLS FIRST
LIMIT 1`;

const PREDICTION_SQL = `SELECT top_logits(vec, 1)[1].token_id AS token_id,
       top_logits(vec, 1)[1].token AS token
FROM acts
WHERE model = $model AND prompt_id = $prompt_id AND position = $position AND role = 'final'`;

const DIMS_SQL = `WITH cell AS (
  SELECT a.vec, s.d FROM acts AS a JOIN sites AS s ON s.model = a.model AND s.site = a.site
  WHERE a.model = $model AND a.prompt_id = $prompt_id AND a.position = $position
    AND a.site = $site AND a.head IS NULL
), dims AS (SELECT vec, unnest(range(d)) AS dim FROM cell)
SELECT dim, logit_contribution(vec, dim, $token) AS toward, dim_contribution(vec, dim) AS share
FROM dims
ORDER BY toward DESC
LIMIT 10`;

const RANK_SQL = `SELECT layer, site, token_rank(vec, $token) AS rank, prob(vec, $token) AS p,
       logit(vec, $token) AS logit
FROM acts
WHERE model = $model AND prompt_id = $prompt_id AND position = $position
  AND role IN ($role, 'final') AND head IS NULL
ORDER BY layer, site`;

actdb.renderCell = async function renderCell(container, cell) {
  const {el, fmt, visible, query, records, showSql} = actdb;
  const base = {model: cell.model, prompt_id: cell.prompt_id, position: cell.position};
  actdb.fill(container, el("p", {class: "note"}, "loading the cell ..."));
  try {
    const facts = {...base, site: cell.site};
    showSql("cell", "This cell", CELL_SQL, facts);
    const rows = records(await query(CELL_SQL, facts));
    if (!rows.length) throw new Error(`no stored row for model ${cell.model}, prompt ${cell.prompt_id}, position ${cell.position}, site ${cell.site}`);
    const info = rows[0];
    let token = cell.token;  // a token string the user chose, or the model's prediction's id
    let tokenLabel = token;
    if (token === undefined || token === null || token === "") {
      showSql("prediction", "The model's prediction at this position", PREDICTION_SQL, base);
      const pred = records(await query(PREDICTION_SQL, base));
      if (pred.length && pred[0].token_id !== null) { token = pred[0].token_id; tokenLabel = pred[0].token; }
    }
    const role = info.role === "final" ? (cell.role || "pre_attn") : info.role;

    const head = el("h2", {class: "cell-title"}, `${cell.model} · prompt ${cell.prompt_id} · position ${cell.position} `,
      el("span", {class: "tok"}, visible(info.input_token)), ` · site ${cell.site}`);
    const factsList = el("dl", {class: "facts"},
      el("dt", {}, "norm"), el("dd", {class: "norm"}, fmt(info.norm)),
      el("dt", {}, "mean"), el("dd", {}, fmt(info.mean)),
      el("dt", {}, "uniform angle"), el("dd", {class: "uniform"}, `${fmt(info.uniform_deg)}°`),
      el("dt", {}, "rotation angle"), el("dd", {class: "rotation"}, `${fmt(info.rotation_deg)}°`),
      el("dt", {}, "d"), el("dd", {}, fmt(info.d)));
    const near = el("table", {class: "data nearest"},
      el("tr", {}, el("th", {}, "anchor"), el("th", {}, "cosine")),
      (info.nearest || []).map(a => el("tr", {},
        el("td", {class: "tok"}, visible(a.token)),
        el("td", {class: "num"}, fmt(a.cosine), " ", el("span", {class: "bar", style: `width:${Math.max(0, a.cosine) * 60}px`})))));

    const picker = el("input", {type: "text", class: "token-input", value: tokenLabel === undefined ? "" : tokenLabel,
                                title: "a token of the model's vocabulary (or #id)"});
    const go = el("button", {type: "button", class: "plain"}, "Show");
    go.addEventListener("click", () => {
      const v = picker.value;
      const t = /^#\d+$/.test(v) ? Number(v.slice(1)) : v;
      actdb.renderCell(container, {...cell, token: t});
    });
    const toward = el("div", {class: "toward"}, el("p", {class: "note"}, "loading ..."));
    const ranks = el("div", {class: "ranks"}, el("p", {class: "note"}, "loading ..."));
    actdb.fill(container, head,
      el("div", {class: "cols"},
        el("div", {}, el("h3", {}, "Norm and angles"), factsList),
        el("div", {}, el("h3", {}, "Nearest anchors"), near),
        el("div", {}, el("h3", {}, "Dims pushing toward ", el("span", {class: "tok"}, visible(tokenLabel))),
           el("div", {class: "controls"}, el("label", {}, "token ", picker), go), toward),
        el("div", {}, el("h3", {}, "Its rank at every layer"), ranks)));
    if (token === undefined || token === null) {
      actdb.fill(toward, el("p", {class: "note"}, "this model has no logit lens here"));
      actdb.fill(ranks);
      return;
    }
    const dimParams = {...facts, token};
    showSql("dims", "Dims pushing toward the token", DIMS_SQL, dimParams);
    const rankParams = {...base, token, role};
    showSql("ranks", "The token's rank at every layer", RANK_SQL, rankParams);
    const [dims, rankRows] = await Promise.all([query(DIMS_SQL, dimParams), query(RANK_SQL, rankParams)]);
    const dimRows = records(dims);
    const top = Math.max(1e-12, ...dimRows.map(r => Math.abs(r.toward || 0)));
    actdb.fill(toward, el("table", {class: "data dims"},
      el("tr", {}, el("th", {}, "dim"), el("th", {}, "logit contribution"), el("th", {}, "share of direction")),
      dimRows.map(r => el("tr", {},
        el("td", {class: "num"}, r.dim),
        el("td", {class: "num"}, fmt(r.toward), " ",
           el("span", {class: "bar" + ((r.toward || 0) < 0 ? " neg" : ""), style: `width:${Math.abs(r.toward || 0) / top * 60}px`})),
        el("td", {class: "num"}, fmt(r.share))))));
    actdb.fill(ranks, rankChart(records(rankRows)));
  } catch (e) {
    actdb.fill(container, el("div", {class: "error"}, e.message));
  }
};

// The token's rank (1 = top) at each site, on a log scale, as a line.
function rankChart(rows) {
  const {svg, fmt} = actdb;
  const W = 360, H = 200, L = 44, R = 12, T = 12, B = 30;
  const pts = rows.filter(r => r.rank !== null);
  if (!pts.length) return actdb.el("p", {class: "note"}, "no rank here (no logit lens at these sites)");
  const maxRank = Math.max(2, ...pts.map(r => r.rank));
  const x = i => L + (pts.length === 1 ? (W - L - R) / 2 : i * (W - L - R) / (pts.length - 1));
  const y = rank => T + Math.log10(rank) / Math.log10(maxRank) * (H - T - B);
  const chart = svg("svg", {width: W, height: H, class: "rank-chart", viewBox: `0 0 ${W} ${H}`});
  chart.append(svg("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}),
               svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}),
               svg("text", {x: L - 6, y: T + 4, "text-anchor": "end"}, "1"),
               svg("text", {x: L - 6, y: H - B, "text-anchor": "end"}, fmt(maxRank)),
               svg("text", {x: (W + L) / 2, y: H - 4, "text-anchor": "middle"}, "layer"));
  chart.append(svg("polyline", {fill: "none", stroke: "#1f5fa8", "stroke-width": 2,
                                points: pts.map((r, i) => `${x(i)},${y(r.rank)}`).join(" ")}));
  pts.forEach((r, i) => {
    chart.append(svg("circle", {cx: x(i), cy: y(r.rank), r: 3.5, fill: "#1f5fa8", class: "rank-point",
                                "data-layer": r.layer, "data-rank": r.rank},
                     svg("title", {}, `${r.site}: rank ${r.rank}, p ${fmt(r.p)}, logit ${fmt(r.logit)}`)));
    chart.append(svg("text", {x: x(i), y: H - B + 13, "text-anchor": "middle"}, r.layer));
  });
  return chart;
}
