"""`actdb plot` and `actdb.plot`: valid image files, numbers that equal the query layer's, errors.

For each picture: the CLI writes a valid PNG, SVG or PDF (by magic bytes or XML root); the
numbers drawn (heatmap array, line y-data, bar widths) equal the DataFrame the query layer
returns for the picture's own SQL, and that SQL agrees with an independently written query;
`--sql` prints SQL that runs as is. Bad input is exit 1 with one sentence naming the value.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner, Result
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from support.prompts import PROMPTS

import actdb
import actdb.plot
from actdb.cli import cli

KINDS = ("lens", "angles", "norms", "dims", "rotation")
DIMS_ARGS = ["--prompt-id", "0", "--position", "-1", "--token", " the"]
KIND_ARGS = {"lens": ["--prompt-id", "0"], "angles": [], "norms": [], "rotation": [],
             "dims": DIMS_ARGS}


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def error_line(result: Result, *needles: str) -> str:
    """Exit 1, one line on stderr starting 'Error:', no traceback, naming every needle."""
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr,
                                   result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error:"), lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def assert_image(path: Path, fmt: str) -> None:
    data = path.read_bytes()
    assert len(data) > 1000, f"{path} is suspiciously small"
    if fmt == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    elif fmt == "pdf":
        assert data[:5] == b"%PDF-"
    else:
        root = ET.fromstring(data)
        assert root.tag.endswith("svg"), root.tag


def close(a: object, b: object, tol: float = 1e-6) -> None:
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float),
                               rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def gpt2(family_store: Callable[[str], Path]) -> Path:
    return family_store("gpt2")


@pytest.fixture(scope="module")
def bert(family_store: Callable[[str], Path]) -> Path:
    return family_store("bert")


@pytest.fixture(scope="module")
def db(gpt2: Path) -> Iterator[actdb.Database]:
    with actdb.connect(gpt2, device="cpu") as database:
        yield database


def mean_lines(fig: Figure) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """label -> (x, y) of every mean line in every panel."""
    out = {}
    for ax in fig.axes:
        for line in ax.lines:
            if line.get_gid() == "mean":
                out[str(line.get_label())] = (np.asarray(line.get_xdata(), float),
                                              np.asarray(line.get_ydata(), float))
    return out


# -- files: every kind, every format -----------------------------------------------------------


@pytest.mark.parametrize("kind,fmt", [("lens", "png"), ("lens", "svg"), ("angles", "pdf"),
                                      ("norms", "svg"), ("dims", "png"), ("dims", "pdf"),
                                      ("rotation", "png"), ("angles", "png")])
def test_cli_writes_a_valid_image(gpt2: Path, tmp_path: Path, kind: str, fmt: str) -> None:
    out = tmp_path / f"{kind}.{fmt}"
    result = run("plot", kind, gpt2, *KIND_ARGS[kind], "-o", out, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert str(out) in result.stdout
    assert_image(out, fmt)


def test_default_output_is_kind_png_here(gpt2: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = run("plot", "norms", gpt2)
    assert result.exit_code == 0, result.stderr
    assert "norms.png" in result.stdout
    assert_image(tmp_path / "norms.png", "png")


def test_save_by_extension(gpt2: Path, tmp_path: Path) -> None:
    fig = actdb.plot.rotation(gpt2, device="cpu")
    for fmt in ("png", "svg", "pdf"):
        assert_image(actdb.plot.save(fig, tmp_path / f"r.{fmt.upper()}"), fmt)
    with pytest.raises(actdb.plot.PlotError, match="r.jpg"):
        actdb.plot.save(fig, tmp_path / "r.jpg")


# -- --sql: the picture's SQL, runnable as printed -------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_sql_flag_prints_runnable_sql_that_gives_the_plotted_data(
        gpt2: Path, db: actdb.Database, kind: str) -> None:
    result = run("plot", kind, gpt2, *KIND_ARGS[kind], "--sql")
    assert result.exit_code == 0, result.stderr
    printed = result.stdout
    assert "$" not in printed  # parameters are written in as literals
    data_fn = getattr(actdb.plot, f"{kind}_data")
    kwargs = ({"prompt_id": 0} if kind == "lens" else
              {"prompt_id": 0, "position": -1, "token": " the"} if kind == "dims" else {})
    sql, params, df = data_fn(db, **kwargs)
    pd.testing.assert_frame_equal(db.sql(printed).df(), df)
    pd.testing.assert_frame_equal(db.sql(sql, params=params).df(), df)


# -- lens ---------------------------------------------------------------------------------------


def test_lens_heatmap_equals_query_layer(db: actdb.Database) -> None:
    sql, params, df = actdb.plot.lens_data(db, prompt_id=0, by="anchor")
    assert params["roles"] == ["pre_attn", "final"]
    # The same request written by hand.
    ref = db.sql("""
        SELECT layer, site, position, token, n.token AS anchor, n.cosine AS cosine
        FROM (SELECT *, nearest_anchors(vec, 1)[1] AS n FROM acts
              WHERE prompt_id = 0 AND role IN ('pre_attn', 'final'))
        ORDER BY layer, position""").df()
    n_tokens = db.sql("SELECT n_tokens FROM prompts WHERE prompt_id = 0").fetchall()[0][0]
    assert len(df) == len(ref) == 3 * n_tokens  # 2 blocks + final
    close(df["cosine"], ref["cosine"])
    assert list(df["anchor"]) == list(ref["anchor"])

    fig = actdb.plot.lens(db, prompt_id=0, by="anchor")
    ax = fig.axes[0]
    grid = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
    want = df.pivot(index="layer", columns="position", values="cosine").to_numpy()
    assert grid.shape == want.shape == (3, n_tokens)
    close(grid, want)  # row 0 = first layer (drawn at the bottom)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["blocks.0.ln1", "blocks.1.ln1",
                                                            "final"]
    labels = [t.get_text() for t in ax.texts]
    assert labels == [actdb.plot.figures.show_token(a, 8) for a in
                      df.sort_values(["layer", "position"])["anchor"]]
    tokens = [t.get_text() for t in ax.get_xticklabels()]
    assert tokens[0] == "The" and tokens[-1] == "."
    title = ax.get_title()
    assert "gpt2" in title and "prompt 0" in title and "pre_attn" in title
    assert ax.get_xlabel() and ax.get_ylabel()
    assert "cosine" in fig.axes[1].get_ylabel()  # the colour bar


def test_logit_lens_final_row_is_the_models_argmax(db: actdb.Database, reference) -> None:
    ref = reference("gpt2")
    sql, params, df = actdb.plot.lens_data(db, prompt_id=3)
    assert "top_logits" in sql and "prob(" in sql
    fig = actdb.plot.lens(db, prompt_id=3)
    ax = fig.axes[0]
    sites = [t.get_text() for t in ax.get_yticklabels()]
    assert sites[-1] == "final" and "probability" in fig.axes[1].get_ylabel()
    n = len(ref.input_ids[3])
    labels = {t.get_gid(): t.get_text() for t in ax.texts}
    final_row = [labels[f"cell {len(sites) - 1} {j}"] for j in range(n)]
    # The model's own argmax at every position, from its float64 logits.
    argmax = ref.logits[ref.rows([3] * n, range(n))].argmax(-1)
    vocab = dict(db.sql("SELECT token_id, token FROM vocab").fetchall())
    assert final_row == [actdb.plot.figures.show_token(vocab[int(t)], 8) for t in argmax]
    # Colours: the probability of that token, as prob() says; the scale skips the first row.
    grid = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
    probs = np.exp(ref.logits[ref.rows([3] * n, range(n))])
    probs = probs / probs.sum(-1, keepdims=True)
    close(grid[-1], probs[np.arange(n), argmax], 1e-3)
    norm = ax.images[0].norm
    assert norm.vmin == np.nanmin(grid[1:]) and norm.vmax == np.nanmax(grid[1:])


def test_logit_lens_of_a_chosen_token(db: actdb.Database, tmp_path: Path) -> None:
    sql, params, df = actdb.plot.lens_data(db, prompt_id=0, token=" the")
    ref = db.sql("SELECT token_rank(vec, ' the') AS r, prob(vec, ' the') AS p FROM acts "
                 "WHERE prompt_id = 0 AND role IN ('pre_attn', 'final') "
                 "ORDER BY layer, site, position").df()
    assert list(df["rank"]) == list(ref["r"])
    close(df["prob"], ref["p"])
    fig = actdb.plot.lens(db, prompt_id=0, token=" the")
    assert [t.get_text() for t in fig.axes[0].texts] == [str(r) for r in df["rank"]]
    assert "' the'" in fig.axes[0].get_title()
    out = tmp_path / "t.png"
    result = run("plot", "lens", db.store.path, "--prompt-id", "0", "--token", " the",
                 "-o", out)
    assert result.exit_code == 0, result.stderr
    assert_image(out, "png")
    error_line(run("plot", "lens", db.store.path, "--prompt-id", "0", "--token", " the",
                   "--by", "anchor"), "--token")


def test_lens_anchor_set_and_role(db: actdb.Database) -> None:
    sql, params, df = actdb.plot.lens_data(db, prompt_id=2, anchors="embed", role="pre_mlp")
    assert params["roles"] == ["pre_mlp", "final"] and params["anchors"] == "embed"
    # Each cell's cosine is the cosine to that anchor, by another function.
    check = db.sql("""
        SELECT cosine_to_anchor(vec, $tid, 'embed') AS c FROM acts
        WHERE prompt_id = 2 AND site = $site AND position = $pos""",
                   params={"tid": int(df["anchor_id"][0]), "site": df["site"][0],
                           "pos": int(df["position"][0])}).fetchall()[0][0]
    close(check, df["cosine"][0], 1e-3)  # cosine_to_anchor works in half precision
    fig = actdb.plot.lens(db, prompt_id=2, anchors="embed", role="pre_mlp")
    assert "embed" in fig.axes[0].get_title()


def test_lens_without_lm_head_uses_post_mlp_and_embed_anchors(bert: Path) -> None:
    sql, params, df = actdb.plot.lens_data(bert, prompt_id=1, device="cpu")
    assert params["roles"] == ["post_mlp"]
    assert set(df["site"]) == {"blocks.0.ln2_post", "blocks.1.ln2_post"}
    fig = actdb.plot.lens(bert, prompt_id=1, device="cpu")
    assert "embed anchor" in fig.axes[0].get_title()


# -- angles, norms, rotation --------------------------------------------------------------------


def test_angles_lines_equal_query_layer(db: actdb.Database) -> None:
    sql, params, df = actdb.plot.angles_data(db)
    ref = db.sql("""
        SELECT layer, role, avg(uniform_angle(vec)) AS mean,
               quantile_cont(uniform_angle(vec), 0.1) AS lo
        FROM acts GROUP BY layer, role ORDER BY role, layer""").df()
    merged = df.merge(ref, on=["layer", "role"], suffixes=("", "_ref"))
    assert len(merged) == len(df) == len(ref) == 5
    close(merged["mean"], merged["mean_ref"])
    close(merged["lo"], merged["lo_ref"])

    fig = actdb.plot.angles(db)
    lines = mean_lines(fig)
    assert set(lines) == {"gpt2 · pre_attn", "gpt2 · pre_mlp", "gpt2 · final"}
    for role in ("pre_attn", "pre_mlp", "final"):
        part = df[df["role"] == role].sort_values("layer")
        x, y = lines[f"gpt2 · {role}"]
        close(x, part["layer"])
        close(y, part["mean"])
    refs = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == "reference"]
    assert refs and all(np.allclose(ln.get_ydata(), 90.0) for ln in refs)
    assert "degrees" in fig.axes[0].get_ylabel()
    assert "gpt2" in fig.get_suptitle() and "all-ones" in fig.get_suptitle()


def test_angles_compares_models_a_line_each(two_models: Path, tmp_path: Path) -> None:
    with actdb.connect(two_models, device="cpu") as db:
        sql, params, df = actdb.plot.angles_data(db, model=["gpt2", "llama"],
                                                 roles=["pre_attn"])
        fig = actdb.plot.angles(db, model=["gpt2", "llama"], roles=["pre_attn"])
        ref = db.sql("SELECT model, layer, avg(uniform_angle(vec)) AS mean FROM acts "
                     "WHERE role = 'pre_attn' GROUP BY ALL ORDER BY model, layer").df()
    close(df["mean"], ref["mean"])
    lines = mean_lines(fig)
    assert set(lines) == {"gpt2 · pre_attn", "llama · pre_attn"}
    for model in ("gpt2", "llama"):
        close(lines[f"{model} · pre_attn"][1], df[df["model"] == model]["mean"])
    with actdb.connect(two_models, device="cpu") as db:
        fig = actdb.plot.angles(db, model=["gpt2", "llama"], relative_depth=True)
        depth = dict(db.sql("SELECT model, n_layers FROM models").fetchall())
    lines = mean_lines(fig)
    for model in ("gpt2", "llama"):
        part = df[df["model"] == model]
        close(lines[f"{model} · pre_attn"][0], part["layer"] / depth[model])
    assert fig.axes[0].get_xlabel() == "depth" and "layer / n_layers" in fig.get_suptitle()
    out = tmp_path / "a.svg"
    result = run("plot", "angles", two_models, "--model", "gpt2", "--model", "llama",
                 "--role", "pre_attn", "--relative-depth", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert_image(out, "svg")


@pytest.fixture(scope="module")
def embed_and_not(tmp_path_factory: pytest.TempPathFactory,
                  model_dir: Callable[[str], Path]) -> Path:
    """bloom (a normed embedding: an `embed` site at layer -1) and llama (none) in one store."""
    path = tmp_path_factory.mktemp("embed-and-not") / "s.actdb"
    for family in ("bloom", "llama"):
        actdb.ingest(path, model=str(model_dir(family)), prompts=PROMPTS[:3], device="cpu",
                     name=family, chunk_tokens=8)
    return path


def _boxes(fig: Figure, ax: Any) -> list[Any]:
    """Where an axes' x label and x tick labels are drawn (display units); ticks outside
    the panel's range are not drawn."""
    renderer = fig.canvas.get_renderer()
    lo, hi = ax.get_xlim()
    texts = [ax.xaxis.label] + [t for x, t in zip(ax.get_xticks(), ax.get_xticklabels(),
                                                  strict=True)
                                if t.get_text() and lo <= x <= hi]
    return [t.get_window_extent(renderer) for t in texts if t.get_visible()]


