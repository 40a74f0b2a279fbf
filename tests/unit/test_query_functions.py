"""The SQL tensor functions against an independent float64 reference.

The reference (tests/support/query_reference.py) runs each tiny model in float64 over every prompt
alone, with our own hooks on the norm modules, and computes every function from the captured
input x / output y and the model's own weights. actdb stores x as a float16 unit direction
plus a float32 norm and mean, so the tolerances are those of float16 rounding.
"""

from __future__ import annotations

import collections
import math
import re

import numpy as np
import pytest
import torch
from support.prompts import PROMPTS
from support.query_reference import (
    LM_FAMILIES,
    FamilyRef,
    cos_rows,
    degrees,
    uniform_angle,
    unit,
)
from support.tiny_models import load_tiny_model

import actdb
from actdb.query import runs

FAMILIES = ("gpt2", "llama", "gemma", "bert")
PROMPT_SUBSET = (0, 2, 3)  # short, shortest, longest (the longest spans several chunks)
TOKEN_ID = 300  # a plain token id, valid in every tiny vocabulary

COS_TOL = 2e-3  # cosines, contributions, unit-scale values
REL_TOL = 2e-3  # norms, vectors (relative)
ANGLE_TOL = 0.2  # degrees
LOGIT_RTOL, LOGIT_ATOL = 2e-3, 2e-3


# -- fixtures ---------------------------------------------------------------------------------


class _Connections:
    """One shared connection per family store; `release` closes it so that a test can open a
    fresh one alone (the next `__call__` reopens it)."""

    def __init__(self, family_store):
        self.family_store = family_store
        self.dbs: dict[str, actdb.Database] = {}

    def __call__(self, family: str) -> actdb.Database:
        if family not in self.dbs:
            self.dbs[family] = actdb.connect(self.family_store(family), device="cpu")
        return self.dbs[family]

    def release(self, family: str) -> None:
        db = self.dbs.pop(family, None)
        if db is not None:
            db.close()


@pytest.fixture(scope="module")
def database(family_store):
    conns = _Connections(family_store)
    yield conns
    for family in list(conns.dbs):
        conns.release(family)


def words(ref: FamilyRef) -> tuple[str, str]:
    """Two strings that are one token each in the family's vocabulary."""
    pair = ("the", "of") if ref.family == "bert" else (" the", " of")
    for w in pair:
        assert len(ref.tokenizer(w, add_special_tokens=False)["input_ids"]) == 1, w
    return pair


def token_id(ref: FamilyRef, word: str) -> int:
    (tid,) = ref.tokenizer(word, add_special_tokens=False)["input_ids"]
    return int(tid)


# -- helpers ----------------------------------------------------------------------------------


def fetch(db: actdb.Database, query: str, params=None) -> list[dict]:
    return db.sql(query, params=params).to_arrow_table().to_pylist()


def col(rows: list[dict], name: str) -> np.ndarray:
    return np.array([np.nan if r[name] is None else r[name] for r in rows], dtype=np.float64)


def site_modules(db: actdb.Database, family: str) -> dict[str, str]:
    return dict(db.sql("SELECT site, module FROM sites WHERE model = $m",
                       params={"m": family}).fetchall())


class Rows:
    """Reference values for the (prompt_id, position, site[, head]) rows of a query result."""

    def __init__(self, ref: FamilyRef, db: actdb.Database, rows: list[dict]):
        assert rows, "the query returned no rows"
        self.ref = ref
        smap = site_modules(db, ref.family)
        self.mods = [smap[r["site"]] for r in rows]
        self.p = [r["prompt_id"] for r in rows]
        self.pos = [r["position"] for r in rows]
        self.head = [r.get("head") for r in rows]

    def site(self, fn) -> np.ndarray:
        return self.ref.per_site(self.mods, self.p, self.pos, fn, head=self.head)

    @property
    def x(self) -> np.ndarray:
        return self.site(lambda s, x: x)

    @property
    def z(self) -> np.ndarray:
        return self.site(lambda s, x: s.normalized(x))

    @property
    def y(self) -> np.ndarray:
        """The site's real output, as hooked."""
        rows = self.ref.rows(self.p, self.pos)
        out = []
        for m, r, h in zip(self.mods, rows, self.head, strict=True):
            y = self.ref.sites[m].y[r]
            out.append(y[h] if y.ndim == 2 else y)
        return np.stack(out)

    @property
    def f(self) -> np.ndarray:
        return self.ref.final.normed(self.x)


def close(got, want, *, atol=0.0, rtol=0.0, what=""):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{what}: NULL/NaN where a value was expected"
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    if bad.any():
        i = int(np.argmax(err - (atol + rtol * np.abs(want))))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.size} values off; worst at {i}: got {got.flat[i]!r}, "
            f"want {want.flat[i]!r} (atol {atol}, rtol {rtol})"
        )


def close_vectors(got, want, *, rel=REL_TOL, what=""):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert err.max() < rel, f"{what}: worst relative error {err.max():.3g} at row {err.argmax()}"


def check_topk(got_lists, scores, k, *, key, id_key, tol, what, strings=None, by_abs=False):
    """Ranked lists against the reference scores [n, V] of every candidate of each row.

    Each entry's value equals the reference score of the id it names; the values in rank order
    match the reference's top-k (by |score| when by_abs); and the ids match the reference's
    wherever its top values are not near-ties.
    """
    assert len(got_lists) == scores.shape[0]
    rank_scores = np.abs(scores) if by_abs else scores
    for i, got in enumerate(got_lists):
        assert got is not None, f"{what}: row {i} is NULL"
        assert len(got) == k, f"{what}: row {i} has {len(got)} entries, not {k}"
        order = np.argsort(-rank_scores[i], kind="stable")[: k + 1]
        rank = rank_scores[i, order]
        ids = [g[id_key] for g in got]
        assert len(set(ids)) == k, f"{what}: row {i} repeats an id: {ids}"
        gv = np.array([g[key] for g in got])
        close(gv, scores[i, ids], atol=tol, what=f"{what} row {i}: value of each id")
        close(np.abs(gv) if by_abs else gv, rank[:k], atol=tol, what=f"{what} row {i}: top values")
        for j in range(k):
            gap_before = rank[j - 1] - rank[j] if j > 0 else np.inf
            gap_after = rank[j] - rank[j + 1] if j + 1 < len(rank) else np.inf
            if min(gap_before, gap_after) > 2 * tol:
                assert ids[j] == order[j], (
                    f"{what}: row {i} rank {j}: got {id_key} {ids[j]}, want {order[j]} "
                    f"(value {scores[i, order[j]]:.5f})"
                )
            if strings is not None:
                assert got[j]["token"] == strings[ids[j]], f"{what}: token string of {ids[j]}"


def vocab_strings(db: actdb.Database, family: str) -> dict[int, str]:
    return dict(db.sql("SELECT token_id, token FROM vocab WHERE model = $m",
                       params={"m": family}).fetchall())


def where_prompts(ids=PROMPT_SUBSET) -> str:
    return f"prompt_id IN ({', '.join(map(str, ids))})"


# -- 1. stored vectors ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_vectors_equal_hooked_input(family, reference, database):
    ref, db = reference(family), database(family)
    # The stored tokens are exactly what the tokenizer gives for each prompt alone.
    for pid, ids in enumerate(ref.input_ids):
        got = [r[0] for r in db.sql(
            "SELECT token_id FROM tokens WHERE model = $m AND prompt_id = $p ORDER BY position",
            params={"m": family, "p": pid}).fetchall()]
        assert got == ids, f"prompt {pid}: stored token ids differ from the tokenizer's"

    q = ("SELECT prompt_id, position, site, norm, mean, vec FROM acts "
         "ORDER BY site, prompt_id, position")
    rows = fetch(db, q)
    vecs = db.vectors(q)
    assert isinstance(vecs, torch.Tensor)
    n_tokens = sum(len(i) for i in ref.input_ids)
    assert len(rows) == n_tokens * len(ref.sites) == vecs.shape[0]
    r = Rows(ref, db, rows)
    x = r.x
    close_vectors(vecs.double().cpu().numpy(), x, what=f"{family} vectors()")
    # norm and mean are float32 exact up to float32 rounding
    close(col(rows, "norm"), np.linalg.norm(x, axis=-1), rtol=1e-5, what="norm column")
    scale = np.linalg.norm(x, axis=-1) / math.sqrt(x.shape[-1])
    close(col(rows, "mean") / scale, x.mean(-1) / scale, atol=1e-5, what="mean column")


