"""The explorer's pages in a real headless Chromium (Debian's, driven by Playwright; nothing is
downloaded), the server in a subprocess on a store of two tiny models: every page loads without
a console error, the lens grid's top row is `top_logits` at the final site, hovering shows the
top 5, a click shows that cell's details, and the SQL page runs a query and shows its rows.

ACTDB_SCREENSHOT=PATH saves the lens page's picture there (the README's docs/serve.png)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
from support.serving import running

pytestmark = pytest.mark.slow
pytest.importorskip("starlette")
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
MODELS = ("gpt2", "llama")


def visible(token: str) -> str:
    """A token as the pages show it (common.js `visible`)."""
    return token.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")


@pytest.fixture(scope="module")
def server(two_models):
    with running(two_models) as s:
        yield s


@pytest.fixture(scope="module")
def db(two_models):
    import actdb

    with actdb.connect(two_models, device="cpu") as d:
        yield d


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (make browser)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture()
def tab(browser):
    """A fresh page whose console errors and uncaught exceptions are collected."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(90_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    yield page
    context.close()


PAGES = [
    ("/", "table.prompts td"),
    ("/input?model=gpt2&prompt_id=0", "table.lens td.cell"),
    ("/cell?model=llama&prompt_id=1&position=2&site=blocks.1.ln2", "svg.rank-chart"),
    ("/trajectory?model=gpt2&prompt_id=0", "svg.trajectory g.path"),
    ("/sql", "#result-table td"),
]


@pytest.mark.parametrize(("path", "ready"), PAGES)
def test_each_page_loads_without_console_errors(server, tab, path, ready):
    tab.goto(server.base + path.lstrip("/"))
    tab.wait_for_selector(ready)
    tab.wait_for_load_state("networkidle")
    assert tab.errors == []
    assert tab.locator("#error").is_hidden()
    assert tab.locator("#sql-list pre.sql").count() >= 1  # each page shows its SQL


def test_lens_top_row_is_top_logits_at_the_final_site(server, tab, db, tmp_path):
    tab.goto(server.base + "input?model=gpt2,llama&prompt_id=0")
    for model in MODELS:
        tab.wait_for_selector(f"table.lens[data-model={model}] td.cell")
        want = db.sql("SELECT position, top_logits(vec, 1)[1].token AS token, "
                      "prob(vec, top_logits(vec, 1)[1].token_id) AS p FROM acts WHERE model = $m "
                      "AND prompt_id = 0 AND site = 'final' ORDER BY position",
                      params={"m": model}).fetchall()
        rows = tab.locator(f"table.lens[data-model={model}] tr[data-site]")
        assert rows.first.get_attribute("data-site") == "final"
        layers = db.sql("SELECT count(*) FROM sites WHERE model = $m AND role IN ('pre_attn', "
                        "'final')", params={"m": model}).fetchone()[0]
        assert rows.count() == layers
        cells = rows.first.locator("td.cell")
        assert cells.count() == len(want)
        for i, (position, token, p) in enumerate(want):
            cell = cells.nth(i)
            assert int(cell.get_attribute("data-position")) == position
            assert cell.get_attribute("data-token") == token
            assert cell.locator(".tok").inner_text() == visible(token)
            assert math.isclose(float(cell.get_attribute("data-p")), p, rel_tol=1e-6)
    assert tab.errors == []
    shot = os.environ.get("ACTDB_SCREENSHOT")
    tab.locator("table.lens[data-model=gpt2] tr[data-site='final'] td.cell").nth(4).click()
    tab.wait_for_selector("#cell-details svg.rank-chart")
    tab.screenshot(path=shot or str(tmp_path / "lens.png"), full_page=False)