@pytest.mark.parametrize("relative", [False, True])
def test_angles_panels_hold_their_points_bands_and_labels(embed_and_not: Path,
                                                          relative: bool) -> None:
    """Every role's panel shows its points, the embedding's at layer -1 too (in layers and in
    relative depth); a one-layer role's band is drawn through its own mean, not beside it;
    no panel's x labels reach into its neighbour's."""
    with actdb.connect(embed_and_not, device="cpu") as db:
        _, _, df = actdb.plot.angles_data(db, model=["bloom", "llama"])
        fig = actdb.plot.angles(db, model=["bloom", "llama"], relative_depth=relative)
        depth = dict(db.sql("SELECT model, n_layers FROM models").fetchall())
    assert set(df["role"]) >= {"embed", "final"}
    fig.canvas.draw()
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(panels)[0] == "embed"
    for role, ax in panels.items():
        lo, hi = ax.get_xlim()
        means = [ln for ln in ax.lines if ln.get_gid() == "mean"]
        want = df[df["role"] == role]
        assert len(means) == want["model"].nunique(), role
        for line in means:
            model = str(line.get_label()).split(" · ")[0]
            x = np.asarray(line.get_xdata(), float)
            assert ((lo < x) & (x < hi)).all(), (role, model, x, (lo, hi))
            part = want[want["model"] == model].sort_values("layer")
            at = part["layer"].to_numpy(float) / (depth[model] if relative else 1)
            close(np.asarray(line.get_ydata(), float), part["mean"])
            if len(part) > 1:
                close(x, at)
                continue
            # one layer: the bar (lo to hi of the band) stands at the mean's x
            assert abs(x[0] - at[0]) < 0.1 * (hi - lo)
            bars = [c for c in ax.collections if isinstance(c, LineCollection)
                    and np.isclose(c.get_segments()[0][0][0], x[0])]
            assert len(bars) == 1, (role, model)
            seg = bars[0].get_segments()[0]
            close([seg[0][1], seg[1][1]], [part["lo"].iloc[0], part["hi"].iloc[0]])
    axes = list(panels.values())
    for left, right in zip(axes, axes[1:], strict=False):
        for a in _boxes(fig, left):
            for b in _boxes(fig, right):
                assert a.x1 <= b.x0, (left.get_title(), right.get_title())