# -- 2. every tensor function against the reference -------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_scalar_functions(family, reference, database):
    ref, db = reference(family), database(family)
    w1, w2 = words(ref)
    t1, t2 = token_id(ref, w1), token_id(ref, w2)
    lm = family in LM_FAMILIES
    cols = {
        "n_raw": "vec_norm(vec)",
        "n_z": "vec_norm(normalized(vec))",
        "n_y": "vec_norm(normed(vec))",
        "dc0": "dim_contribution(vec, 0)",
        "dc37": "dim_contribution(vec, 37)",
        "dc_y": "dim_contribution(normed(vec), 5)",
        "dc_z": "dim_contribution(normalized(vec), 63)",
        "ua": "uniform_angle(vec)",
        "ua_y": "uniform_angle(normed(vec))",
        "ua_z": "uniform_angle(normalized(vec))",
        "rot": "rotation_angle(vec)",
        "cos_xy": "cosine(vec, normed(vec))",
        "ang_xz": "angle(vec, normalized(vec))",
        "ang_yz": "angle(normed(vec), normalized(vec))",
        "cta_emb": f"cosine_to_anchor(vec, '{w1}', 'embed')",
        "cta_emb_id": f"cosine_to_anchor(vec, {TOKEN_ID}, 'embed')",
        "cta_row": "cosine_to_anchor(vec, token_id, 'embed')",
    }
    if lm:
        cols |= {
            "cta": f"cosine_to_anchor(vec, '{w1}')",
            "cta_un": f"cosine_to_anchor(vec, '{w2}', 'unembed')",
            "cta_id": f"cosine_to_anchor(vec, {TOKEN_ID})",
            "cta_fold": f"cosine_to_anchor(vec, '{w1}', 'unembed_folded')",
            "cta_fold_id": f"cosine_to_anchor(vec, {TOKEN_ID}, 'unembed_folded')",
            "cta_y": f"cosine_to_anchor(normed(vec), '{w2}')",
            "cta_def_row": "cosine_to_anchor(vec, token_id)",
            "logit": f"logit(vec, '{w1}')",
            "logit_id": f"logit(vec, {TOKEN_ID})",
            "logit_row": "logit(vec, token_id)",
            "logit_y": f"logit(normed(vec), '{w2}')",
            "lc": f"logit_contribution(vec, 5, '{w1}')",
            "lc_id": f"logit_contribution(vec, 60, {TOKEN_ID})",
            "n_f": "vec_norm(final_norm(vec))",
            "dc_f": "dim_contribution(final_norm(vec), 3)",
            "cos_xf": "cosine(vec, final_norm(vec))",
        }
    select = ", ".join(f"{e} AS {k}" for k, e in cols.items())
    rows = fetch(db, f"SELECT prompt_id, position, site, token_id, {select} FROM acts "
                     f"WHERE {where_prompts()} ORDER BY prompt_id, position, site")
    r = Rows(ref, db, rows)
    x, z, y = r.x, r.z, r.y
    ux, uy = unit(x), unit(y)
    tid_row = np.array([row["token_id"] for row in rows])
    E = ref.anchors("embed")
    want = {
        "n_raw": (np.linalg.norm(x, axis=-1), "rel"),
        "n_z": (np.linalg.norm(z, axis=-1), "rel"),
        "n_y": (np.linalg.norm(y, axis=-1), "rel"),
        "dc0": (ux[:, 0], "cos"),
        "dc37": (ux[:, 37], "cos"),
        "dc_y": (uy[:, 5], "cos"),
        "dc_z": (unit(z)[:, 63], "cos"),
        "ua": (uniform_angle(x), "angle"),
        "ua_y": (uniform_angle(y), "angle"),
        "ua_z": (uniform_angle(z), "angle"),
        "rot": (degrees(cos_rows(x, y)), "angle"),
        "cos_xy": (cos_rows(x, y), "cos"),
        "ang_xz": (degrees(cos_rows(x, z)), "angle"),
        "ang_yz": (degrees(cos_rows(y, z)), "angle"),
        "cta_emb": (ux @ E[t1], "cos"),
        "cta_emb_id": (ux @ E[TOKEN_ID], "cos"),
        "cta_row": ((ux * E[tid_row]).sum(-1), "cos"),
    }
    if lm:
        U, Fo = ref.anchors("unembed"), ref.anchors("unembed_folded")
        f = r.f
        fy = ref.final.normed(y)
        want |= {
            "cta": (ux @ U[t1], "cos"),
            "cta_un": (ux @ U[t2], "cos"),
            "cta_id": (ux @ U[TOKEN_ID], "cos"),
            "cta_fold": (ux @ Fo[t1], "cos"),
            "cta_fold_id": (ux @ Fo[TOKEN_ID], "cos"),
            "cta_y": (uy @ U[t2], "cos"),
            "cta_def_row": ((ux * U[tid_row]).sum(-1), "cos"),
            "logit": (ref.logit(f, t1), "logit"),
            "logit_id": (ref.logit(f, TOKEN_ID), "logit"),
            "logit_row": (ref.logit(f, tid_row), "logit"),
            "logit_y": (ref.logit(fy, t2), "logit"),
            "lc": (f[:, 5] * ref.W_U[t1, 5], "cos"),
            "lc_id": (f[:, 60] * ref.W_U[TOKEN_ID, 60], "cos"),
            "n_f": (np.linalg.norm(f, axis=-1), "rel"),
            "dc_f": (unit(f)[:, 3], "cos"),
            "cos_xf": (cos_rows(x, f), "cos"),
        }
    assert set(want) == set(cols)
    tol = {"rel": {"rtol": REL_TOL}, "cos": {"atol": COS_TOL}, "angle": {"atol": ANGLE_TOL},
           "logit": {"rtol": LOGIT_RTOL, "atol": LOGIT_ATOL}}
    for k, (w, kind) in want.items():
        close(col(rows, k), w, **tol[kind], what=f"{family} {cols[k]}")


@pytest.mark.parametrize("family", ("gpt2", "llama"))
def test_scalar_functions_in_small_blocks(family, reference, family_store, monkeypatch):
    """The same checks with vectors converted 3 rows at a time (Group.x_blocks): block edges
    fall inside chunks, groups and the rows of each argument value (`token_id` varies by
    row). A connection of its own: a shared one may answer from windows it computed before."""
    monkeypatch.setattr(runs, "SCRATCH_FLOATS", 3 * 64)
    db = actdb.connect(family_store(family), device="cpu")
    try:
        test_scalar_functions(family, reference, lambda _: db)
    finally:
        db.close()