def test_hovering_a_cell_shows_its_top_5(server, tab, db):
    tab.goto(server.base + "input?model=llama&prompt_id=1&role=pre_mlp")
    cell = tab.locator("table.lens[data-model=llama] tr[data-site='blocks.0.ln2'] "
                       "td.cell[data-position='2']")
    cell.hover()
    tip = tab.locator("#tip")
    tip.wait_for(state="visible")
    want = db.sql("SELECT top_logits(vec, 5) FROM acts WHERE model = 'llama' AND prompt_id = 1 "
                  "AND position = 2 AND site = 'blocks.0.ln2'").fetchone()[0]
    shown = [t.inner_text() for t in tip.locator("td.tok").all()]
    assert shown == [visible(t["token"]) for t in want]


def test_clicking_a_cell_shows_its_details(server, tab, db):
    tab.goto(server.base + "input?model=gpt2&prompt_id=1")
    site, position = "blocks.1.ln1", 3
    tab.locator(f"table.lens[data-model=gpt2] tr[data-site='{site}'] "
                f"td.cell[data-position='{position}']").click()
    details = tab.locator("#cell-details")
    tab.wait_for_selector("#cell-details svg.rank-chart")
    tab.wait_for_selector("#cell-details table.dims td")
    title = details.locator(".cell-title").inner_text()
    assert f"position {position}" in title and f"site {site}" in title
    norm, uniform, near, predicted = db.sql(
        "SELECT a.norm, uniform_angle(a.vec), nearest_anchors(a.vec, 10), "
        "(SELECT top_logits(f.vec, 1)[1].token_id FROM acts f WHERE f.model = a.model AND "
        "f.prompt_id = a.prompt_id AND f.position = a.position AND f.site = 'final') "
        "FROM acts a WHERE a.model = 'gpt2' AND a.prompt_id = 1 AND a.position = $p "
        "AND a.site = $s", params={"p": position, "s": site}).fetchone()
    assert math.isclose(float(details.locator("dd.norm").inner_text()), norm, rel_tol=1e-3)
    assert math.isclose(float(details.locator("dd.uniform").inner_text().rstrip("°")), uniform,
                        rel_tol=1e-3)
    anchors = [t.inner_text() for t in details.locator("table.nearest td.tok").all()]
    assert anchors == [visible(a["token"]) for a in near]
    # the dims pushing toward the model's prediction at this position
    dims = db.sql("SELECT d.dim FROM acts a, range(64) AS d(dim) WHERE a.model = 'gpt2' AND "
                  "a.prompt_id = 1 AND a.position = $p AND a.site = $s ORDER BY "
                  "logit_contribution(a.vec, d.dim, $t) DESC LIMIT 10",
                  params={"p": position, "s": site, "t": predicted}).fetchall()
    shown = [int(r.locator("td").first.inner_text()) for r in
             details.locator("table.dims tr").all()[1:]]
    assert shown == [d[0] for d in dims]
    # the rank line: one point per pre_attn layer and the final site
    ranks = db.sql("SELECT token_rank(vec, $t) FROM acts WHERE model = 'gpt2' AND prompt_id = 1 "
                   "AND position = $p AND role IN ('pre_attn', 'final') ORDER BY layer",
                   params={"p": position, "t": predicted}).fetchall()
    points = details.locator("circle.rank-point").all()
    assert [int(c.get_attribute("data-rank")) for c in points] == [r[0] for r in ranks]
    assert tab.errors == []


def test_sql_page_runs_a_query_and_shows_its_rows(server, tab, db):
    tab.goto(server.base + "sql?run=0")
    tab.wait_for_selector("#functions .function")
    sql = ("SELECT position, token, round(uniform_angle(vec), 3) AS angle FROM acts "
           "WHERE model = 'llama' AND prompt_id = 0 AND site = 'final' ORDER BY position")
    tab.fill("#sql-editor", sql)
    tab.click("#run")
    tab.wait_for_selector("#row-count")
    want = db.sql(sql).fetchall()
    assert tab.locator("#row-count").inner_text() == f"{len(want)} rows"
    body = tab.locator("#result-table tr").all()[1:]
    got = [[c.inner_text() for c in r.locator("td").all()] for r in body]
    assert [[int(g[0]), g[1]] for g in got] == [[w[0], w[1]] for w in want]
    assert [float(g[2]) for g in got] == pytest.approx([w[2] for w in want])
    # an error is the CLI's, caret and all
    tab.fill("#sql-editor", "SELECT FROM WHERE")
    tab.click("#run")
    tab.wait_for_selector("#error:not([hidden])")
    assert "syntax error" in tab.locator("#error").inner_text()
    # the function docs are the registry's
    import actdb

    shown = tab.locator("#functions .function code").all_inner_texts()
    assert shown == [f["signature"] for f in actdb.Database.functions()]