def test_norms_lines_equal_query_layer(db: actdb.Database) -> None:
    sql, params, df = actdb.plot.norms_data(db)
    ref = db.sql("SELECT layer, role, median(vec_norm(vec) / sqrt(64)) AS med FROM acts "
                 "GROUP BY ALL").df()
    merged = df.merge(ref, on=["layer", "role"], suffixes=("", "_ref"))
    assert len(merged) == len(df) == 5
    close(merged["center"], merged["med"], 1e-5)
    fig = actdb.plot.norms(db)
    lines = mean_lines(fig)
    for role, part in df.groupby("role"):
        close(lines[f"gpt2 · {role}"][1], part.sort_values("layer")["center"])
    assert all(ax.get_yscale() == "log" for ax in fig.axes)


def test_norms_mark_outlier_positions(model_dir, tmp_path: Path) -> None:
    """gpt2 with position 0's embedding made huge: an attention-sink-like token whose norm is
    far above the rest at every layer."""
    import torch
    from support.tiny_models import load_tiny_model

    model, tok = load_tiny_model("gpt2", model_dir("gpt2"))
    with torch.no_grad():
        model.transformer.wpe.weight[0].mul_(300)
    store = tmp_path / "sink.actdb"
    actdb.ingest(store, model=model, tokenizer=tok, prompts=["a b c d e f", "one two three"],
                 device="cpu", name="sink")
    with actdb.connect(store, device="cpu") as db:
        sql, params, df = actdb.plot.norms_data(db, roles=["pre_attn", "final"])
        ref = db.sql("""
            WITH x AS (SELECT layer, role, position, norm / 8 AS x FROM acts
                       WHERE role IN ('pre_attn', 'final'))
            SELECT layer, role, list(DISTINCT position ORDER BY position) AS outliers
            FROM x JOIN (SELECT layer, role, median(x) AS med FROM x GROUP BY ALL)
                 USING (layer, role)
            WHERE x > 10 * med GROUP BY ALL ORDER BY role, layer""").df()
        fig = actdb.plot.norms(db, roles=["pre_attn", "final"])
    assert len(ref) == 3 and all(list(o) == [0] for o in ref["outliers"])
    got = df.sort_values(["role", "layer"])
    assert [list(o) for o in got["outlier_positions"]] == [[0]] * 3
    marks = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == "outlier"]
    assert len(marks) == 3
    close(sorted(float(m.get_ydata()[0]) for m in marks), sorted(df["top"]))
    notes = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "outlier-label"]
    assert notes == ["pos 0"] * 3