@pytest.mark.parametrize("family", ("gpt2", "llama"))
def test_a_rows_value_does_not_depend_on_the_rows_computed_with_it(family, family_store,
                                                                    monkeypatch):
    """Bit for bit, not within a tolerance: each row's value from a full scan in 1 MiB blocks
    equals the value from a query of its prompt alone in 3-row blocks, and of its row alone
    (a BLAS product's rounding changes with its number of rows: dots.py). `top_logits`
    reports the same values as `logit` of its tokens. Fresh connections: a shared one may
    answer from windows it computed before."""
    exprs = ("cosine_to_anchor(vec, ' the')", "cosine_to_anchor(vec, token_id)",
             "cosine_to_anchor(normed(vec), ' of')", "logit(vec, ' the')",
             "logit(vec, token_id)", "logit(normed(vec), 7)", "rotation_angle(vec)",
             "cosine(vec, final_norm(vec))", "dim_contribution(vec, 5)",
             "cosine_to(vec, [i * 0.5 - 15 FOR i IN range(64)])",
             "project(normed(vec), [1 - i % 3 FOR i IN range(64)])",
             "[e.logit FOR e IN top_logits(vec, 3)]")
    q = (f"SELECT prompt_id, position, site, {', '.join(exprs)} FROM acts {{}} "
         f"ORDER BY prompt_id, position, site")
    store = family_store(family)
    with actdb.connect(store, device="cpu") as db:
        whole = db.sql(q.format("")).fetchall()
    monkeypatch.setattr(runs, "SCRATCH_FLOATS", 3 * 64)
    with actdb.connect(store, device="cpu") as db:
        alone = [row for p in range(len(PROMPTS))
                 for row in db.sql(q.format(f"WHERE prompt_id = {p}")).fetchall()]
        assert alone == whole
        for row in whole[::7]:
            where = f"WHERE prompt_id = {row[0]} AND position = {row[1]} AND site = '{row[2]}'"
            assert db.sql(q.format(where)).fetchall() == [row]
        pairs = db.sql("SELECT e.logit, logit(vec, e.token_id) FROM "
                       "(SELECT vec, unnest(top_logits(vec, 4)) AS e FROM acts)").fetchall()
        assert len(pairs) > 100 and all(a == b for a, b in pairs)


@pytest.mark.parametrize("family", FAMILIES)
def test_list_functions(family, reference, database):
    ref, db = reference(family), database(family)
    lm = family in LM_FAMILIES
    cols = {
        "na_emb": "nearest_anchors(vec, 3, 'embed')",
        "td": "top_dims(vec, 4)",
        "td_y": "top_dims(normed(vec), 3)",
        "l_x": "to_list(vec)",
        "l_z": "to_list(normalized(vec))",
        "l_y": "to_list(normed(vec))",
    }
    if lm:
        cols |= {
            "na": "nearest_anchors(vec, 5)",
            "na_fold": "nearest_anchors(vec, 3, 'unembed_folded')",
            "tl": "top_logits(vec, 5)",
            "tl_y": "top_logits(normed(vec), 2)",
            "l_f": "to_list(final_norm(vec))",
        }
    select = ", ".join(f"{e} AS {k}" for k, e in cols.items())
    rows = fetch(db, f"SELECT prompt_id, position, site, {select} FROM acts "
                     f"WHERE {where_prompts((0, 2))} ORDER BY site, prompt_id, position")
    r = Rows(ref, db, rows)
    x, z, y = r.x, r.z, r.y
    strings = vocab_strings(db, family)

    def lists(k):
        return [row[k] for row in rows]

    close_vectors(np.array(lists("l_x")), x, what="to_list(vec)")
    close_vectors(np.array(lists("l_z")), z, what="to_list(normalized(vec))")
    close_vectors(np.array(lists("l_y")), y, what="to_list(normed(vec))")

    def anchors_check(k, name, n):
        check_topk(lists(k), unit(x) @ ref.anchors(name).T, n, key="cosine", id_key="token_id",
                   tol=COS_TOL, what=f"{family} {cols[k]}", strings=strings)

    anchors_check("na_emb", "embed", 3)
    for k, v, n in (("td", x, 4), ("td_y", y, 3)):
        check_topk(lists(k), unit(v), n, key="contribution", id_key="dim", tol=COS_TOL,
                   what=f"{family} {cols[k]}", by_abs=True)
    if lm:
        anchors_check("na", "unembed", 5)
        anchors_check("na_fold", "unembed_folded", 3)
        f = r.f
        close_vectors(np.array(lists("l_f")), f, what="to_list(final_norm(vec))")
        b = ref.b_U if ref.b_U is not None else 0.0
        for k, h, n in (("tl", f, 5), ("tl_y", ref.final.normed(y), 2)):
            check_topk(lists(k), h @ ref.W_U.T + b, n, key="logit", id_key="token_id",
                       tol=LOGIT_ATOL, what=f"{family} {cols[k]}", strings=strings)


def test_list_functions_over_many_blocks(reference, database, monkeypatch):
    """nearest_anchors and top_logits keep every block's answers and copy them to the host
    once (topk_lists.topk_rows: a GPU waits at each copy): with blocks of 7 rows, each row's
    list still lands at its place, against the float64 reference."""
    from actdb.query import topk_lists

    monkeypatch.setattr(topk_lists, "_BLOCK", 7)
    test_list_functions("gpt2", reference, database)


def test_bert_functions_needing_an_lm_head_raise(database):
    db = database("bert")
    for q in (
        "SELECT logit(vec, 'the') FROM acts WHERE prompt_id = 0",
        "SELECT logit(vec, 10) FROM acts WHERE prompt_id = 0",
        "SELECT top_logits(vec, 3) FROM acts WHERE prompt_id = 0",
        "SELECT logit_contribution(vec, 1, 'the') FROM acts WHERE prompt_id = 0",
    ):
        with pytest.raises(actdb.QueryError):
            db.sql(q).fetchall()
    # The connection is still usable after the errors.
    assert db.sql("SELECT count(*) FROM acts WHERE prompt_id = 0").fetchall()[0][0] > 0


# -- 3. logit lens at the final site ----------------------------------------------------------


@pytest.mark.parametrize("family", LM_FAMILIES)
def test_final_site_logits_are_the_models(family, reference, database, model_dir):
    ref, db = reference(family), database(family)
    w1, _ = words(ref)
    t1 = token_id(ref, w1)
    final_site = db.sql("SELECT final_site FROM models WHERE model = $m",
                        params={"m": family}).fetchall()[0][0]
    assert site_modules(db, family)[final_site] == ref.final_module
    # The model's own logits: a float32 CausalLM forward pass per prompt, run alone.
    model, tok = load_tiny_model(family, model_dir(family))
    own = []
    with torch.no_grad():
        for text in PROMPTS:
            own.append(model(**tok(text, return_tensors="pt")).logits[0].double().numpy())
    own = np.concatenate(own)
    assert np.allclose(own, ref.logits, atol=1e-4)  # float32 vs float64 forward agree

    rows = fetch(db, f"SELECT prompt_id, position, token_id, logit(vec, '{w1}') AS l1, "
                     f"logit(vec, {TOKEN_ID}) AS l2, logit(vec, token_id) AS l3 "
                     "FROM acts WHERE site = $s ORDER BY prompt_id, position",
                 params={"s": final_site})
    idx = ref.rows(col(rows, "prompt_id").astype(int), col(rows, "position").astype(int))
    assert len(idx) == sum(len(i) for i in ref.input_ids)
    tid = col(rows, "token_id").astype(int)
    tol = {"rtol": LOGIT_RTOL, "atol": LOGIT_ATOL}
    close(col(rows, "l1"), own[idx, t1], **tol, what=f"{family} logit(vec, {w1!r}) at final")
    close(col(rows, "l2"), own[idx, TOKEN_ID], **tol, what=f"{family} logit(vec, id) at final")
    close(col(rows, "l3"), own[idx, tid], **tol, what=f"{family} logit(vec, token_id) at final")

    # Summed over all dims, logit_contribution gives logit - b_U[t].
    d = db.sql("SELECT d FROM sites WHERE model = $m AND site = $s",
               params={"m": family, "s": final_site}).fetchall()[0][0]
    sums = fetch(db, f"""
        SELECT a.prompt_id, a.position,
               sum(logit_contribution(a.vec, r.dim, '{w1}')) AS s1,
               sum(logit_contribution(a.vec, r.dim, {TOKEN_ID})) AS s2,
               any_value(logit(a.vec, '{w1}')) AS l1
        FROM acts a CROSS JOIN (SELECT range AS dim FROM range({d})) r
        WHERE a.site = '{final_site}' AND a.prompt_id IN (0, 3)
        GROUP BY a.prompt_id, a.position ORDER BY a.prompt_id, a.position""")
    idx = ref.rows(col(sums, "prompt_id").astype(int), col(sums, "position").astype(int))
    b1 = ref.b_U[t1] if ref.b_U is not None else 0.0
    b2 = ref.b_U[TOKEN_ID] if ref.b_U is not None else 0.0
    close(col(sums, "s1"), own[idx, t1] - b1, **tol, what="sum of logit_contribution")
    close(col(sums, "s2"), own[idx, TOKEN_ID] - b2, **tol, what="sum of logit_contribution (id)")
    close(col(sums, "s1"), col(sums, "l1") - b1, atol=1e-4, what="sum of contributions vs logit")