def test_inputs_page_searches(server, tab):
    tab.goto(server.base)
    tab.wait_for_selector("table.prompts td")
    assert tab.locator("a.prompt-link").count() == 2
    tab.fill("#search", "CAPITAL")
    tab.wait_for_function("document.querySelectorAll('a.prompt-link').length === 1")
    assert tab.locator("a.prompt-link").inner_text() == "The capital of France."
    assert tab.errors == []


@pytest.fixture(scope="module")
def image_store(tmp_path_factory) -> Path:
    """A ViT trained on scikit-learn's digits, ingested over six held-out PNG files."""
    from click.testing import CliRunner
    from support.vision_models import train_digits

    from actdb.cli import cli

    digits = train_digits(tmp_path_factory.mktemp("digits"), held_out=6)
    store = tmp_path_factory.mktemp("image-store") / "digits.actdb"
    done = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(digits.model),
                                    "--images", str(digits.images), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    return store


def test_an_image_store_lists_its_images_and_reads_its_classifier(image_store, tab):
    import actdb

    with actdb.connect(image_store, device="cpu") as d:
        images = [r[0] for r in d.sql("SELECT image FROM prompts ORDER BY prompt_id").fetchall()]
        model = d.sql("SELECT model FROM models").fetchone()[0]
        want = d.sql("SELECT position, top_logits(vec, 1)[1].token FROM acts WHERE prompt_id = 2 "
                     "AND role = 'final' ORDER BY position").fetchall()
    with running(image_store) as s:
        tab.goto(s.base)
        tab.wait_for_selector("a.prompt-link")
        assert tab.locator("a.prompt-link").all_inner_texts() == images
        tab.goto(s.base + "input?prompt_id=2")
        tab.wait_for_selector(f"table.lens[data-model='{model}'] td.cell")
        assert tab.locator("#title").inner_text() == f"Input 2: {images[2]}"
        top = tab.locator(f"table.lens[data-model='{model}'] tr[data-site]").first
        assert top.get_attribute("data-site") == "final"
        tokens = [c.get_attribute("data-token") for c in top.locator("td.cell").all()]
        assert want and tokens == [t for _, t in want]  # the class names: 'digit 3', ...
        assert tab.errors == []


def test_lens_by_anchor_at_another_role(server, tab, db):
    tab.goto(server.base + "input?model=llama&prompt_id=0&lens=anchor&role=pre_mlp")
    tab.wait_for_selector("table.lens[data-model=llama] td.cell")
    rows = tab.locator("table.lens[data-model=llama] tr[data-site]")
    want_sites = [r[0] for r in db.sql(
        "SELECT site FROM sites WHERE model = 'llama' AND role IN ('pre_mlp', 'final') "
        "ORDER BY layer DESC").fetchall()]
    assert [r.get_attribute("data-site") for r in rows.all()] == want_sites
    for site in want_sites:
        want = db.sql("SELECT nearest_anchors(vec, 1)[1] FROM acts WHERE model = 'llama' AND "
                      "prompt_id = 0 AND site = $s ORDER BY position", params={"s": site}
                      ).fetchall()
        cells = tab.locator(f"table.lens[data-model=llama] tr[data-site='{site}'] td.cell")
        assert [c.get_attribute("data-token") for c in cells.all()] == [w[0]["token"]
                                                                         for w in want]
        assert [float(c.get_attribute("data-p")) for c in cells.all()] == pytest.approx(
            [w[0]["cosine"] for w in want])
    assert tab.errors == []