def test_rotation_lines_equal_query_layer(db: actdb.Database) -> None:
    sql, params, df = actdb.plot.rotation_data(db, roles=["pre_attn", "final"])
    ref = db.sql("SELECT layer, role, avg(rotation_angle(vec)) AS mean, "
                 "quantile_cont(rotation_angle(vec), 0.9) AS hi FROM acts "
                 "WHERE role IN ('pre_attn', 'final') GROUP BY ALL ORDER BY role, layer").df()
    merged = df.merge(ref, on=["layer", "role"], suffixes=("", "_ref"))
    assert len(merged) == len(df) == 3
    close(merged["mean"], merged["mean_ref"])
    close(merged["hi"], merged["hi_ref"])
    fig = actdb.plot.rotation(db, roles=["pre_attn", "final"])
    lines = mean_lines(fig)
    assert set(lines) == {"gpt2 · pre_attn", "gpt2 · final"}
    close(lines["gpt2 · final"][1], df[df["role"] == "final"]["mean"])


# -- dims ---------------------------------------------------------------------------------------


def test_dims_bars_equal_query_layer(db: actdb.Database) -> None:
    sql, params, df = actdb.plot.dims_data(db, prompt_id=0, position=-1, token=" the", k=12)
    n = db.sql("SELECT n_tokens FROM prompts WHERE prompt_id = 0").fetchall()[0][0]
    assert params["position"] == n - 1 and params["site"] == "final"
    every = db.sql("""
        SELECT dim, logit_contribution(vec, dim, ' the') AS c
        FROM (SELECT vec, unnest(range(64)) AS dim FROM acts
              WHERE prompt_id = 0 AND position = $p AND site = 'final')""",
                   params={"p": n - 1}).df()
    top = every.reindex(every["c"].abs().sort_values(ascending=False).index)[:12]
    assert list(df["dim"]) == list(top["dim"])
    close(df["contribution"], top["c"])
    logit = db.sql("SELECT logit(vec, ' the') FROM acts WHERE prompt_id = 0 AND position = $p "
                   "AND site = 'final'", params={"p": n - 1}).fetchall()[0][0]
    close(df["total"][0], every["c"].sum(), 1e-5)
    close(df["total"][0], logit, 1e-4)  # gpt2 here has no LM-head bias: total = logit

    fig = actdb.plot.dims(db, prompt_id=0, position=-1, token=" the", k=12)
    ax = fig.axes[0]
    close([p.get_width() for p in ax.patches], df["contribution"])
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"dim {d}" for d in df["dim"]]
    title = ax.get_title()
    assert f"{df['total'][0]:.4g}" in title and "all 64 dims" in title
    assert "' the'" in title and f"position {n - 1}" in title and "site final" in title
    assert "logit" in ax.get_xlabel()