# -- 4. functions in every SQL context --------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_functions_in_sql_contexts(family, reference, database):
    ref, db = reference(family), database(family)
    w1, _ = words(ref)
    t1 = token_id(ref, w1)
    anchors = "unembed" if family in LM_FAMILIES else "embed"
    cta = f"cosine_to_anchor(vec, '{w1}', '{anchors}')"
    A = ref.anchors(anchors)[t1]
    site = "blocks.1.ln1" if family != "bert" else "blocks.1.ln1_post"

    # Reference over every row of the site.
    all_rows = fetch(db, f"SELECT prompt_id, position, site FROM acts WHERE site = '{site}'")
    r_all = Rows(ref, db, all_rows)
    ref_cta = {(a["prompt_id"], a["position"]): c
               for a, c in zip(all_rows, unit(r_all.x) @ A, strict=True)}

    # WHERE
    thr = float(np.median(list(ref_cta.values())))
    got = {(a["prompt_id"], a["position"]) for a in fetch(
        db, f"SELECT prompt_id, position FROM acts WHERE site = '{site}' AND {cta} > {thr}")}
    for key, c in ref_cta.items():
        if c > thr + COS_TOL:
            assert key in got, f"WHERE: row {key} (cos {c:.4f} > {thr:.4f}) missing"
        elif c < thr - COS_TOL:
            assert key not in got, f"WHERE: row {key} (cos {c:.4f} < {thr:.4f}) returned"

    # ORDER BY ... LIMIT
    top = fetch(db, f"SELECT prompt_id, position, {cta} AS c FROM acts WHERE site = '{site}' "
                    "ORDER BY c DESC LIMIT 5")
    close(col(top, "c"), sorted(ref_cta.values(), reverse=True)[:5], atol=COS_TOL,
          what="ORDER BY LIMIT values")
    close(col(top, "c"), [ref_cta[(t["prompt_id"], t["position"])] for t in top],
          atol=COS_TOL, what="ORDER BY LIMIT rows")

    # GROUP BY aggregates over every site and prompt
    groups = fetch(db, """
        SELECT site, count(*) AS n, avg(vec_norm(vec)) AS avg_norm,
               max(dim_contribution(vec, 7)) AS max_dc, min(rotation_angle(vec)) AS min_rot,
               sum(uniform_angle(vec)) AS sum_ua
        FROM acts GROUP BY site ORDER BY site""")
    everything = fetch(db, "SELECT prompt_id, position, site FROM acts")
    r = Rows(ref, db, everything)
    x, y = r.x, r.y
    sites = np.array([e["site"] for e in everything])
    norm_x, dc7 = np.linalg.norm(x, axis=-1), unit(x)[:, 7]
    rot, ua = degrees(cos_rows(x, y)), uniform_angle(x)
    for g in groups:
        m = sites == g["site"]
        assert g["n"] == m.sum()
        close(g["avg_norm"], norm_x[m].mean(), rtol=REL_TOL, what=f"avg(vec_norm) {g['site']}")
        close(g["max_dc"], dc7[m].max(), atol=COS_TOL, what=f"max(dim_contribution) {g['site']}")
        close(g["min_rot"], rot[m].min(), atol=ANGLE_TOL, what=f"min(rotation) {g['site']}")
        close(g["sum_ua"], ua[m].sum(), atol=ANGLE_TOL * m.sum() / 20,
              what=f"sum(uniform_angle) {g['site']}")
    assert {g["site"] for g in groups} == set(sites)

    # CTE, with a scalar subquery over the CTE
    cte = fetch(db, f"""
        WITH c AS (SELECT prompt_id, position, {cta} AS c FROM acts
                   WHERE site = '{site}' AND prompt_id = 1)
        SELECT prompt_id, position, c, (SELECT avg(c) FROM c) AS mean_c
        FROM c WHERE c > (SELECT avg(c) FROM c) ORDER BY position""")
    mine = {k: v for k, v in ref_cta.items() if k[0] == 1}
    mean_c = np.mean(list(mine.values()))
    close(col(cte, "mean_c"), np.full(len(cte), mean_c), atol=COS_TOL, what="CTE avg")
    close(col(cte, "c"), [mine[(c["prompt_id"], c["position"])] for c in cte], atol=COS_TOL,
          what="CTE values")
    for key, c in mine.items():
        if c > mean_c + 2 * COS_TOL:
            assert key in {(c["prompt_id"], c["position"]) for c in cte}, f"CTE: {key} missing"

    # Correlated scalar subquery and a derived table
    sub = fetch(db, f"""
        SELECT p.prompt_id,
               (SELECT max({cta}) FROM acts WHERE acts.prompt_id = p.prompt_id
                  AND site = '{site}') AS best
        FROM prompts p ORDER BY p.prompt_id""")
    for s in sub:
        want = max(v for k, v in ref_cta.items() if k[0] == s["prompt_id"])
        close(s["best"], want, atol=COS_TOL, what=f"correlated subquery prompt {s['prompt_id']}")
    derived = fetch(db, """
        SELECT prompt_id, position, site, dc FROM (
            SELECT prompt_id, position, site, dim_contribution(vec, 2) AS dc FROM acts
            WHERE prompt_id = 2) t
        WHERE dc IS NOT NULL ORDER BY site, position""")
    close(col(derived, "dc"), unit(Rows(ref, db, derived).x)[:, 2], atol=COS_TOL,
          what="derived table")

    # Self-join between consecutive layers of the same token
    joined = fetch(db, """
        SELECT a.prompt_id, a.position, a.site AS site, b.site AS site_b,
               cosine(a.vec, b.vec) AS c, angle(a.vec, b.vec) AS ang,
               cosine(normed(a.vec), b.vec) AS cy
        FROM acts a JOIN acts b
          ON a.model = b.model AND a.prompt_id = b.prompt_id AND a.position = b.position
         AND a.role = b.role AND b.layer = a.layer + 1
        WHERE a.prompt_id IN (0, 4) ORDER BY a.site, a.prompt_id, a.position""")
    n_tok = len(ref.input_ids[0]) + len(ref.input_ids[4])
    assert len(joined) == 2 * n_tok  # two roles per layer, layers 0 -> 1
    ra = Rows(ref, db, joined)
    rb = Rows(ref, db, [{**j, "site": j["site_b"]} for j in joined])
    xa, xb = ra.x, rb.x
    close(col(joined, "c"), cos_rows(xa, xb), atol=COS_TOL, what="self-join cosine")
    close(col(joined, "ang"), degrees(cos_rows(xa, xb)), atol=ANGLE_TOL, what="self-join angle")
    close(col(joined, "cy"), cos_rows(ra.y, xb), atol=COS_TOL, what="self-join cosine(normed)")


