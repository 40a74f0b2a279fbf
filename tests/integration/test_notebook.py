"""A store that feels native in notebooks, DataFrames and training loops: Result previews and
DuckDB's fetch names, exports that round-trip to `db.vectors`, `db.dataset`, xarray over the
Zarr arrays, and a real Jupyter kernel displaying a result, a figure and a dataset batch."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import actdb

FINAL = "SELECT prompt_id, position, layer, token, vec FROM acts WHERE site = 'final' " \
        "ORDER BY prompt_id, position"


@pytest.fixture(scope="module")
def store(family_store: Callable[[str], Path]) -> Path:
    return family_store("llama")


@pytest.fixture(scope="module")
def db(store: Path) -> actdb.Database:
    return actdb.connect(store, device="cpu")


def zarr_vectors(db: actdb.Database, store: Path, site: str, n: int) -> np.ndarray:
    """float64 `norm * direction` for the first n rows of a site, read with zarr-python."""
    import zarr

    model_id = db.sql("SELECT model_id FROM models").fetchone()[0]  # type: ignore[index]
    g = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    direction = np.asarray(g[f"models/{model_id}/acts/{site}/direction"][:n], np.float64)
    norm = np.asarray(g[f"models/{model_id}/acts/{site}/norm"][:n], np.float64)
    return direction * norm[:, None]


# -- Result and Database in a REPL -------------------------------------------------------------


def test_result_repr_shows_rows_and_count_and_runs_once(db: actdb.Database) -> None:
    r = db.sql(FINAL.replace("vec", "round(vec_norm(vec), 3) AS norm"))
    before = db.stats["chunks_read"]
    text = repr(r)
    after_first = db.stats["chunks_read"]
    assert after_first > before  # it ran the query
    n = len(db.sql(FINAL).fetchall())
    assert f"[{n} rows x 5 columns (first 10 shown)]" in text
    assert text.count("\n") == 11  # header, 10 rows, the count line
    assert "␣" in text  # tokens' leading spaces are visible
    html = r._repr_html_()
    assert "<table" in html and f"{n} rows x 5 columns" in html
    df = r.df()
    assert db.stats["chunks_read"] == after_first  # repr, html and df: computed once
    assert len(df) == n and list(df.columns) == r.columns


def test_explain_shows_its_plan_as_drawn_in_a_notebook_and_a_repl(db: actdb.Database) -> None:
    """EXPLAIN's plan is a drawing whose spaces and newlines are its layout: the notebook's
    HTML shows each plan in a <pre> block, character for character (no whitespace glyphs),
    and the REPL's text shows it line by line, as DuckDB drew it."""
    from html.parser import HTMLParser

    result = db.sql("EXPLAIN SELECT count(*) FROM acts WHERE layer = 1")
    plans = result.fetchall()  # what DuckDB answered: (name, drawing) rows
    assert plans and all("\n" in plan and "  " in plan for _, plan in plans)

    class Blocks(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.pre: list[str] = []
            self.bold: list[str] = []
            self._in: str | None = None

        def handle_starttag(self, tag: str, attrs: object) -> None:
            self._in = tag if tag in ("pre", "b") else self._in
            if tag == "pre":
                self.pre.append("")
            elif tag == "b":
                self.bold.append("")

        def handle_endtag(self, tag: str) -> None:
            self._in = None

        def handle_data(self, data: str) -> None:
            if self._in == "pre":
                self.pre[-1] += data
            elif self._in == "b":
                self.bold[-1] += data

    blocks = Blocks()
    page = result._repr_html_()
    blocks.feed(page)
    assert blocks.pre == [plan.rstrip() for _, plan in plans]
    assert blocks.bold == [name for name, _ in plans]
    assert not any(mark in page for mark in ("\u2423", "\u21b5"))  # the glyphs for " ", "\n"
    assert repr(result) == "\n".join(f"{name}:\n{plan.rstrip()}" for name, plan in plans)


def test_duckdb_fetch_names(db: actdb.Database) -> None:
    q = "SELECT prompt_id, position, token FROM tokens ORDER BY prompt_id, position"
    expected = db.sql(q).fetchall()
    r = db.sql(q)
    assert r.fetchone() == expected[0] and r.fetchone() == expected[1]
    assert r.arrow().num_rows == len(expected) and isinstance(r.arrow(), pa.Table)
    arrays = db.sql(q).fetchnumpy()
    assert arrays["position"].tolist() == [e[1] for e in expected]
    assert db.sql(q).limit(3).fetchall() == expected[:3]
    assert db.sql(q).limit(2, offset=1).fetchall() == expected[1:3]
    numbers = db.sql(q.replace(", token", "")).torch()
    assert numbers["position"].tolist() == [e[1] for e in expected]
    with pytest.raises(actdb.QueryError, match="column 'token' holds"):
        db.sql(q).torch()  # text is no tensor: refused, as DuckDB does, not left out
    try:
        import polars  # noqa: F401
    except ImportError:
        with pytest.raises(actdb.ActdbError, match="needs polars, which is not installed"):
            db.sql(q).pl()
    else:
        assert db.sql(q).pl().height == len(expected)


def test_torch_gives_vectors_and_lists_as_tensors(db: actdb.Database, store: Path) -> None:
    """`.torch()` of a `vec` column (and a view) is the vectors [N, d], not their handles; of a
    list column [N, L]; `db.vectors` takes a list column too (a vector a query computed)."""
    q = ("SELECT prompt_id, position, vec, normed(vec) AS y, to_list(vec) AS l FROM acts "
         "WHERE site = 'final' ORDER BY prompt_id, position")
    t = db.sql(q).torch()
    n = len(t["position"])
    assert t["vec"].shape == t["y"].shape == t["l"].shape and t["vec"].shape[0] == n
    assert t["vec"].dtype == torch.float32
    rows = db.sql("SELECT min(prompt_id), count(*) FROM acts WHERE site = 'final'").fetchone()
    assert rows == (0, n)
    # the final site's rows in the store's order are the query's (prompts ingested in order)
    want = zarr_vectors(db, store, "final", n)
    np.testing.assert_allclose(t["vec"].double().numpy(), want, rtol=2e-3,
                               atol=2e-3 * np.abs(want).max())
    assert torch.equal(t["l"], t["vec"])
    assert torch.equal(t["y"], db.vectors(q.replace("vec, normed(vec) AS y", "normed(vec)")
                                          .replace(", to_list(vec) AS l", "")
                                          .replace("prompt_id, position, ", "")))
    assert torch.equal(db.vectors(q.replace("vec, normed(vec) AS y, to_list(vec) AS l",
                                            "to_list(vec)").replace("prompt_id, position, ",
                                                                    "")), t["vec"])
    delta = db.sql("SELECT delta(vec) AS d FROM acts WHERE role = 'pre_attn' "
                   "ORDER BY prompt_id, position, layer").fetchall()
    got = db.vectors("SELECT delta(vec) FROM acts WHERE role = 'pre_attn' "
                     "ORDER BY prompt_id, position, layer")
    assert got.shape == (len(delta), len(delta[0][0]))
    np.testing.assert_array_equal(got.numpy(), np.array([d for (d,) in delta], np.float32))
    # handles however the query names them: a subquery's alias, a CTE, a view after a `*`
    # (review finding: the outermost SELECT's syntax alone missed them, and handles came
    # back as integers)
    for q2, col in (("SELECT h FROM (SELECT vec AS h FROM acts WHERE site = 'final' "
                     "ORDER BY prompt_id, position)", "h"),
                    ("WITH c AS (SELECT vec AS v, prompt_id, position FROM acts WHERE site = "
                     "'final') SELECT v FROM c ORDER BY prompt_id, position", "v"),
                    ("SELECT * EXCLUDE (token, site, role, head, model), vec AS w FROM acts "
                     "WHERE site = 'final' ORDER BY prompt_id, position", "w")):
        got2 = db.sql(q2).torch()
        assert torch.equal(got2[col], t["vec"]), q2
    sums = db.sql("SELECT layer, sum(position) AS s, 1.5 AS d, [1.5, 2.5] AS l FROM acts "
                  "GROUP BY layer ORDER BY layer").torch()  # DECIMAL and HUGEINT: float64
    assert sums["s"].dtype == sums["d"].dtype == sums["l"].dtype == torch.float64
    assert sums["l"].shape == (len(sums["layer"]), 2) and float(sums["d"][0]) == 1.5
    with pytest.raises(actdb.QueryError, match="lists of 1 to 2 values"):
        db.sql("SELECT CASE WHEN position = 0 THEN [1.0, 2.0] ELSE [1.0] END::FLOAT[] AS l "
               "FROM tokens").torch()


def test_a_query_that_is_not_text_is_one_sentence(db: actdb.Database) -> None:
    with pytest.raises(actdb.QueryError, match="a query is a string of SQL, not NoneType"):
        db.sql(None)  # type: ignore[arg-type]


def test_show_prints_preview(db: actdb.Database, capsys: pytest.CaptureFixture[str]) -> None:
    db.sql("SELECT 1 AS one").show()
    assert "[1 rows x 1 columns]" in capsys.readouterr().out


def test_database_repr_names_store_and_models(db: actdb.Database, store: Path) -> None:
    text = repr(db)
    assert str(store) in text and "'llama'" in text


# -- exports -----------------------------------------------------------------------------------


def test_parquet_export_round_trips_to_db_vectors(db: actdb.Database, store: Path,
                                                 tmp_path: Path) -> None:
    done = db.export(FINAL, tmp_path / "final.parquet")
    table = pq.read_table(tmp_path / "final.parquet")
    ref = db.vectors(FINAL).numpy()
    assert done.rows == len(ref) == table.num_rows and done.d == ref.shape[1]
    assert table.column_names == ["prompt_id", "position", "layer", "token", "vec"]
    assert pa.types.is_fixed_size_list(table.schema.field("vec").type)
    got = np.asarray(table.column("vec").combine_chunks().flatten()).reshape(len(ref), -1)
    np.testing.assert_array_equal(got, ref)
    meta = db.sql(FINAL.replace(", vec", "")).df()
    assert table.column("token").to_pylist() == meta["token"].tolist()
    # ... and both equal norm * direction read by zarr-python (acts rows in storage order).
    n = len(ref)
    stored = zarr_vectors(db, store, "final", n)
    np.testing.assert_allclose(got, stored, rtol=1e-5, atol=1e-6)
    # In an order other than storage order, rows still carry their own vectors.
    backwards = FINAL.replace("ORDER BY prompt_id, position", "ORDER BY position DESC, prompt_id")
    db.export(backwards, tmp_path / "backwards.parquet")
    table = pq.read_table(tmp_path / "backwards.parquet")
    row_of = {(p, q): i for i, (p, q) in enumerate(zip(meta["prompt_id"], meta["position"],
                                                      strict=True))}
    order = [row_of[k] for k in zip(table.column("prompt_id").to_pylist(),
                                     table.column("position").to_pylist(), strict=True)]
    assert order != sorted(order)
    got = np.asarray(table.column("vec").combine_chunks().flatten()).reshape(n, -1)
    np.testing.assert_allclose(got, stored[order], rtol=1e-5, atol=1e-6)


def test_safetensors_and_npy_exports(db: actdb.Database, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    q = ("SELECT prompt_id, position, normalized(vec) AS z FROM acts WHERE site = 'blocks.0.ln1'"
         " ORDER BY prompt_id, position")
    db.export(q, tmp_path / "z.safetensors")
    f = load_file(str(tmp_path / "z.safetensors"))
    ref = db.vectors(q.replace("normalized(vec) AS z", "normalized(vec) AS vec")).numpy()
    np.testing.assert_array_equal(f["vec"], ref)
    meta = db.sql(q).df()
    np.testing.assert_array_equal(f["position"], meta["position"].to_numpy())
    # The view was applied: z = x / sqrt(mean(x^2) + eps) for an RMSNorm (float64 reference).
    raw = db.vectors(q.replace("normalized(vec) AS z", "vec")).numpy().astype(np.float64)
    eps = db.sql("SELECT eps FROM sites WHERE site = 'blocks.0.ln1'").fetchone()[0]  # type: ignore[index]
    z = raw / np.sqrt((raw ** 2).mean(-1, keepdims=True) + eps)
    np.testing.assert_allclose(f["vec"], z, rtol=1e-4, atol=1e-5)
    done = db.export(q, tmp_path / "z.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "z.npy"), ref)
    assert done.columns == [] and done.left_out == ["prompt_id", "position"]
    # a vector the query computed (a list of numbers), also named vec beside another list
    order = " FROM acts WHERE role = 'pre_attn' ORDER BY prompt_id, position, layer"
    want = db.vectors("SELECT delta(vec)" + order).numpy()
    db.export("SELECT prompt_id, delta(vec) AS d" + order, tmp_path / "d.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "d.npy"), want)
    db.export("SELECT prompt_id, delta(vec) AS vec, to_list(vec) AS x" + order,
              tmp_path / "d.parquet")
    table = pq.read_table(tmp_path / "d.parquet")
    np.testing.assert_array_equal(np.stack(table.column("vec").to_numpy(zero_copy_only=False)),
                                  want)
    assert table.column_names == ["prompt_id", "x", "vec"]
    with pytest.raises(actdb.QueryError, match="column 'token' is string"):
        db.export(FINAL, tmp_path / "t.safetensors")
    with pytest.raises(actdb.QueryError, match="must end in .parquet, .npy, .safetensors"):
        db.export(FINAL, tmp_path / "t.csv")


# -- the training bridge -----------------------------------------------------------------------


def test_dataset_streams_every_row_once(db: actdb.Database) -> None:
    ref = db.vectors(FINAL)
    layers = db.sql(FINAL).df()["position"].to_numpy()
    plain = list(db.dataset(FINAL, batch_size=7, columns=["position"]))
    assert all(len(b["vec"]) == 7 for b in plain[:-1])
    torch.testing.assert_close(torch.cat([b["vec"] for b in plain]), ref, rtol=0, atol=0)
    np.testing.assert_array_equal(torch.cat([b["position"] for b in plain]).numpy(), layers)

    ds = db.dataset(FINAL, batch_size=5, shuffle_buffer=12, seed=3,
                    columns=["prompt_id", "position", "token"])
    first = list(ds)
    x = torch.cat([b["vec"] for b in first])
    assert not torch.equal(x, ref)  # shuffled ...
    meta = db.sql(FINAL).df()
    row_of = {(p, q): i for i, (p, q) in enumerate(zip(meta["prompt_id"], meta["position"],
                                                      strict=True))}
    keys = zip(torch.cat([b["prompt_id"] for b in first]).tolist(),
               torch.cat([b["position"] for b in first]).tolist(), strict=True)
    order = [row_of[k] for k in keys]
    assert sorted(order) == list(range(len(ref)))  # ... a permutation of every row
    torch.testing.assert_close(x, ref[order], rtol=0, atol=0)  # columns travel with rows
    tokens = [t for b in first for t in b["token"]]
    assert tokens == meta["token"].to_numpy()[order].tolist()
    again = torch.cat([b["vec"] for b in db.dataset(FINAL, batch_size=5, shuffle_buffer=12,
                                                    seed=3)])
    torch.testing.assert_close(again, x)  # the seed decides the order
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    assert next(iter(loader))["vec"].shape == (5, ref.shape[1])
    # Without columns=, a batch holds what the query selects (layer was dropped in silence);
    # columns=() keeps the vectors alone.
    whole = next(iter(db.dataset(FINAL, batch_size=4)))
    assert list(whole) == ["vec", "prompt_id", "position", "layer", "token"]
    np.testing.assert_array_equal(whole["layer"].numpy(), meta["layer"].to_numpy()[:4])
    assert list(next(iter(db.dataset(FINAL, batch_size=4, columns=())))) == ["vec"]


def test_dataset_refuses_a_query_without_vectors(db: actdb.Database) -> None:
    with pytest.raises(actdb.QueryError, match="needs a query selecting one vec column"):
        db.dataset("SELECT layer FROM acts")
    with pytest.raises(actdb.QueryError, match=r"columns \['nope'\] are not"):
        db.dataset(FINAL, columns=["nope"])


# -- the ecosystem's tools ---------------------------------------------------------------------


def test_xarray_opens_every_array(db: actdb.Database, store: Path) -> None:
    import xarray as xr
    import zarr

    stack = [("", zarr.open_group(str(store / "tensors.zarr"), mode="r"))]
    opened = 0
    while stack:
        path, group = stack.pop()
        stack.extend((f"{path}/{n}" if path else n, g) for n, g in group.groups())
        names = [n for n, _ in group.arrays()]
        if names:
            ds = xr.open_zarr(str(store / "tensors.zarr"), group=path, consolidated=False)
            assert sorted(ds.data_vars) == sorted(names)
            opened += len(names)
    n_sites = db.sql("SELECT count(*) FROM sites").fetchone()[0]  # type: ignore[index]
    assert opened >= 3 * n_sites + 1
    ds = xr.open_zarr(str(store / "tensors.zarr"), group="models/0/acts/final",
                      consolidated=False)
    assert ds["direction"].dims == ("row", "dim") and ds["norm"].dims == ("row",)
    n = 5
    x = ds["direction"][:n].values.astype(np.float64) * ds["norm"][:n].values[:, None]
    np.testing.assert_allclose(x, zarr_vectors(db, store, "final", n))


# -- a real Jupyter kernel ---------------------------------------------------------------------


@pytest.mark.slow
def test_notebook_displays_results_figures_and_a_dataset_batch(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    spec = tmp_path / "jupyter" / "kernels" / "actdb-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "actdb test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    cells = [
        f"import actdb\ndb = actdb.connect({str(store)!r}, device='cpu')\ndb",
        "db.sql(\"SELECT layer, token, top_logits(vec, 2) AS top FROM acts "
        "WHERE site = 'final' AND prompt_id = 0\")",
        "import actdb.plot\nactdb.plot.lens(db, prompt_id=0)",
        "batch = next(iter(db.dataset(\"SELECT vec, layer FROM acts WHERE site = 'final'\", "
        "batch_size=4, columns=['layer'])))\ntuple(batch['vec'].shape), batch['layer'].tolist()",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, kernel_name="actdb-test", timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outs = [c.outputs for c in nb.cells]
    assert all(o.output_type != "error" for cell in outs for o in cell)
    assert "<actdb.Database" in outs[0][0]["data"]["text/plain"]
    assert "<table" in outs[1][0]["data"]["text/html"]
    assert "rows x 3 columns" in outs[1][0]["data"]["text/html"]
    image = outs[2][0]["data"]["image/png"]  # shown inline, no %matplotlib magic
    import base64

    assert base64.b64decode(image)[:8] == b"\x89PNG\r\n\x1a\n"
    assert outs[3][0]["data"]["text/plain"].startswith("((4, 64), [")