def test_dims_other_site_and_k_past_d(db: actdb.Database) -> None:
    sql, params, df = actdb.plot.dims_data(db, prompt_id=1, position=2, token=" the",
                                           site="blocks.1.ln1", k=500)
    assert len(df) == 64 and int(df["n_dims"][0]) == 64
    close(df["total"][0], df["contribution"].sum(), 1e-5)


# -- errors -------------------------------------------------------------------------------------


def test_prompt_id_that_does_not_exist(gpt2: Path) -> None:
    error_line(run("plot", "lens", gpt2, "--prompt-id", "99"), "prompt id 99")
    error_line(run("plot", "dims", gpt2, "--prompt-id", "-4", "--position", "0",
                   "--token", "the"), "prompt id -4")


@pytest.mark.parametrize("position", ["16", "500", "-17"])
def test_position_past_the_prompts_end(gpt2: Path, position: str) -> None:
    line = error_line(run("plot", "dims", gpt2, "--prompt-id", "0", "--position", position,
                          "--token", "the"), f"position {position}", "16 tokens")
    assert line.count(". ") == 0  # one sentence


def test_token_that_is_not_one_token(gpt2: Path) -> None:
    error_line(run("plot", "dims", gpt2, "--prompt-id", "0", "--position", "3",
                   "--token", "xyzzy"), "'xyzzy'", "not one token")