# -- 5. laziness -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_reads_only_the_chunks_it_needs(family, family_store, reference, database):
    ref = reference(family)
    database.release(family)
    w1, _ = words(ref)
    anchors = "unembed" if family in LM_FAMILIES else "embed"
    db = actdb.connect(family_store(family), device="cpu")
    try:
        chunk_tokens, n_rows = db.sql("SELECT chunk_tokens, n_rows FROM models WHERE model = $m",
                                      params={"m": family}).fetchall()[0]
        assert chunk_tokens == 8
        site = db.sql("SELECT site FROM sites WHERE model = $m ORDER BY site_id LIMIT 1 OFFSET 1",
                      params={"m": family}).fetchall()[0][0]
        # plain columns only: nothing is read
        db.sql("SELECT prompt_id, position, site, token, layer, role FROM acts "
               "WHERE prompt_id = 1 ORDER BY position").fetchall()
        db.sql("SELECT count(*), count(vec) FROM acts").fetchall()
        assert db.stats["chunks_read"] == 0, db.stats

        pid = 2
        rows = [r[0] for r in db.sql("SELECT row FROM tokens WHERE model = $m AND prompt_id = $p",
                                     params={"m": family, "p": pid}).fetchall()]
        chunks = {r // chunk_tokens for r in rows}
        total = math.ceil(n_rows / chunk_tokens)
        got = fetch(db, f"SELECT prompt_id, position, site, "
                        f"cosine_to_anchor(vec, '{w1}', '{anchors}') AS c FROM acts "
                        f"WHERE prompt_id = {pid} AND site = '{site}'")
        assert len(got) == len(ref.input_ids[pid])
        A = ref.anchors(anchors)[token_id(ref, w1)]
        close(col(got, "c"), unit(Rows(ref, db, got).x) @ A, atol=COS_TOL, what="lazy query")
        read = db.stats["chunks_read"]
        assert 0 < read <= 3 * len(chunks), (read, chunks)
        assert read < total, (read, total)
    finally:
        db.close()


# -- 6. zero vectors and per-head sites -------------------------------------------------------


@pytest.fixture(scope="module")
def zero_store(model_dir, tmp_path_factory):
    """gpt2 with wpe[0] and the embedding of prompt 0's first token zeroed: the input of
    blocks.0.ln1 is the zero vector at (prompt 0, position 0) and nowhere else."""
    model, tok = load_tiny_model("gpt2", model_dir("gpt2"))
    first = tok(PROMPTS[0])["input_ids"][0]
    with torch.no_grad():
        model.transformer.wpe.weight[0].zero_()
        model.transformer.wte.weight[first].zero_()
    path = tmp_path_factory.mktemp("store-zero") / "s.actdb"
    actdb.ingest(path, model=model, tokenizer=tok, prompts=PROMPTS[:2], batch_size=2,
                 device="cpu", name="gpt2zero", chunk_tokens=8)
    return path, first


def test_zero_vector_gives_null(zero_store):
    path, first = zero_store
    with actdb.connect(path, device="cpu") as db:
        rows = fetch(db, """
            SELECT position, norm, vec_norm(vec) AS n, to_list(vec) AS l,
                   dim_contribution(vec, 3) AS dc, cosine_to_anchor(vec, ' the') AS cta,
                   cosine_to_anchor(vec, ' the', 'embed') AS cte,
                   uniform_angle(vec) AS ua, rotation_angle(vec) AS rot,
                   cosine(vec, vec) AS c, angle(vec, vec) AS a,
                   top_dims(vec, 2) AS td, nearest_anchors(vec, 2) AS na,
                   cosine_to(vec, [1 - i % 3 FOR i IN range(64)]) AS ct,
                   cosine_to(vec, [1 - (i + position) % 3 FOR i IN range(64)]) AS ct_rows,
                   project(vec, [1 - i % 3 FOR i IN range(64)]) AS pr
            FROM acts WHERE prompt_id = 0 AND site = 'blocks.0.ln1' ORDER BY position""")
        nullable = ("dc", "cta", "cte", "ua", "rot", "c", "a", "td", "na", "ct", "ct_rows")
        zero = rows[0]
        assert zero["position"] == 0
        assert zero["norm"] == 0 and zero["n"] == 0
        assert zero["pr"] == 0.0  # a zero vector's projection is 0, not NULL
        assert zero["l"] == [0.0] * 64
        for k in nullable:
            assert zero[k] is None, f"{k} of a zero vector is {zero[k]!r}, not NULL"
        for r in rows[1:]:
            assert r["norm"] > 0
            for k in nullable:
                assert r[k] is not None and not (isinstance(r[k], float) and math.isnan(r[k])), k
            assert abs(r["c"] - 1) < COS_TOL and abs(r["a"]) < 2.0
        # no other stored vector is zero
        assert db.sql("SELECT count(*) FROM acts WHERE norm = 0").fetchall()[0][0] == 1


def test_a_zero_anchor_gives_null_in_every_anchor_function(zero_store):
    """The zeroed embedding row is also the tied LM head's: that token's anchor is the zero
    vector, and every anchor function of it is NULL on every row (review finding:
    `anchor_contribution`, documented to sum to `cosine_to_anchor` over the dims, gave 0)."""
    path, first = zero_store
    with actdb.connect(path, device="cpu") as db:
        rows = db.sql(f"""
            SELECT cosine_to_anchor(vec, {first}), cosine_to_anchor(vec, {first}, 'embed'),
                   anchor_contribution(vec, 3, {first}),
                   anchor_contribution(vec, 3, {first}, 'embed'),
                   anchor_contribution(vec, 3, {first + 1})
            FROM acts WHERE norm > 0 AND site = 'blocks.0.ln1'""").fetchall()
    assert len(rows) > 5
    assert all(r[:4] == (None,) * 4 for r in rows), rows[:2]
    assert all(r[4] is not None for r in rows)  # another token's anchor is not zero


def test_per_head_sites(family_store, reference):
    ref = reference("qwen3")
    db = actdb.connect(family_store("qwen3"), device="cpu")
    try:
        sites = fetch(db, "SELECT site, module, role, d, n_heads FROM sites WHERE model = 'qwen3' "
                          "AND role IN ('q_norm', 'k_norm') ORDER BY site_id")
        assert len(sites) == 4
        for s in sites:
            x = ref.sites[s["module"]].x  # [N, H, d]
            assert s["n_heads"] == x.shape[1] and s["d"] == x.shape[2]
            heads = [h for (h,) in db.sql(
                "SELECT DISTINCT head FROM acts WHERE site = $s ORDER BY head",
                params={"s": s["site"]}).fetchall()]
            assert heads == list(range(s["n_heads"]))
        assert db.sql("SELECT count(*) FROM acts WHERE head IS NOT NULL AND role NOT IN "
                      "('q_norm', 'k_norm')").fetchall()[0][0] == 0
        for s in sites:
            q = ("SELECT prompt_id, position, site, head, vec FROM acts WHERE site = $s "
                 "AND prompt_id IN (0, 3) ORDER BY prompt_id, position, head")
            rows = fetch(db, q, params={"s": s["site"]})
            vecs = db.vectors(q, params={"s": s["site"]}).double().cpu().numpy()
            r = Rows(ref, db, rows)
            x = r.x
            close_vectors(vecs, x, what=f"per-head vectors {s['site']}")
            rows = fetch(db, "SELECT prompt_id, position, site, head, vec_norm(vec) AS n, "
                             "dim_contribution(vec, 15) AS dc, rotation_angle(vec) AS rot, "
                             "to_list(normed(vec)) AS y, top_dims(vec, 2) AS td FROM acts "
                             "WHERE site = $s AND prompt_id = 2", params={"s": s["site"]})
            r = Rows(ref, db, rows)
            x = r.x
            yy = r.site(lambda site, v: site.normed(v))
            # the hooked per-head output agrees with the formula (self-check of the reference)
            rr = ref.rows(r.p, r.pos)
            hooked = ref.sites[s["module"]].y[rr, np.array(r.head)]
            close_vectors(yy, hooked, rel=1e-5, what="reference per-head y")
            close(col(rows, "n"), np.linalg.norm(x, axis=-1), rtol=REL_TOL, what="head norm")
            close(col(rows, "dc"), unit(x)[:, 15], atol=COS_TOL, what="head dim_contribution")
            close(col(rows, "rot"), degrees(cos_rows(x, hooked)), atol=ANGLE_TOL,
                  what="head rotation_angle")
            close_vectors(np.array([row["y"] for row in rows]), hooked, what="head normed")
            check_topk([row["td"] for row in rows], unit(x), 2, key="contribution", id_key="dim",
                       tol=COS_TOL, what="head top_dims", by_abs=True)
    finally:
        db.close()


# -- 7. determinism ---------------------------------------------------------------------------


DETERMINISM_QUERY = """
    SELECT prompt_id, position, site, cosine_to_anchor(vec, ' the') AS c,
           logit(vec, ' of') AS l, rotation_angle(vec) AS r, top_logits(vec, 3) AS tl,
           nearest_anchors(vec, 3, 'unembed_folded') AS na, to_list(normed(vec)) AS y
    FROM acts WHERE prompt_id IN (1, 3) ORDER BY prompt_id, position, site"""


def test_cpu_results_are_deterministic(family_store, database):
    database.release("llama")
    results = []
    for _ in range(2):
        with actdb.connect(family_store("llama"), device="cpu") as db:
            results.append(fetch(db, DETERMINISM_QUERY))
    assert len(results[0]) > 0
    assert results[0] == results[1]


def test_two_connections_open_at_once(family_store, database):
    """Two connections to one store in one process (e.g. a notebook cell run twice)."""
    database.release("llama")
    first = actdb.connect(family_store("llama"), device="cpu")
    try:
        second = actdb.connect(family_store("llama"), device="cpu")
        try:
            assert fetch(first, DETERMINISM_QUERY) == fetch(second, DETERMINISM_QUERY)
        finally:
            second.close()
    finally:
        first.close()


def test_vectors_out_of_sql_never_leave_a_row_unfilled(family_store, tmp_path):
    """final_norm(vec) is NULL at q_norm/k_norm sites: db.vectors, export and dataset refuse
    such rows with one sentence (they once returned whatever memory held there), and vectors
    of two widths in one dataset are refused whichever batches they fall in."""
    off = ("SELECT final_norm(vec) AS vec FROM acts WHERE model = 'qwen3' AND prompt_id = 0 "
           "AND position = 0 AND role IN ('k_norm', 'pre_attn') ORDER BY site, head")
    on = off.replace("'k_norm', 'pre_attn'", "'pre_attn'")
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        for call in (lambda: db.vectors(off), lambda: db.export(off, tmp_path / "x.npy"),
                     lambda: list(db.dataset(off, batch_size=2))):
            with pytest.raises(actdb.QueryError, match="final_norm"):
                call()
        want = np.array([r[0] for r in db.sql(on.replace("final_norm(vec) AS vec",
                                                         "to_list(final_norm(vec))")).fetchall()])
        np.testing.assert_allclose(db.vectors(on).cpu().numpy(), want, rtol=1e-6, atol=1e-6)
        db.export(on, tmp_path / "on.npy")
        np.testing.assert_allclose(np.load(tmp_path / "on.npy"), want, rtol=1e-6, atol=1e-6)
        mixed = ("SELECT vec FROM acts WHERE model = 'qwen3' AND prompt_id = 0 AND position < 2 "
                 "AND role IN ('k_norm', 'pre_attn') ORDER BY role, site, head")
        assert len(db.sql(mixed).fetchall()) > 4  # more than two batches of 2
        with pytest.raises(actdb.QueryError, match="different widths"):
            list(db.dataset(mixed, batch_size=2))


def test_cosine_pairs_rows_of_different_widths_in_one_call(family_store):
    """A self-join across layers over sites of two widths (the residual stream and per-head
    k_norm) in one call: each row is the cosine of its own pair, equal to the same query per
    width and to float64 NumPy; a NULL vector (final_norm of a k_norm row) gives NULL."""
    pairs = ("FROM acts a JOIN acts b ON a.prompt_id = b.prompt_id AND a.position = b.position "
             "AND a.role = b.role AND b.layer = a.layer + 1 AND a.head IS NOT DISTINCT FROM "
             "b.head WHERE a.prompt_id < 3 AND a.role IN ({roles})")
    q = ("SELECT a.role, cosine(a.vec, b.vec) AS c, to_list(a.vec) AS x, to_list(b.vec) AS y "
         + pairs + " ORDER BY a.role, a.prompt_id, a.position, a.layer, a.head")
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        mixed = db.sql(q.format(roles="'k_norm', 'pre_attn'")).fetchall()
        alone = (db.sql(q.format(roles="'k_norm'")).fetchall()
                 + db.sql(q.format(roles="'pre_attn'")).fetchall())
        nulls = db.sql("SELECT cosine(a.vec, final_norm(b.vec)) "
                       + pairs.format(roles="'k_norm'")).fetchall()
    assert {r[0] for r in mixed} == {"k_norm", "pre_attn"}
    assert [r[1] for r in mixed] == [r[1] for r in alone]
    for _, c, x, y in mixed:
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert abs(c - x @ y / np.linalg.norm(x) / np.linalg.norm(y)) < 1e-6
    assert nulls and all(v is None for (v,) in nulls)


def test_a_token_argument_reaches_its_kernel_as_its_text_and_its_sql_type(family_store):
    """A token argument is packed into one string for its UDF (its SQL type, a separator, its
    text); whatever the text holds, even the separator, the kernel gets it back whole, and a
    token given by id or by text, as a constant or per row, gives what the reference does."""
    import pyarrow as pa

    from actdb.query.kernels import TOKEN_SEP, Arg

    packed = pa.array([f"VARCHAR{TOKEN_SEP}a{TOKEN_SEP}b|c", f"INTEGER{TOKEN_SEP}42",
                       f"VARCHAR{TOKEN_SEP}", f"VARCHAR{TOKEN_SEP}a{TOKEN_SEP}b|c"])
    text, sqltype = Arg.tokens(packed)
    odd = f"a{TOKEN_SEP}b|c"
    assert [text.values[c] for c in text.codes] == [odd, "42", "", odd]
    assert [sqltype.values[c] for c in sqltype.codes] == ["VARCHAR", "INTEGER", "VARCHAR",
                                                          "VARCHAR"]
    text, sqltype = Arg.repeat_tokens(packed.slice(1, 1), 3)
    assert text.values == ["42"] and sqltype.values == ["INTEGER"] and len(text.codes) == 3
    # with the anchor set packed between them (a token followed by anchors: one column)
    with_sets = pa.array([f"VARCHAR{TOKEN_SEP}embed{TOKEN_SEP}a{TOKEN_SEP}b|c",
                          f"INTEGER{TOKEN_SEP}{TOKEN_SEP}42",
                          f"VARCHAR{TOKEN_SEP}unembed{TOKEN_SEP}"])
    text, sqltype, sets = Arg.tokens(with_sets, True)
    assert [text.values[c] for c in text.codes] == [odd, "42", ""]
    assert [sqltype.values[c] for c in sqltype.codes] == ["VARCHAR", "INTEGER", "VARCHAR"]
    assert [sets.values[c] for c in sets.codes] == ["embed", "", "unembed"]
    text, sqltype, sets = Arg.repeat_tokens(with_sets.slice(0, 1), 2, True)
    assert (text.values, sqltype.values, sets.values) == ([odd], ["VARCHAR"], ["embed"])
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        tid, tok = db.sql("SELECT token_id, token FROM vocab WHERE model = 'gpt2' "
                          "AND token_id = 262").fetchall()[0]
        got = db.sql(
            "SELECT cosine_to_anchor(vec, $tok) AS by_text, cosine_to_anchor(vec, $tid) AS by_id, "
            "cosine_to_anchor(vec, CASE WHEN position % 2 = 0 THEN $tok ELSE $tok END) AS per_row "
            "FROM acts WHERE model = 'gpt2' ORDER BY prompt_id, position, site",
            params={"tok": tok, "tid": tid}).fetchall()
        # an anchor set per row reaches each row with its token: as the constant sets give
        mixed = db.sql(
            "SELECT cosine_to_anchor(vec, $tok, CASE WHEN position % 2 = 0 THEN 'unembed_folded' "
            "ELSE 'unembed' END), CASE WHEN position % 2 = 0 THEN cosine_to_anchor(vec, $tok, "
            "'unembed_folded') ELSE cosine_to_anchor(vec, $tok, 'unembed') END, "
            "anchor_contribution(vec, 3, $tid, CASE WHEN position % 2 = 0 THEN 'unembed' ELSE "
            "'unembed_folded' END), CASE WHEN position % 2 = 0 THEN anchor_contribution(vec, 3, "
            "$tid, 'unembed') ELSE anchor_contribution(vec, 3, $tid, 'unembed_folded') END, "
            "cosine_to_anchor(vec, $tok, 'unembed') "
            "FROM acts WHERE model = 'gpt2' ORDER BY prompt_id, position, site",
            params={"tok": tok, "tid": tid}).fetchall()
    assert got and all(a == b == c for a, b, c in got), got[:3]
    assert mixed and all(a == b and c == d for a, b, c, d, _ in mixed), mixed[:3]
    assert any(a != e for a, _, _, _, e in mixed)  # the two sets differ here


def test_token_strings_resolve_to_the_one_id_that_decodes_to_them(family_store):
    """A token argument given as a string is the id whose decoded string it is; where several
    decode alike, the one the tokenizer encodes it as, and if it encodes it as none of them,
    an error naming them (review finding: the lowest id was taken silently); a string that is
    no token is one sentence naming how it tokenizes."""
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        rows = db.sql("SELECT token_id, token FROM vocab WHERE model = 'gpt2' "
                      "ORDER BY token_id").fetchall()
        src = db.source
        model = next(m for m in src.models.values() if m.model == "gpt2")
        first: dict[str, int] = {}
        for tid, tok in rows:
            if tok is not None:
                first.setdefault(tok, tid)
        counts = collections.Counter(tok for _, tok in rows if tok is not None)
        checked = 0
        for tok, tid in list(first.items())[::7]:
            if counts[tok] == 1:
                assert src.tokens.resolve_token(model, tok, "VARCHAR") == tid, tok
                checked += 1
        assert checked > 20
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src.store.tokenizer_dir(model.model_id))
        shared = [t for t, n in counts.items() if n > 1]
        assert shared, "the tiny vocabulary has byte tokens that decode alike"
        ambiguous = 0
        for text in shared:
            ids = [tid for tid, t in rows if t == text]
            encoded = tok(text, add_special_tokens=False)["input_ids"]
            if len(encoded) == 1 and encoded[0] in ids:  # the tokenizer's own choice
                assert src.tokens.resolve_token(model, text, "VARCHAR") == encoded[0], text
                continue
            # no id to prefer: an error naming them, never the first one silently
            with pytest.raises(actdb.TokenError, match=rf"is the text of {len(ids)} tokens "
                                                       rf"of model 'gpt2' \(ids {ids[0]}, "):
                src.tokens.resolve_token(model, text, "VARCHAR")
            ambiguous += 1
        assert ambiguous, "byte tokens that decode alike and that the tokenizer picks none of"
        assert src.tokens.resolve_token(model, str(rows[-1][0]), "INTEGER") == rows[-1][0]
        with pytest.raises(actdb.TokenError, match=r"is not one token of model 'gpt2': it "
                                                   r"tokenizes as \["):
            src.tokens.resolve_token(model, "a string no vocabulary holds whole", "VARCHAR")
        with pytest.raises(actdb.TokenError, match=r"^'' is not one token of model 'gpt2': "
                                                   "the empty string is no token$"):
            src.tokens.resolve_token(model, "", "VARCHAR")


