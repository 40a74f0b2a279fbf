"""The report page: one self-contained HTML file (figures inline as base64 PNG, no external
resource), each section with its figure, the published claim, this model's numbers and the SQL.

Every number in a finding is a `<span class="num" data-key=... data-value=...>` holding the
value from the section's query answer; a small script counts the decoded figures on load into
`#page-check`, so a headless browser can tell that the page rendered whole.
"""

from __future__ import annotations

import base64
import html
import io
import warnings
from typing import Any

from .canvas import DPI
from .data import inline_sql
from .section import Section

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 980px; margin: 2em auto; color: #222;
       line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
section { margin: 1.5em 0 2.5em; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
.claim { color: #555; } .finding { font-weight: 500; }
.num { font-variant-numeric: tabular-nums; background: #f3f3f3; padding: 0 .2em; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .85em; }
"""

_CHECK = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.getElementById("page-check").textContent =
    "figures decoded: " + ok + " of " + imgs.length;
});
"""


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.savefig(buf, format="png", dpi=DPI)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def show_number(value: float | int | str) -> str:
    """How a number reads on the page (4 significant digits for a float)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _finding(model: str, s: Section) -> str:
    spans = {
        name: (f'<span class="num" data-key="{html.escape(f"{model}/{s.key}/{name}")}" '
               f'data-value="{html.escape(repr(v) if isinstance(v, float) else str(v))}">'
               f"{html.escape(show_number(v))}</span>")
        for name, v in s.numbers.items()
    }
    return s.finding.format(**spans) if spans else html.escape(s.finding)


def _section(model: str, s: Section) -> str:
    if s.skipped or s.figure is None:  # a sentence says why it is not measured here
        return f"""
<section id="{html.escape(f"{model}-{s.key}")}" data-section="{s.key}"
         data-model="{html.escape(model)}" data-skipped="true">
<h3>{html.escape(s.title)}</h3>
<p class="claim"><b>Published:</b> {html.escape(s.claim)}</p>
<p class="finding">{html.escape(s.finding)}</p>
</section>"""
    if s.sql:
        sql = html.escape(inline_sql(s.sql, s.params))
        how = ("<details><summary>The SQL behind this figure (runs as is with "
               f'<code>actdb query</code>)\n</summary><pre class="sql">{sql}</pre></details>')
    else:
        how = ("<details><summary>How this figure is computed</summary>"
               f'<pre class="source">{html.escape(s.source)}</pre></details>')
    return f"""
<section id="{html.escape(f"{model}-{s.key}")}" data-section="{s.key}"
         data-model="{html.escape(model)}">
<h3>{html.escape(s.title)}</h3>
<img alt="{html.escape(s.title)}" src="data:image/png;base64,{_png(s.figure)}">
<p class="claim"><b>Published:</b> {html.escape(s.claim)}</p>
<p class="finding"><b>This model:</b> {_finding(model, s)}</p>
{how}
</section>"""


def render(db: Any, parts: list[tuple[str, list[Section]]]) -> str:
    """The whole page for (model, sections) pairs."""
    n_prompts = db.sql("SELECT count(*) FROM prompts").fetchall()[0][0]
    body = []
    for model, sections in parts:
        info = db.sql("SELECT architecture, n_layers, d_model FROM models WHERE model = $m",
                      params={"m": model}).fetchall()[0]
        body.append(f'<h2 id="{html.escape(model)}">Model {html.escape(model)} '
                    f"({html.escape(str(info[0]))}, {info[1]} layers, d = {info[2]})</h2>")
        body += [_section(model, s) for s in sections]
    title = f"actdb report: {str(db.store.location).rstrip('/').rsplit('/', 1)[-1]}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>The measurements of the papers behind actdb, run on this store: {len(parts)} model(s),
{n_prompts} prompts. Each figure comes from the SQL shown under it; every number in a
"This model" line is taken from that query's answer.</p>
{"".join(body)}
<div id="page-check" hidden></div>
<script>{_CHECK}</script>
</body></html>
"""