def test_dims_without_lm_head_splits_the_embedding_cosine(bert: Path, tmp_path: Path) -> None:
    out = tmp_path / "dims.png"
    result = run("plot", "dims", bert, "--prompt-id", "0", "--position", "1", "--token", "the",
                 "--k", "8", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    sql, params, df = actdb.plot.dims_data(bert, 0, 1, "the", k=8, device="cpu")
    with actdb.connect(bert, device="cpu") as db:
        where = ("WHERE prompt_id = 0 AND position = 1 AND site = $site")
        site = params["site"]
        every = db.sql(f"SELECT d, anchor_contribution(vec, d, 'the', 'embed') AS c FROM "
                       f"(SELECT vec, unnest(range(64)) AS d FROM acts {where})",
                       params={"site": site}).df()
        cos = db.sql(f"SELECT cosine_to_anchor(vec, 'the', 'embed') FROM acts {where}",
                     params={"site": site}).fetchall()[0][0]
    assert abs(every["c"].sum() - cos) < 1e-3
    assert abs(df["total"].iloc[0] - every["c"].sum()) < 1e-9
    top = every.reindex(every["c"].abs().sort_values(ascending=False).index).head(8)
    assert list(df["dim"]) == list(top["d"])
    fig = actdb.plot.dims(bert, 0, 1, "the", k=8, device="cpu")
    widths = [p.get_width() for p in fig.axes[0].patches]
    np.testing.assert_allclose(widths, df["contribution"].to_numpy())
    assert "cosine" in fig.axes[0].get_xlabel()


def test_unknown_site_role_model(gpt2: Path) -> None:
    error_line(run("plot", "dims", gpt2, *DIMS_ARGS, "--site", "blocks.9.ln1"),
               "'blocks.9.ln1'", "blocks.0.ln1")
    error_line(run("plot", "lens", gpt2, "--prompt-id", "0", "--role", "q_norm"),
               "'q_norm'", "pre_attn")
    error_line(run("plot", "norms", gpt2, "--model", "gpt3"), "'gpt3'", "'gpt2'")


def test_several_models_need_model(two_models: Path) -> None:
    error_line(run("plot", "lens", two_models, "--prompt-id", "0"), "'gpt2'", "'llama'",
               "--model")
    error_line(run("plot", "angles", two_models, "--model", "gpt2", "--model", "opt"), "'opt'")


def test_store_that_does_not_exist(tmp_path: Path) -> None:
    error_line(run("plot", "angles", tmp_path / "nope.actdb"), "nope.actdb")


def test_bad_output_extension_is_a_usage_error(gpt2: Path, tmp_path: Path) -> None:
    result = run("plot", "norms", gpt2, "-o", tmp_path / "n.jpg")
    assert result.exit_code == 2
    assert "n.jpg" in result.stderr and ".png" in result.stderr
    assert not (tmp_path / "n.jpg").exists()
    error_line(run("plot", "norms", gpt2, "-o", tmp_path / "no" / "n.png"), "does not exist")


def test_library_errors_are_actdb_errors(gpt2: Path) -> None:
    with pytest.raises(actdb.QueryError, match="prompt id 42"):
        actdb.plot.lens(gpt2, prompt_id=42, device="cpu")
    with pytest.raises(actdb.ActdbError, match="position 99"):
        actdb.plot.dims_data(gpt2, 0, 99, " the", device="cpu")


# -- help ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_help_ends_with_an_example(kind: str) -> None:
    result = run("plot", kind, "--help")
    assert result.exit_code == 0
    text = result.stdout
    assert "Example:" in text and f"actdb plot {kind}" in text[text.index("Example:"):]
    assert "--sql" in text and "-o, --output" in text


def test_plot_group_lists_every_picture() -> None:
    result = run("plot", "--help")
    assert result.exit_code == 0 and "Example:" in result.stdout
    for kind in KINDS:
        assert kind in result.stdout