def test_a_token_that_is_no_vocabulary_text_is_told_what_to_pass(family_store):
    """A string the vocabulary does not hold: a lowercasing tokenizer's one token for it is
    named with its id (the message said "tokenizes as ['the'] (1 tokens)" while refusing
    'The'); an unknown word is said to be unknown; a token copied from the table output,
    where a space shows as '␣', is told to write the space."""
    with actdb.connect(family_store("bert"), device="cpu") as db:
        tid = db.sql("SELECT token_id FROM vocab WHERE token = 'the'").fetchone()[0]
        with pytest.raises(actdb.TokenError, match=(
                rf"'The' is not one token of model 'bert': no token's text is 'The'; the "
                rf"tokenizer reads it as the one token 'the' \(id {tid}\): pass 'the' or {tid}")):
            db.sql("SELECT cosine_to_anchor(vec, 'The') FROM acts LIMIT 1").fetchall()
        assert db.sql("SELECT cosine_to_anchor(vec, 'the') = cosine_to_anchor(vec, $t) "
                      "FROM acts LIMIT 1", params={"t": tid}).fetchall() == [(True,)]
        with pytest.raises(actdb.TokenError, match="does not know it"):
            db.sql("SELECT cosine_to_anchor(vec, '\u00fe') FROM acts LIMIT 1").fetchall()
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        with pytest.raises(actdb.TokenError, match="in the table output '␣' is a space; write "
                                                   "' the'"):
            db.sql("SELECT cosine_to_anchor(vec, '␣the') FROM acts LIMIT 1").fetchall()
        # a list or a boolean is no token (its text was tokenized: '[1]', 'true')
        for value, sqltype in (("[1]", "INTEGER[]"), ("true", "BOOLEAN")):
            with pytest.raises(actdb.TokenError, match=re.escape(
                    f"a token is a string or a token id, not a value of type {sqltype}")):
                db.sql(f"SELECT cosine_to_anchor(vec, {value}) FROM acts LIMIT 1").fetchall()


