"""The materialized lens (`ingest --lens K`): what is stored, against a float64 reference run
of the model with our own hooks (tests/support/query_reference.py), and what the lens
functions give from it, against the same reference and against their computed path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr
from support.prompts import PROMPTS

import actdb
from actdb.errors import IngestError, StoreCorruptError

K = 4


@pytest.fixture(scope="module")
def lens_store(tmp_path_factory: pytest.TempPathFactory,
               model_dir: Callable[[str], Path]) -> Path:
    path = tmp_path_factory.mktemp("lens") / "s.actdb"
    # several batches and commit groups' chunks: 8-row chunks, 4 prompts a batch
    actdb.ingest(path, model=str(model_dir("gpt2")), prompts=PROMPTS, batch_size=4,
                 device="cpu", name="gpt2", chunk_tokens=8, lens=K)
    return path


def _tolerance(ref: object) -> float:
    """The float16 error bound of a lens logit (functions.py, logprob's eps): 2^-11 sqrt(d)
    max_t ||gain * W_U[t]||."""
    f = ref.final  # type: ignore[attr-defined]
    w = ref.W_U * (f.gain if f.gain is not None else 1.0)  # type: ignore[attr-defined]
    return 2.0 ** -11 * np.sqrt(w.shape[1]) * float(np.linalg.norm(w, axis=1).max())


def _stored(path: Path, site: str) -> dict[str, np.ndarray]:
    g = zarr.open_group(str(path / "tensors.zarr"), mode="r")
    return {name: np.asarray(g[f"models/0/acts/{site}/{name}"][:])
            for name in ("lens_ids", "lens_logits", "lens_stats")}


def _rows(db: actdb.Database, site: str) -> tuple[np.ndarray, np.ndarray]:
    got = db.sql("SELECT prompt_id, position FROM acts WHERE site = $s ORDER BY prompt_id, "
                 "position", params={"s": site}).fetchall()
    return np.array([r[0] for r in got]), np.array([r[1] for r in got])


def test_stored_lens_matches_the_model_in_float64(lens_store: Path,
                                                   reference: Callable[[str], object]) -> None:
    ref = reference("gpt2")
    tol = _tolerance(ref)
    db = actdb.connect(lens_store)
    sites = db.sql("SELECT site, module, role FROM sites WHERE model = 'gpt2'").fetchall()
    assert {r for _, _, r in sites} <= {"pre_attn", "pre_mlp", "final"}
    final_logits = ref.logits  # type: ignore[attr-defined]  # the model's own, float64 [N, V]
    n_rows = db.sql("SELECT n_rows FROM models").fetchall()[0][0]
    for site, module, _ in sites:
        stored = {k: v[:n_rows] for k, v in _stored(lens_store, site).items()}
        prompt, position = _rows(db, site)
        rows = ref.rows(prompt, position)  # type: ignore[attr-defined]
        lg = ref.lens_logits(ref.sites[module].x[rows])  # type: ignore[attr-defined]
        if site == "final":  # the lens at the final site is the model's own logits
            np.testing.assert_allclose(lg, final_logits[rows], atol=1e-9)
        order = np.lexsort((np.arange(lg.shape[1])[None, :].repeat(len(lg), 0), -lg), axis=1)
        top = np.take_along_axis(lg, order[:, : K + 1], 1)
        np.testing.assert_allclose(stored["lens_logits"][:, :K], top[:, :K], atol=tol)
        # the stored ids' own logits, and the same ids wherever the order is clear
        np.testing.assert_allclose(
            stored["lens_logits"][:, :K],
            np.take_along_axis(lg, stored["lens_ids"][:, :K].astype(np.int64), 1), atol=tol)
        clear = (np.diff(-top, axis=1) > 2 * tol).all(1)
        assert clear.sum() > len(clear) // 4
        np.testing.assert_array_equal(stored["lens_ids"][clear, :K], order[clear, :K])
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        p = np.exp(lg - lse[:, None])
        np.testing.assert_allclose(stored["lens_stats"][:, 0], lse, atol=tol)
        np.testing.assert_allclose(stored["lens_stats"][:, 1], -(p * np.log(p)).sum(1),
                                   atol=tol)
        # the model's own prediction: its top logit at the final site
        pred = final_logits[rows].argmax(1)
        pred_clear = np.sort(final_logits[rows], 1)[:, -2] < final_logits[rows].max(1) - 2 * tol
        np.testing.assert_array_equal(stored["lens_ids"][pred_clear, K], pred[pred_clear])
        mine = lg[np.arange(len(lg)), pred]
        np.testing.assert_allclose(stored["lens_logits"][pred_clear, K], mine[pred_clear],
                                   atol=tol)
        rank = 1 + (lg > mine[:, None]).sum(1)
        sure = pred_clear & (np.abs(lg - mine[:, None]) > 2 * tol).sum(1) == lg.shape[1] - 1
        np.testing.assert_array_equal(stored["lens_stats"][sure, 2], rank[sure])


def test_lens_functions_read_the_stored_values(lens_store: Path) -> None:
    db = actdb.connect(lens_store)
    site = "blocks.1.ln1"
    stored = _stored(lens_store, site)
    got = db.sql(f"""
        SELECT top_logits(vec, {K}) AS t, entropy(vec) AS e, row_number() OVER () - 1 AS i,
               logprob(vec, top_logits(vec, 1)[1].token_id) AS lp,
               token_rank(vec, top_logits(vec, {K})[{K}].token_id) AS r
        FROM acts WHERE site = $s ORDER BY prompt_id, position""", params={"s": site}).fetchall()
    n = len(got)
    ids = np.array([[x["token_id"] for x in r[0]] for r in got])
    np.testing.assert_array_equal(ids, stored["lens_ids"][:n, :K])
    # looked up, not recomputed: the stored float32 values exactly
    assert [r[1] for r in got] == stored["lens_stats"][:n, 1].astype(np.float64).tolist()
    np.testing.assert_array_equal(
        [r[3] for r in got],
        stored["lens_logits"][:n, 0].astype(np.float64) - stored["lens_stats"][:n, 0])
    expect = 1 + (stored["lens_logits"][:n, :K] > stored["lens_logits"][:n, K - 1 : K]).sum(1)
    np.testing.assert_array_equal([r[4] for r in got], expect)


def test_stored_and_computed_agree(lens_store: Path, reference: Callable[[str], object]
                                   ) -> None:
    """k > K, a view, a token outside the stored ones: computed as before; within float32
    rounding of what is stored."""
    db = actdb.connect(lens_store)
    rows = db.sql(f"""
        SELECT top_logits(vec, {K}) AS s, top_logits(vec, {K + 3}) AS c,
               entropy(vec) AS e, entropy(final_norm(vec)) AS ec,
               prob(vec, top_logits(vec, 1)[1].token_id) AS p,
               prob(vec, top_logits(vec, {K + 3})[{K + 3}].token_id) AS p_out,
               token_rank(vec, top_logits(vec, {K + 3})[{K + 3}].token_id) AS r_out,
               token_rank(vec, top_logits(vec, 1)[1].token_id) AS r1
        FROM acts WHERE role IN ('pre_attn', 'final')""").fetchall()
    for s, c, e, ec, p, p_out, r_out, r1 in rows:
        sl, cl = [x["logit"] for x in s], [x["logit"] for x in c][:K]
        np.testing.assert_allclose(sl, cl, rtol=1e-5, atol=1e-5)
        assert e == pytest.approx(ec, rel=1e-5, abs=1e-6)
        assert 0 < p_out <= p <= 1
        assert r1 == 1 and r_out >= K + 1 - 2  # near-ties may share a rank


def test_a_changed_normalizer_is_damage(lens_store: Path, tmp_path: Path) -> None:
    """lse rewritten in place (through zarr: its own checksum is valid) is refused where it is
    read: the chunk's digest is bound to its place."""
    import shutil

    copy = tmp_path / "s.actdb"
    shutil.copytree(lens_store, copy)
    g = zarr.open_group(str(copy / "tensors.zarr"), mode="r+")
    arr = g["models/0/acts/final/lens_stats"]
    first = np.asarray(arr[:4])
    first[:, 0] += 0.5
    arr[:4] = first
    db = actdb.connect(copy)
    with pytest.raises(StoreCorruptError):
        db.sql("SELECT prob(vec, top_logits(vec, 1)[1].token_id) FROM acts "
               "WHERE site = 'final' AND prompt_id = 0").fetchall()
    assert any("lens_stats" in p for p in db.verify(full=True))


def test_an_older_actdb_refuses_a_lens_store(lens_store: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from actdb.errors import StoreFormatError
    from actdb.store import store as store_module

    assert actdb.connect(lens_store).info().format_version == 7
    monkeypatch.setattr(store_module, "FORMAT_VERSION", 6)  # an actdb from before the lens
    with pytest.raises(StoreFormatError):
        actdb.connect(lens_store)


def test_a_resume_keeps_the_lens(lens_store: Path, model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(IngestError, match="materialized lens of 4 tokens"):
        actdb.ingest(lens_store, model=str(model_dir("gpt2")), prompts=PROMPTS[:1],
                     device="cpu", name="gpt2", lens=2)
    db = actdb.connect(lens_store)
    assert db.verify(full=True) == []
    assert db.sql("SELECT lens_k FROM models").fetchall() == [(K,)]


def test_info_says_whether_a_model_stores_the_lens(
        lens_store: Path, family_store: Callable[[str], Path]) -> None:
    from click.testing import CliRunner

    from actdb.cli import cli

    res = CliRunner().invoke(cli, ["info", str(lens_store)])
    assert res.exit_code == 0, res.output
    assert f"materialized lens: top {K} tokens" in res.output
    res = CliRunner().invoke(cli, ["info", str(family_store("gpt2"))])  # ingested on a CPU
    assert res.exit_code == 0, res.output
    assert "materialized lens: none (the default on a CPU" in res.output
