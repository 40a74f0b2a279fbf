"""`actdb report`: one self-contained HTML page whose every number equals an independent answer.

The page is written by the CLI on the gpt2 tiny store; its sections, figures and SQL are
checked, each number shown is recomputed here with other SQL (or from the float64 reference
run), and the page is opened in a real headless Chromium, which must decode every figure and
run the page's script without an error.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from support.report_page import ReportPage as _Page

import actdb
from actdb.cli import cli
from actdb.store.layer_weights import array_name, read_manifest
from actdb.store.store import Store

SECTIONS = ["angles", "norms", "rotation", "spectrum", "emergence", "dims", "weights"]
WITH_SQL = SECTIONS[:-1]  # the weight reading is read from the stored arrays (its source)


@pytest.fixture(scope="module")
def page(family_store, tmp_path_factory) -> tuple[Path, Path]:
    store = family_store("gpt2")
    out = tmp_path_factory.mktemp("report") / "report.html"
    result = CliRunner().invoke(cli, ["report", str(store), "-o", str(out), "--device", "cpu"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert result.stdout.strip() == f"wrote {out}"
    return store, out


def test_report_sections_figures_and_sql(page) -> None:
    store, out = page
    p = _Page()
    p.feed(out.read_text(encoding="utf-8"))
    assert p.sections == SECTIONS
    assert len(p.images) == len(SECTIONS)
    assert all(link.startswith("data:image/png;base64,") for link in p.links)  # self-contained
    for src in p.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(p.sql) == len(WITH_SQL)
    with actdb.connect(store, device="cpu") as db:
        for sql in p.sql:  # each shown query runs as is through the query layer
            assert "$" not in sql and len(db.sql(sql).fetchall()) > 0
    text = out.read_text(encoding="utf-8")
    assert text.count("<b>Published:</b>") == text.count("<b>This model:</b>") == len(SECTIONS)


def _number(p: _Page, key: str) -> float | str:
    value, shown = p.numbers[f"gpt2/{key}"]
    try:
        v = float(value)
    except ValueError:
        assert shown == value
        return value
    assert shown == (f"{v:.4g}" if "." in value or "e" in value else value), (key, shown)
    return v


def test_every_number_equals_an_independent_answer(page, reference) -> None:
    store, out = page
    p = _Page()
    p.feed(out.read_text(encoding="utf-8"))
    shown = {k.split("/", 1)[1] for k in p.numbers}
    with actdb.connect(store, device="cpu") as db:
        def one(sql: str) -> list[tuple]:
            return db.sql(sql).fetchall()

        res = "role IN ('pre_attn', 'pre_mlp', 'final')"
        ua = one(f"SELECT layer, role, avg(uniform_angle(vec)) FROM acts WHERE {res} "
                 "GROUP BY ALL")
        rot = one(f"SELECT layer, role, avg(rotation_angle(vec)) FROM acts WHERE {res} "
                  "GROUP BY ALL")
        med = one("SELECT layer, median(norm / 8) FROM acts WHERE role = 'pre_attn' "
                  "GROUP BY ALL ORDER BY layer")
        big = one("WITH x AS (SELECT layer, role, position, norm / 8 AS x FROM acts "
                  f"WHERE {res}) SELECT DISTINCT position FROM x JOIN (SELECT layer, role, "
                  "median(x) AS m FROM x GROUP BY ALL) USING (layer, role) WHERE x > 10 * m")
        sites = one("SELECT site, list(to_list(normalized(vec))) FROM acts "
                    "WHERE role IN ('pre_attn', 'final') GROUP BY site")
        last = one("SELECT a.layer, a.site, a.prompt_id, top_logits(a.vec, 1)[1].token_id, "
                   "top_logits(f.vec, 1)[1].token_id FROM acts a JOIN acts f "
                   "USING (model, prompt_id, position) WHERE f.site = 'final' AND "
                   "a.role = 'pre_attn' AND a.position = a.n_tokens - 1 ORDER BY a.layer")
        answer = dict(one("SELECT prompt_id, top_logits(vec, 1)[1].token_id FROM acts "
                          "WHERE site = 'final' AND position_from_end = 0"))
        lengths = dict(one("SELECT prompt_id, n_tokens FROM acts WHERE site = 'final' "
                           "AND position = 0"))
    assert shown == {"angles/angle_min", "angles/angle_max", "norms/norm_first",
                     "norms/layer_first", "norms/norm_last", "norms/layer_last",
                     "norms/outliers", "rotation/rotation_min", "rotation/rotation_max",
                     "spectrum/vanishing_min", "spectrum/vanishing_max", "spectrum/n_min",
                     "spectrum/n_max", "emergence/prompts", "emergence/top1_last_inner",
                     "emergence/stays_half_layer", "dims/top_share", "dims/top_dim",
                     "weights/ranks", "weights/best_layer", "weights/best_head",
                     "weights/best_rank", "weights/best_token", "weights/best_cosine",
                     "weights/median_cosine", "weights/answer", "weights/neuron_layer",
                     "weights/neuron", "weights/neuron_cosine"}
    close = {"rel": 1e-9}
    assert _number(p, "angles/angle_min") == pytest.approx(min(r[2] for r in ua), **close)
    assert _number(p, "angles/angle_max") == pytest.approx(max(r[2] for r in ua), **close)
    assert _number(p, "rotation/rotation_min") == pytest.approx(min(r[2] for r in rot), **close)
    assert _number(p, "rotation/rotation_max") == pytest.approx(max(r[2] for r in rot), **close)
    assert _number(p, "norms/norm_first") == pytest.approx(med[0][1], **close)
    assert _number(p, "norms/norm_last") == pytest.approx(med[-1][1], **close)
    assert (_number(p, "norms/layer_first"), _number(p, "norms/layer_last")) == (0, 1)
    assert _number(p, "norms/outliers") == (", ".join(str(r[0]) for r in sorted(big))
                                            or "none")

    # Spectrum: numpy's covariance eigenvalues of the same vectors, counted here.
    counts, sizes = [], []
    for _, vecs in sites:
        z = np.asarray(vecs, dtype=np.float64)
        eig = np.sort(np.linalg.eigvalsh(np.cov(z.T)))[::-1][: len(z) - 1]
        counts.append(int((eig < 1e-3 * np.median(eig)).sum()))
        sizes.append(len(z))
    assert min(counts) >= 1, "LayerNorm's centring leaves one vanishing direction"
    assert _number(p, "spectrum/vanishing_min") == min(counts)
    assert _number(p, "spectrum/vanishing_max") == max(counts)
    assert (_number(p, "spectrum/n_min"), _number(p, "spectrum/n_max")) == (min(sizes),
                                                                             max(sizes))

    # Emergence: by comparing top tokens, not ranks.
    assert _number(p, "emergence/prompts") == len(answer) == len(lengths)
    layers = sorted({r[0] for r in last})
    share = {layer: np.mean([r[3] == r[4] for r in last if r[0] == layer]) for layer in layers}
    assert _number(p, "emergence/top1_last_inner") == pytest.approx(share[layers[-1]])
    stays: object = "none"  # the first layer from which every later layer has >= half
    for layer in reversed(layers):
        if share[layer] < 0.5:
            break
        stays = layer
    assert _number(p, "emergence/stays_half_layer") == stays

    # Dims: from the float64 reference run (final norm output times W_U[answer]).
    ref = reference("gpt2")
    rows = ref.rows(list(lengths), [n - 1 for n in lengths.values()])
    h = ref.final.normed(ref.final.x[rows])  # [prompts, d]
    contrib = np.abs(h * ref.W_U[[answer[q] for q in lengths]]).mean(0)  # [d]
    top = np.argsort(-contrib)[:10]
    assert _number(p, "dims/top_dim") == int(top[0])
    assert _number(p, "dims/top_share") == pytest.approx(contrib[top].sum() / contrib.sum(),
                                                         rel=2e-3)


    # Weights: each head's OV circuit from the stored factors and the norm's stored gain, a
    # float64 NumPy SVD of the whole d x d product, against unit rows of W_U.
    st = Store(store)
    manifest = read_manifest(st.arrays, 0)
    assert manifest is not None
    unit = ref.W_U / np.linalg.norm(ref.W_U, axis=1, keepdims=True)
    best, firsts = (0.0, None), []
    for entry in manifest["layers"]:
        layer, attn = entry["layer"], entry["attn"]
        g = st.arrays.weight(0, f"sites/{attn['reads']}/gain").astype(np.float64)
        wv = st.arrays.weight(0, array_name(layer, "attn", "W_V")).astype(np.float64)
        wo = st.arrays.weight(0, array_name(layer, "attn", "W_O")).astype(np.float64)
        dh = attn["d_head"]
        for h in range(attn["n_heads"]):
            kv = attn["kv_of_head"][h]
            m = (g[:, None] * wv.reshape(-1, dh, len(g))[kv].T) @ wo.reshape(-1, dh, len(g))[h]
            vt = np.linalg.svd(m)[2]
            for r in range(3):
                cos = np.abs(unit @ vt[r])
                if r == 0:
                    firsts.append(cos.max())
                if cos.max() > best[0] + 1e-9:
                    best = (float(cos.max()), (layer, h, r + 1, int(cos.argmax())))
    layer, h, r, tid = best[1]
    assert (_number(p, "weights/best_layer"), _number(p, "weights/best_head"),
            _number(p, "weights/best_rank")) == (layer, h, r)
    assert abs(float(_number(p, "weights/best_cosine"))) == pytest.approx(best[0], rel=1e-4)
    assert _number(p, "weights/median_cosine") == pytest.approx(np.median(firsts), rel=1e-4)
    counts = np.bincount(list(answer.values()))
    top_answer = int(np.argmax(counts))  # the most frequent answer (lowest id among ties)
    cos_n = []
    for entry in manifest["layers"]:
        w = st.arrays.weight(0, array_name(entry["layer"], "mlp", "W_out")).astype(np.float64)
        cos = (w @ unit[top_answer]) / np.linalg.norm(w, axis=1)
        cos_n += [(float(c), entry["layer"], n) for n, c in enumerate(cos)]
    c, nl, n = max(cos_n)
    assert (_number(p, "weights/neuron_layer"), _number(p, "weights/neuron")) == (nl, n)
    assert _number(p, "weights/neuron_cosine") == pytest.approx(c, rel=1e-4)


def test_python_api_writes_the_same_sections(family_store, tmp_path: Path) -> None:
    with actdb.connect(family_store("bert"), device="cpu") as db:
        out = actdb.report(db, tmp_path / "bert.html")
    p = _Page()
    p.feed(out.read_text(encoding="utf-8"))
    assert p.sections == ["angles", "norms", "rotation", "spectrum"]  # no LM head: no lens


def test_report_bad_output_and_missing_store(tmp_path: Path) -> None:
    bad = CliRunner().invoke(cli, ["report", str(tmp_path / "none.actdb"), "-o",
                                   str(tmp_path / "r.html")])
    assert bad.exit_code == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("Error:")
    usage = CliRunner().invoke(cli, ["report", str(tmp_path), "-o", str(tmp_path / "r.png")])
    assert usage.exit_code == 2 and "must end in .html" in usage.stderr


@pytest.mark.slow
def test_report_opens_in_headless_chromium(page, tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    _, out = page
    run = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", out.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    check = re.search(r'id="page-check"[^>]*>([^<]*)<', run.stdout)
    assert check is not None, run.stdout[-500:]
    assert check.group(1) == f"figures decoded: {len(SECTIONS)} of {len(SECTIONS)}"
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console


def test_the_layer_the_answer_stays_top_from_is_not_an_early_fluke() -> None:
    from actdb.plot.report import stays_from

    # top for half the prompts at layer 0, lost at 1, then kept from 2 on
    assert stays_from([0, 1, 2, 3], [0.5, 0.2, 0.6, 0.7]) == 2
    assert stays_from([0, 1, 2, 3], [0.5, 0.6, 0.6, 0.7]) == 0
    assert stays_from([0, 1, 2], [0.9, 0.8, 0.1]) is None  # lost at the last layer
    assert stays_from([], []) is None


def test_a_site_of_one_vector_has_no_vanishing_eigenvalues() -> None:
    """spectrum() is NULL below 2 vectors (a tower's one pooled row on one image: CLIP's
    post_layernorm): the count is 0, not a traceback."""
    from actdb.plot.report import vanishing

    assert vanishing(None, 1) == 0
    # 4 vectors span 3 directions: of [4, 2, 1e-5, 0], the third vanishes, the fourth is
    # zero by the count alone
    assert vanishing([4.0, 2.0, 1e-5, 0.0], 4) == 1