def test_a_cosine_to_the_vectors_own_anchor_stays_a_cosine(family_store):
    """At a Llama-style model's first site the input is the token's embedding row, so its
    cosine with its own `embed` anchor is 1 in float64; the stored float16 direction's length
    is 1 only within 2^-11, and the raw product came out past 1, where acos() is NULL (review
    finding). It is clamped, and within float16 rounding of the exact 1."""
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        rows = db.sql(
            "SELECT cosine_to_anchor(vec, token_id, 'embed') AS c, "
            "degrees(acos(cosine_to_anchor(vec, token_id, 'embed'))) AS a "
            "FROM acts WHERE layer = 0 AND role = 'pre_attn'").fetchall()
    assert len(rows) > 20
    cos = np.array([r[0] for r in rows])
    assert np.all(cos <= 1.0) and np.all(cos > 1 - 2e-3), cos.min()
    assert all(r[1] is not None and r[1] == r[1] for r in rows)
    # Every cosine the functions give is one: a vector's own (float32 rounding put these at
    # 1.0000002, and acos() of them NULL), its nearest anchor's, against its own values.
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        rows = db.sql(
            "SELECT cosine(vec, vec), cosine_to(vec, to_list(vec)), "
            "cosine_to(normed(vec), to_list(normed(vec))), "
            "nearest_anchors(vec, 1, 'embed')[1].cosine, angle(vec, vec) FROM acts "
            "WHERE layer = 0 AND role = 'pre_attn'").fetchall()
    own = np.array([r[:4] for r in rows], dtype=np.float64)
    assert np.all(own <= 1.0) and np.all(own > 1 - 2e-3), (own.max(), own.min())
    assert all(r[4] is not None and 0 <= r[4] < 4 for r in rows)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_top_dims_lists_ties_lower_dim_first(family_store, family):
    """Stored float16 directions often hold equal values, so `top_dims` meets ties: they are
    listed lower dim first, as `top_logits` lists tokens (review finding: torch.topk's
    unspecified order put dim 59 before dim 22). Each list is the k largest by |x_dim|
    against the float64 vector itself, in that order."""
    with actdb.connect(family_store(family), device="cpu") as db:
        rows = db.sql("SELECT to_list(vec), top_dims(vec, 6) FROM acts "
                      "WHERE role NOT IN ('q_norm', 'k_norm')").fetchall()
    ties = 0
    for x, top in rows:
        a = np.abs(np.asarray(x, dtype=np.float64))
        if not a.any():
            continue
        want = np.argsort(-a, kind="stable")[:6]  # the largest first, equal ones by dim
        got = [t["dim"] for t in top]
        assert got == want.tolist(), (got, want, a[want])
        ties += int(np.any(a[want][1:] == a[want][:-1]))
    assert ties > 10, "no ties among the top dims: the test would not see their order"


def test_padding_rows_of_the_lm_head_are_ranked_as_the_model_ranks_them(tmp_path):
    """An LM head wider than the tokenizer's vocabulary (padded to a multiple, as many
    checkpoints are) gives logits for its padding rows too. `top_logits` ranks the head's
    every row, as the model's own logits do, and a padding row's token is NULL (no string
    decodes to it); `nearest_anchors` ranks their anchors likewise. Padding rows are made large here
    so that they win: the lists are compared with the model's own float64 logits and a
    float64 ranking of the anchors."""
    from support.tiny_models import build_family_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_family_tokenizer("llama")
    n_tok, pad = len(tok), 6
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                       vocab_size=n_tok + pad, bos_token_id=0,
                                       eos_token_id=0)).eval()
    with torch.no_grad():  # tied: the padding rows are both embeddings and LM-head rows
        model.transformer.wte.weight[n_tok:] *= 40.0
    prompts = ["the cat sat on the mat", "a dog of the house"]
    actdb.ingest(tmp_path / "p.actdb", model=model, tokenizer=tok, prompts=prompts,
                 device="cpu", name="m")
    k = 8
    with actdb.connect(tmp_path / "p.actdb", device="cpu") as db:
        rows = db.sql(f"SELECT p.text, a.position, top_logits(vec, {k}), "
                      f"nearest_anchors(vec, {k}), to_list(vec) "
                      "FROM acts a JOIN prompts p USING (prompt_id) WHERE site = 'final' "
                      "ORDER BY p.text, a.position").fetchall()
    w = model.lm_head.weight.detach().double()
    anchors = w / torch.linalg.vector_norm(w, dim=-1, keepdim=True)
    padded = 0
    for text, position, top, nearest, x in rows:
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            real = model.double()(**ids).logits[0, position]
        model.float()
        want = torch.argsort(-real, stable=True)[:k].tolist()
        assert [e["token_id"] for e in top] == want
        for e in top:
            assert math.isclose(e["logit"], float(real[e["token_id"]]), rel_tol=LOGIT_RTOL,
                                abs_tol=LOGIT_ATOL)
            assert (e["token"] is None) == (e["token_id"] >= n_tok), e
        padded += sum(e["token_id"] >= n_tok for e in top)
        cos = anchors @ torch.from_numpy(unit(np.asarray(x, dtype=np.float64)))
        near = torch.argsort(-cos, stable=True)[:k].tolist()
        assert [e["token_id"] for e in nearest] == near
        assert all((e["token"] is None) == (e["token_id"] >= n_tok) for e in nearest)
    assert rows and padded, "no padding row among the top logits: the test would not see them"


def test_anchor_functions_use_the_anchors_width_with_factorized_embeddings(tmp_path):
    """ALBERT factorizes its embeddings: tokens live in a narrower space (here 16) than the
    blocks (d_model 32), and its LM head reads 16-wide vectors. Anchors are rows of the
    embedding or the LM head, so the anchor functions apply at the sites of the anchors'
    width (embed, final), against a float64 reference from the model's own weights and the
    norm inputs our own hooks capture; at the 32-wide block sites they say which widths
    differ (they required d_model, and refused every ALBERT site: review finding)."""
    from support.tiny_models import build_family_tokenizer
    from transformers import AlbertConfig, AlbertForMaskedLM

    tok = build_family_tokenizer("bert")
    torch.manual_seed(4)
    model = AlbertForMaskedLM(AlbertConfig(
        vocab_size=len(tok), embedding_size=16, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)).eval()
    prompts = ["the cat sat on the mat", "a dog of the house ran"]
    actdb.ingest(tmp_path / "a.actdb", model=model, tokenizer=tok, prompts=prompts,
                 device="cpu", name="albert")
    ref = model.double()
    weights = {"unembed": ref.predictions.decoder.weight.detach(),
               "embed": ref.albert.embeddings.word_embeddings.weight.detach()}
    (tid,) = tok("the", add_special_tokens=False)["input_ids"]
    with actdb.connect(tmp_path / "a.actdb", device="cpu") as db:
        modules = dict(db.sql("SELECT site, module FROM sites WHERE d = 16").fetchall())
        assert set(modules) == {"embed", "final"}
        got = db.sql(f"""
            SELECT p.text, a.position, a.site, cosine_to_anchor(vec, {tid}),
                   cosine_to_anchor(vec, {tid}, 'embed'), anchor_contribution(vec, 3, {tid}),
                   nearest_anchors(vec, 3)
            FROM acts a JOIN prompts p USING (prompt_id) WHERE a.site IN ('embed', 'final')
            ORDER BY p.text, a.site, a.position""").fetchall()
        with pytest.raises(actdb.QueryError, match=r"cosine_to_anchor needs a vector of width "
                                                   r"16 \(the width of the 'unembed' anchors\); "
                                                   r"site 'blocks\.0\..*' of model 'albert' has "
                                                   r"width 32"):
            db.sql(f"SELECT cosine_to_anchor(vec, {tid}) FROM acts").fetchall()
    inputs: dict[tuple[str, str], np.ndarray] = {}
    for text in prompts:
        captured: dict[str, torch.Tensor] = {}
        handles = [ref.get_submodule(path).register_forward_pre_hook(
            lambda m, a, site=site, into=captured: into.__setitem__(site, a[0][0].detach()))
            for site, path in modules.items()]
        with torch.no_grad():
            ref(**tok(text, return_tensors="pt"))
        for hd in handles:
            hd.remove()
        for site, x in captured.items():
            inputs[(text, site)] = x.numpy()
    model.float()
    assert len(got) > 20
    for text, position, site, cos_u, cos_e, contrib, nearest in got:
        x = unit(inputs[(text, site)][position])
        for name, value in (("unembed", cos_u), ("embed", cos_e)):
            anchors = weights[name].numpy()  # a zero row (the padding token's) stays zero
            n = np.linalg.norm(anchors, axis=-1, keepdims=True)
            anchors = anchors / np.where(n > 0, n, 1.0)
            assert abs(value - float(anchors[tid] @ x)) < COS_TOL, (site, name)
            if name == "unembed":
                assert abs(contrib - float(x[3] * anchors[tid, 3])) < COS_TOL
                cos = anchors @ x
                kth = np.sort(cos)[-3]
                for e in nearest:
                    assert abs(e["cosine"] - cos[e["token_id"]]) < COS_TOL
                    assert cos[e["token_id"]] >= kth - COS_TOL
