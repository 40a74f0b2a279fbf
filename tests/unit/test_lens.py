"""The logit lens as a distribution, `delta`, vector aggregates and per-model token counts,
against an independent float64 reference (tests/support/query_reference.py).

The lens reference is the model's own float64 run: its real logits at the final site, and
elsewhere softmax of transform(W_U . final_norm(x) + b_U) from the hooked input x, with the
soft-cap gemma2 applies. Tolerances are the error bounds `actdb functions` states, computed
here from the reference's weights, so a wrong transform, sign or reduction fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import log_softmax
from support.prompts import PROMPTS
from support.query_reference import build_reference
from support.tiny_models import load_tiny_model

import actdb
from actdb.query.functions import REGISTRY

PROMPT_SUBSET = (0, 2, 3)
TOKENS = (300, 7)
U16 = 2.0**-11  # float16 unit roundoff: the stored direction's relative error


@pytest.fixture(scope="module")
def sharp(model_dir, tmp_path_factory):
    """family -> (store, float64 reference) of the tiny model with a final-norm gain 25 times
    larger: random tiny models predict nearly uniformly, and a peaked distribution is what
    tells a right rank, entropy or soft-cap from a wrong one. gemma2 gets a soft-cap of 5
    (its config's final_logit_softcapping), which its logits then reach."""
    built = {}

    def get(family):
        if family not in built:
            model, tok = load_tiny_model(family, model_dir(family))
            with torch.no_grad():
                if family == "gemma2":
                    model.config.final_logit_softcapping = 5.0
                    w = model.model.norm.weight  # the gain is 1 + w
                    w.copy_(25 * (1 + w) - 1)
                else:
                    model.transformer.ln_f.weight.mul_(25)
            folder = tmp_path_factory.mktemp(f"sharp-{family}")
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            store = folder / "s.actdb"
            actdb.ingest(store, model=str(folder), prompts=PROMPTS, batch_size=4, device="cpu",
                         name=family, chunk_tokens=8)
            built[family] = store, build_reference(family, folder, PROMPTS)
        return built[family]

    return get


def fetch(db: actdb.Database, query: str, params: dict | None = None) -> list[dict]:
    return db.sql(query, params=params).to_arrow_table().to_pylist()


def lens_reference(ref, db, rows):
    """Per result row: float64 lens logits [n, V] and the logit error bound eps_t [n, V]."""
    modules = dict(db.sql("SELECT site, module FROM sites").fetchall())
    idx = ref.rows([r["prompt_id"] for r in rows], [r["position"] for r in rows])
    x = np.stack([ref.sites[modules[r["site"]]].x[i] for r, i in zip(rows, idx, strict=True)])
    logits = ref.lens_logits(x)
    final = ref.final
    gained = ref.W_U * (final.gain if final.gain is not None else 1.0)  # [V, d]
    per_token = U16 * math.sqrt(final.d) * np.linalg.norm(gained, axis=-1)  # [V]
    if final.kind == "layernorm":  # centring divides by ||x_c|| / ||x|| = sin(uniform angle)
        xc = x - x.mean(-1, keepdims=True)
        grow = np.linalg.norm(x, axis=-1) / np.linalg.norm(xc, axis=-1)
    else:
        grow = np.ones(len(x))
    eps = per_token[None, :] * grow[:, None] + 1e-5  # + float32-vs-float64 forward slack
    at_final = np.array([modules[r["site"]] == ref.final_module for r in rows])
    # The final site's lens is the model's own output: use its real logits there.
    logits[at_final] = ref.logits[idx[at_final]]
    return logits, eps


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_lens_functions_match_the_models_distribution(family, sharp):
    store, ref = sharp(family)
    t1, t2 = TOKENS
    with actdb.connect(store, device="cpu") as db:
        if family == "gemma2":  # the logit transform is in play: logits reach the cap
            assert db.sql("SELECT logit_softcap FROM models").fetchall()[0][0] == \
                pytest.approx(ref.softcap) == 5.0
            assert np.abs(ref.logits).max() > 0.9 * 5.0
        rows = fetch(db, f"""
            SELECT a.prompt_id, a.position, a.site,
                   logprob(a.vec, {t1}) AS lp, prob(a.vec, {t1}) AS p,
                   token_rank(a.vec, {t1}) AS rank, entropy(a.vec) AS h,
                   logit_diff(a.vec, {t1}, {t2}) AS ld, kl_to(a.vec, f.vec) AS kl
            FROM acts a JOIN acts f ON f.model = a.model AND f.prompt_id = a.prompt_id
                 AND f.position = a.position AND f.role = 'final'
            WHERE a.role IN ('pre_attn', 'pre_mlp', 'final')
              AND list_contains($prompts, a.prompt_id)
            ORDER BY a.site, a.prompt_id, a.position""", {"prompts": list(PROMPT_SUBSET)})
        lg, eps = lens_reference(ref, db, rows)
    lp = log_softmax(lg, axis=-1)
    e = eps.max(-1)  # the largest logit error over the vocabulary, per row
    assert e.max() < 0.05, "the bound would be too loose to test anything"

    got = np.array([r["lp"] for r in rows])
    np.testing.assert_array_less(np.abs(got - lp[:, t1]), 2 * e)
    got_p = np.array([r["p"] for r in rows])
    p_ref = np.exp(lp[:, t1])
    np.testing.assert_array_less(np.abs(got_p - p_ref), p_ref * np.expm1(2 * e))

    mine = lg[:, t1:t1 + 1]
    lo = 1 + (lg > mine + 2 * eps[:, t1:t1 + 1]).sum(-1)
    hi = 1 + (lg > mine - 2 * eps[:, t1:t1 + 1]).sum(-1)
    rank = np.array([r["rank"] for r in rows])
    assert np.all((lo <= rank) & (rank <= hi))
    assert np.mean(rank == 1 + (lg > mine).sum(-1)) > 0.9  # exact away from near-ties

    p = np.exp(lp)
    h_ref = -(p * lp).sum(-1)
    sd = np.sqrt((p * (lg - (p * lg).sum(-1, keepdims=True)) ** 2).sum(-1))
    np.testing.assert_array_less(np.abs(np.array([r["h"] for r in rows]) - h_ref),
                                 1.5 * e * sd + 1e-5)

    ld_ref = lg[:, t1] - lg[:, t2]
    np.testing.assert_array_less(np.abs(np.array([r["ld"] for r in rows]) - ld_ref),
                                 eps[:, t1] + eps[:, t2])

    # kl_to(layer, final): KL(p_final || p_layer), the final lens being the model's logits.
    final_of = {(r["prompt_id"], r["position"]): i for i, r in enumerate(rows)
                if r["site"] == "final"}
    fi = np.array([final_of[(r["prompt_id"], r["position"])] for r in rows])
    lpt, et = lp[fi], e[fi]
    kl_ref = (np.exp(lpt) * (lpt - lp)).sum(-1)
    bound = 2 * e + 2 * et * (1 + np.abs(lpt - lp).max(-1))
    kl = np.array([r["kl"] for r in rows])
    np.testing.assert_array_less(np.abs(kl - kl_ref), bound)
    assert np.all(kl[fi == np.arange(len(rows))] == 0)
    # The distributions vary far beyond the bounds, so the bounds tell right from wrong.
    assert kl_ref.max() > 4 * bound.max() and np.ptp(h_ref) > 5 * (1.5 * e * sd).max()


def test_lens_at_the_final_site_is_the_models_prediction(sharp):
    store, ref = sharp("gemma2")
    with actdb.connect(store, device="cpu") as db:
        rows = fetch(db, "SELECT prompt_id, position, top_logits(vec, 1)[1].token_id AS top "
                         "FROM acts WHERE site = 'final' ORDER BY prompt_id, position")
        argmax = ref.logits[ref.rows([r["prompt_id"] for r in rows],
                                     [r["position"] for r in rows])].argmax(-1)
        got = fetch(db, "SELECT token_rank(vec, $t) AS r, prob(vec, $t) AS p FROM acts "
                        "WHERE site = 'final' AND prompt_id = 0 AND position = 1",
                    {"t": int(argmax[1])})
    assert [r["top"] for r in rows] == argmax.tolist()
    assert got[0]["r"] == 1 and 0 < got[0]["p"] < 1


def test_lens_products_get_the_threads_their_size_earns(family_store, monkeypatch):
    """The UDF runs its kernels at one torch thread (threads.py); each lens block's product
    with the whole vocabulary and the caller's reductions over it run at what `threads_for`
    gives that product's size, as the top-k's product does. `threads_for` is made to answer
    3, 2, 3, ... from a caller at one thread: `kl_to`, which walks two blocks' logits at once,
    must run both at one setting and leave the caller's one thread behind. (The float32
    product's path: the bfloat16 kernel, vocab_scan.py, runs its own threads.)"""
    from actdb.query import lens

    monkeypatch.setenv("ACTDB_VOCAB_SCAN", "off")

    asked: list[float] = []
    answers = iter([3, 2] * 100)
    in_product: list[int] = []
    in_reduction: list[int] = []
    real_logits, real_log_softmax = lens._to_logits, torch.log_softmax

    def product_spy(model, scores):
        in_product.append(torch.get_num_threads())
        return real_logits(model, scores)

    def reduction_spy(*args, **kwargs):
        in_reduction.append(torch.get_num_threads())
        return real_log_softmax(*args, **kwargs)

    monkeypatch.setattr(lens, "threads_for", lambda flops, device=None: (
        asked.append(flops), next(answers))[1])
    monkeypatch.setattr(lens, "_to_logits", product_spy)
    monkeypatch.setattr(torch, "log_softmax", reduction_spy)
    caller = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with actdb.connect(family_store("qwen3"), device="cpu") as db:
            n = db.sql("SELECT count(*) FROM acts WHERE site = 'final'").fetchall()[0][0]
            got = db.sql("SELECT entropy(vec), kl_to(vec, vec) FROM acts "
                         "WHERE site = 'final'").fetchall()
            w, _ = db.source.weights.unembed(db.source.models[0])
            left = torch.get_num_threads()
    finally:
        torch.set_num_threads(caller)
    assert len(got) == n and all(h is not None and kl is not None for h, kl in got)
    assert in_product and set(in_product) <= {2, 3}, in_product
    # entropy's block at the first answer (3), kl_to's two walks at the one setting (2)
    assert in_reduction == [3] + [2, 2] * (len(in_reduction) // 2), in_reduction
    assert asked and set(asked) <= {2.0 * rows * w.numel() for rows in range(1, n + 1)}, asked
    assert left == 1


def test_lens_is_null_off_the_residual_stream(family_store):
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        rows = db.sql("SELECT role, logprob(vec, 5), prob(vec, 5), token_rank(vec, 5), "
                      "entropy(vec), logit_diff(vec, 5, 6), kl_to(vec, vec), "
                      "count(*) OVER () FROM acts WHERE prompt_id = 0 AND position = 1"
                      ).fetchall()
    off = [r for r in rows if r[0] in ("q_norm", "k_norm")]
    on = [r for r in rows if r[0] not in ("q_norm", "k_norm", "inner")]
    assert off and on
    assert all(v is None for r in off for v in r[1:7])
    assert all(v is not None for r in on for v in r[1:7])
    # a target off the stream: NULL too, whether or not the call holds any row on it
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        for where in ("t.role = 'k_norm'", "t.role IN ('k_norm', 'final')"):
            kl = db.sql("SELECT t.role, kl_to(a.vec, t.vec) FROM acts a JOIN acts t "
                        "USING (prompt_id, position) WHERE a.site = 'final' AND a.prompt_id = 0 "
                        f"AND {where}").fetchall()
            assert kl and all((v is None) == (role == "k_norm") for role, v in kl), kl


def test_lens_bad_token_and_doc_bounds(family_store):
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        with pytest.raises(actdb.TokenError, match="is not one token"):
            db.sql("SELECT logprob(vec, ' Paris is') FROM acts LIMIT 1").fetchall()
    for name in ("logprob", "prob", "token_rank", "entropy", "kl_to", "logit_diff", "delta"):
        assert "error" in REGISTRY[name].doc or "exact" in REGISTRY[name].doc, name
    assert "2^-11" in REGISTRY["delta"].doc


# -- delta -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "gemma2", "gpt_neox"])
def test_delta_is_the_blocks_write_within_its_bound(family, reference, family_store):
    """Against the float64 reference's site inputs. GPT-NeoX's parallel blocks norm both
    sublayers' input from one residual: there the pre_attn delta is zero, exactly, and the
    pre_mlp delta carries both sublayers' writes (as the reference says)."""
    ref = reference(family)
    with actdb.connect(family_store(family), device="cpu") as db:
        sites = db.sql("SELECT site, module, role, d FROM sites WHERE role IN "
                       "('pre_attn', 'pre_mlp', 'final') ORDER BY layer, site_id").fetchall()
        rows = fetch(db, "SELECT site, role, prompt_id, position, delta(vec) AS dv FROM acts "
                         "WHERE list_contains($p, prompt_id) ORDER BY site, prompt_id, position",
                     {"p": list(PROMPT_SUBSET)})
    nxt = {a[0]: b[1] for a, b in zip(sites, sites[1:], strict=False)}
    modules = {s[0]: s[1] for s in sites}
    d = sites[0][3]
    factor = U16 + math.sqrt(d) * 2.0**-25 + 2.0**-23
    checked = 0
    for r in rows:
        if r["site"] not in nxt:  # the final site, or off the residual chain
            assert r["dv"] is None, r["site"]
            continue
        i = ref.rows([r["prompt_id"]], [r["position"]])[0]
        x, x_next = ref.sites[modules[r["site"]]].x[i], ref.sites[nxt[r["site"]]].x[i]
        err = np.linalg.norm(np.asarray(r["dv"]) - (x_next - x))
        bound = factor * (np.linalg.norm(x) + np.linalg.norm(x_next)) + 1e-5
        assert err <= bound, (r["site"], err, bound)
        if family == "gpt_neox" and r["role"] == "pre_attn":
            assert not np.any(r["dv"]), r["site"]
        checked += 1
    assert checked > 50


# -- aggregates and directions -----------------------------------------------------------------


def test_mean_vector_spectrum_and_directions(reference, family_store):
    ref = reference("gpt2")
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        modules = dict(db.sql("SELECT site, module FROM sites").fetchall())
        agg = fetch(db, """
            SELECT site, mean_vector(list(vec)) AS m, spectrum(list(normalized(vec)), 4) AS s4,
                   spectrum(list(normalized(vec))) AS s, spectrum(list(vec)) AS sx,
                   list(prompt_id) AS p, list(position) AS pos
            FROM acts GROUP BY site ORDER BY site""")
        direction = [float(v) for v in np.linspace(-1, 1, 64)]
        per_row = fetch(db, """
            WITH m AS (SELECT mean_vector(list(vec) FILTER (WHERE prompt_id = 0)) AS a,
                              mean_vector(list(vec) FILTER (WHERE prompt_id = 3)) AS b
                       FROM acts WHERE site = 'blocks.1.ln1')
            SELECT prompt_id, position, cosine_to(vec, $dir) AS c, project(vec, $dir) AS pr,
                   cosine_to(vec, (SELECT list_transform(range(64), lambda i: a[i + 1] - b[i + 1])
                                   FROM m)) AS cab
            FROM acts WHERE site = 'blocks.1.ln1' AND prompt_id IN (0, 3)
            ORDER BY prompt_id, position""", {"dir": direction})
        with pytest.raises(actdb.QueryError, match="direction has 3 values"):
            db.sql("SELECT cosine_to(vec, [1, 2, 3]) FROM acts LIMIT 1").fetchall()
        zero = db.sql("SELECT cosine_to(vec, $z), project(vec, $z) FROM acts LIMIT 1",
                      params={"z": [0.0] * 64}).fetchall()
    assert zero == [(None, None)]
    for r in agg:
        s = ref.sites[modules[r["site"]]]
        x = s.x[ref.rows(r["p"], r["pos"])]
        np.testing.assert_allclose(r["m"], x.mean(0), rtol=2e-3,
                                   atol=2e-3 * np.abs(x).max())
        want = np.linalg.eigvalsh(np.cov(s.normalized(x).T))[::-1]
        np.testing.assert_allclose(r["s"], want, atol=2e-3 * want[0])
        assert r["s4"] == r["s"][:4] and len(r["s"]) == 64
        wx = np.linalg.eigvalsh(np.cov(x.T))[::-1]
        np.testing.assert_allclose(r["sx"][:8], wx[:8], rtol=5e-3)
        # LayerNorm's normalized vectors have no component along 1: one vanishing direction
        # (129 vectors in 64 dims, so no other).
        assert r["s"][-1] < 1e-5 * r["s"][0] < r["s"][-2]
    x = ref.sites[modules["blocks.1.ln1"]].x
    rows = ref.rows([r["prompt_id"] for r in per_row], [r["position"] for r in per_row])
    dvec = np.asarray(direction)
    xr = x[rows]
    np.testing.assert_allclose([r["c"] for r in per_row],
                               xr @ dvec / np.linalg.norm(xr, axis=-1) / np.linalg.norm(dvec),
                               atol=2e-3)
    np.testing.assert_allclose([r["pr"] for r in per_row], xr @ dvec / np.linalg.norm(dvec),
                               rtol=2e-3, atol=2e-3 * np.abs(xr).max())
    a = x[ref.rows([0] * len(ref.input_ids[0]), range(len(ref.input_ids[0])))].mean(0)
    b = x[ref.rows([3] * len(ref.input_ids[3]), range(len(ref.input_ids[3])))].mean(0)
    ab = a - b
    np.testing.assert_allclose([r["cab"] for r in per_row],
                               xr @ ab / np.linalg.norm(xr, axis=-1) / np.linalg.norm(ab),
                               atol=5e-3)


@pytest.mark.parametrize("scale", [1e19, 1e-24, 1.0])
def test_a_directions_scale_does_not_change_its_answers(reference, family_store, scale):
    """cosine_to and project depend on a direction's line only: its length is taken in
    float64, where float32 entries near 1e19 do not overflow their squares (the answer was
    0) and entries near 1e-24 do not vanish (NULL), per row and constant."""
    ref = reference("gpt2")
    base = np.linspace(-1, 1, 64)
    direction = [float(np.float32(v * scale)) for v in base]
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        module = db.sql("SELECT module FROM sites WHERE site = 'blocks.1.ln1'").fetchone()[0]
        rows = fetch(db, """
            SELECT prompt_id, position, cosine_to(vec, $d) AS c, project(vec, $d) AS pr,
                   cosine_to(normed(vec), $d) AS cn,
                   cosine_to(vec, CASE WHEN position >= 0 THEN $d END) AS c_rows
            FROM acts WHERE site = 'blocks.1.ln1' AND prompt_id IN (0, 3)
            ORDER BY prompt_id, position""", {"d": direction})
    x = ref.sites[module].x[
        ref.rows([r["prompt_id"] for r in rows], [r["position"] for r in rows])]
    unit = base / np.linalg.norm(base)
    want_c = x @ unit / np.linalg.norm(x, axis=-1)
    for col in ("c", "c_rows"):
        np.testing.assert_allclose([r[col] for r in rows], want_c, atol=2e-3)
    np.testing.assert_allclose([r["pr"] for r in rows], x @ unit,
                               rtol=2e-3, atol=2e-3 * np.abs(x).max())
    assert all(r["cn"] is not None for r in rows)


def test_aggregates_with_many_lists_in_small_blocks(reference, family_store, monkeypatch):
    """Lists that share a site (GROUP BY prompt: one after another; GROUP BY position % 2:
    interleaved) and directions that differ by row, with vectors converted 3 rows at a time
    so that blocks cut through lists (aggregates._Moments, _against)."""
    from actdb.query import aggregates, runs

    monkeypatch.setattr(runs, "SCRATCH_FLOATS", 3 * 64)
    monkeypatch.setattr(aggregates, "_GRAM_BYTES", 2 * 8 * 64 * 64)  # spectrum: 2 lists a turn
    ref = reference("gpt2")
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        module = dict(db.sql("SELECT site, module FROM sites").fetchall())["blocks.1.ln1"]
        groups = {}
        for key in ("prompt_id", "position % 2"):
            groups[key] = fetch(db, f"""
                SELECT {key} AS k, mean_vector(list(vec)) AS m, spectrum(list(vec), 3) AS s,
                       spectrum(list(vec)) AS s_all,
                       list(prompt_id) AS p, list(position) AS pos
                FROM acts WHERE site = 'blocks.1.ln1' GROUP BY ALL ORDER BY k""")
        per_row = fetch(db, """
            SELECT prompt_id, position,
                   cosine_to(vec, list_transform(range(64), lambda i: (i * (position + 1)) % 7 - 3))
                       AS c,
                   project(vec, list_transform(range(64), lambda i: (i + prompt_id) % 5 - 2))
                       AS pr
            FROM acts WHERE site = 'blocks.1.ln1' ORDER BY prompt_id, position""")
    x = ref.sites[module].x
    assert len(groups["prompt_id"]) == len(PROMPTS) and len(groups["position % 2"]) == 2
    for rows in groups.values():
        for r in rows:
            xr = x[ref.rows(r["p"], r["pos"])]
            np.testing.assert_allclose(r["m"], xr.mean(0), rtol=2e-3,
                                       atol=2e-3 * np.abs(xr).max())
            if len(xr) < 2:
                assert r["s"] is None
                continue
            want = np.linalg.eigvalsh(np.cov(xr.T))[::-1]
            np.testing.assert_allclose(r["s"], want[:3], rtol=5e-3, atol=1e-3 * want[0])
            # fewer vectors than dimensions (an [n, n] problem): the rest are zeros
            np.testing.assert_allclose(r["s_all"], want, rtol=5e-3, atol=1e-3 * want[0])
    xr = x[ref.rows([r["prompt_id"] for r in per_row], [r["position"] for r in per_row])]
    i = np.arange(64)
    dc = np.array([(i * (r["position"] + 1)) % 7 - 3 for r in per_row], dtype=float)
    dp = np.array([(i + r["prompt_id"]) % 5 - 2 for r in per_row], dtype=float)
    np.testing.assert_allclose(
        [r["c"] for r in per_row],
        (xr * dc).sum(-1) / np.linalg.norm(xr, axis=-1) / np.linalg.norm(dc, axis=-1), atol=2e-3)
    np.testing.assert_allclose([r["pr"] for r in per_row],
                               (xr * dp).sum(-1) / np.linalg.norm(dp, axis=-1),
                               rtol=2e-3, atol=2e-3 * np.abs(xr).max())


def test_directions_reach_their_functions_as_ids(reference, family_store, monkeypatch):
    """A FLOAT[] direction reaches cosine_to and project as an id of the connection's table
    of directions (aggregates.DirectionTable): a constant one is registered by one call of
    one row however many rows use it; directions that differ by row are registered row by
    row; a NULL direction gives NULL, a NULL element is refused; past the table's bytes, a
    forgotten direction is an error, never another direction's values."""
    from actdb.query import aggregates

    calls = []
    ids = aggregates.DirectionTable.ids

    def counted(self, column):
        calls.append(len(column))
        return ids(self, column)

    monkeypatch.setattr(aggregates.DirectionTable, "ids", counted)
    ref = reference("gpt2")
    direction = [float(v) for v in np.cos(np.arange(64))]
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        module = dict(db.sql("SELECT site, module FROM sites").fetchall())["blocks.1.ln1"]
        q = """SELECT prompt_id, position, cosine_to(vec, $d) AS c, project(vec, $d) AS p,
                      cosine_to(vec, [cos(i) FOR i IN range(64)]) AS lit,
                      cosine_to(vec, [CASE WHEN i < 32 THEN cos(i) ELSE 0 END
                                      FOR i IN range(64)]) AS half
               FROM acts WHERE site = 'blocks.1.ln1' ORDER BY prompt_id, position"""
        rows = fetch(db, q, {"d": direction})
        assert len(rows) > 50 and calls == [1] * 4, calls  # $d twice, the two literals
        calls.clear()
        per_row = fetch(db, """
            SELECT prompt_id, position, cosine_to(vec, [cos(i + position) FOR i IN range(64)])
                   AS c
            FROM acts WHERE site = 'blocks.1.ln1' ORDER BY prompt_id, position""")
        assert sum(calls) == len(per_row)
        assert fetch(db, "SELECT cosine_to(vec, NULL) AS c, project(vec, NULL) AS p FROM acts "
                         "LIMIT 1") == [{"c": None, "p": None}]
        # a direction as a torch tensor (a probe's weights, db.vectors' rows) binds as a list
        as_tensor = fetch(db, q, {"d": torch.tensor(direction)})
        assert [r["c"] for r in as_tensor] == [r["c"] for r in rows]
        # ... and a NumPy array of any float type, and a NumPy scalar as a token (argmax)
        for given in (np.asarray(direction, dtype=np.float32),
                      list(np.asarray(direction, dtype=np.float64)),
                      [torch.tensor(v) for v in direction]):
            as_array = fetch(db, q, {"d": given})
            assert [r["c"] for r in as_array] == [r["c"] for r in rows]
        tid = np.argmax(np.arange(10))
        assert db.sql("SELECT logit(vec, $t) = logit(vec, 9) FROM acts LIMIT 1",
                      params={"t": tid}).fetchall() == [(True,)]
        # a [1, d] tensor, a string, a number: one sentence each
        with pytest.raises(actdb.QueryError, match=r"one vector: a 1-D list, array or tensor"):
            fetch(db, q, {"d": torch.tensor(direction)[None]})
        for bad in ("ab", 5):
            with pytest.raises(actdb.QueryError, match="params must be a dict"):
                db.sql("SELECT ?, ?", params=bad).fetchall()
        with pytest.raises(actdb.QueryError, match="give params as a dict for \\$name"):
            db.sql("SELECT $p", params=[1]).fetchall()
        with pytest.raises(actdb.QueryError, match="holds NULL"):
            db.sql("SELECT cosine_to(vec, [NULL] || [1.0 FOR i IN range(63)]) "
                   "FROM acts LIMIT 1").fetchall()
    x = ref.sites[module].x
    xr = x[ref.rows([r["prompt_id"] for r in rows], [r["position"] for r in rows])]
    d = np.cos(np.arange(64))
    for key in ("c", "lit"):
        np.testing.assert_allclose([r[key] for r in rows], xr @ d / np.linalg.norm(xr, axis=-1)
                                   / np.linalg.norm(d), atol=2e-3)
    np.testing.assert_allclose([r["p"] for r in rows], xr @ d / np.linalg.norm(d), rtol=2e-3,
                               atol=2e-3 * np.abs(xr).max())
    half = np.where(np.arange(64) < 32, d, 0.0)  # d's first half: another direction
    np.testing.assert_allclose([r["half"] for r in rows], xr @ half
                               / np.linalg.norm(xr, axis=-1) / np.linalg.norm(half), atol=2e-3)
    pos = np.array([r["position"] for r in per_row])
    dr = np.cos(np.arange(64)[None, :] + pos[:, None])
    np.testing.assert_allclose([r["c"] for r in per_row], (xr * dr).sum(-1)
                               / np.linalg.norm(xr, axis=-1) / np.linalg.norm(dr, axis=-1),
                               atol=2e-3)
    # A table that holds three directions: a query with one passes, and one whose rows each
    # need their own is told that a direction was forgotten.
    monkeypatch.setattr(aggregates.DirectionTable, "MAX_BYTES", 3 * 64 * 4)
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        again = fetch(db, q, {"d": direction})
        assert [r["c"] for r in again] == [r["c"] for r in rows]
        with pytest.raises(actdb.QueryError, match="forgotten"):
            db.sql("SELECT cosine_to(vec, [cos(i + position) FOR i IN range(64)]) "
                   "FROM acts WHERE site = 'blocks.1.ln1'").fetchall()


def test_the_direction_table_forgets_per_row_directions_before_constants(monkeypatch):
    """Past its bytes, the table forgets directions registered row by row before one
    registered alone (a constant that a bulk window may use for many calls without asking
    for it again); a forgotten id is an error, and each direction's bytes are held once."""
    import pyarrow as pa

    from actdb.query import aggregates

    monkeypatch.setattr(aggregates.DirectionTable, "MAX_BYTES", 3 * 4 * 4)  # three of d = 4
    table = aggregates.DirectionTable()
    const = table.ids(pa.array([[1.0, 2.0, 3.0, 4.0]], pa.list_(pa.float32())))[0].as_py()
    rows = table.ids(pa.array([[float(i), 0, 0, 1] for i in range(5)],
                              pa.list_(pa.float32()))).to_pylist()
    assert len(set(rows)) == 5 and const not in rows
    np.testing.assert_array_equal(table.values(const, "cosine_to"), [1, 2, 3, 4])
    np.testing.assert_array_equal(table.values(rows[-1], "cosine_to"), [4, 0, 0, 1])
    with pytest.raises(actdb.QueryError, match="forgotten"):
        table.values(rows[0], "cosine_to")
    again = table.ids(pa.array([[1.0, 2.0, 3.0, 4.0], None], pa.list_(pa.float32())))
    assert again.to_pylist() == [const, None]  # the same direction, the same id
    assert table._bytes == 3 * 16  # held once each


def test_lists_with_null_entries_skip_them(reference, family_store):
    """NULL handles in a list (a CASE without ELSE, an outer join) are skipped, and every other
    handle keeps its exact row: lists of one real vector among NULLs, and of several."""
    ref = reference("gpt2")
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        module = dict(db.sql("SELECT site, module FROM sites").fetchall())["blocks.1.ln1"]
        rows = fetch(db, """
            SELECT prompt_id AS p,
                   mean_vector(list(CASE WHEN position = 3 THEN vec END)) AS one,
                   mean_vector(list(CASE WHEN position % 2 = 1 THEN vec END)) AS odd,
                   spectrum(list(CASE WHEN position % 2 = 1 THEN vec END), 2) AS s_odd,
                   list(position) FILTER (WHERE position % 2 = 1) AS pos_odd
            FROM acts WHERE site = 'blocks.1.ln1' AND n_tokens > 5
            GROUP BY prompt_id ORDER BY prompt_id""")
    x = ref.sites[module].x
    assert len(rows) >= 3
    for r in rows:
        x3 = x[ref.rows([r["p"]], [3])][0]
        np.testing.assert_allclose(r["one"], x3, rtol=2e-3, atol=2e-3 * np.abs(x3).max())
        xo = x[ref.rows([r["p"]] * len(r["pos_odd"]), r["pos_odd"])]
        np.testing.assert_allclose(r["odd"], xo.mean(0), rtol=2e-3,
                                   atol=2e-3 * np.abs(xo).max())
        want = np.linalg.eigvalsh(np.cov(xo.T))[::-1][:2]
        np.testing.assert_allclose(r["s_odd"], want, rtol=5e-3, atol=1e-3 * want[0])


def test_spectrum_and_mean_vector_edge_cases(family_store):
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        one = db.sql("SELECT spectrum(list(vec)), mean_vector(list(vec)) FROM acts "
                     "WHERE site = 'final' AND prompt_id = 0 AND position = 0").fetchall()
        assert one[0][0] is None and len(one[0][1]) > 0
        with pytest.raises(actdb.QueryError, match="one width"):
            db.sql("SELECT mean_vector(list(vec)) FROM acts WHERE prompt_id = 0 "
                   "AND position = 0").fetchall()


# -- per-model token counts --------------------------------------------------------------------


def test_n_tokens_and_position_from_end_are_per_model(two_models):
    with actdb.connect(two_models, device="cpu") as db:
        counts = dict(((m, p), n) for m, p, n in db.sql(
            "SELECT model, prompt_id, count(*) FROM tokens GROUP BY ALL").fetchall())
        rows = db.sql("SELECT DISTINCT model, prompt_id, position, n_tokens, position_from_end "
                      "FROM acts").fetchall()
        last = db.sql("SELECT model, prompt_id, position FROM acts WHERE position_from_end = 0 "
                      "AND site = 'final' ORDER BY ALL").fetchall()
    assert len({n for (_, p), n in counts.items() if p == 0}) == 2, "tokenizers differ"
    for model, prompt_id, position, n, from_end in rows:
        assert n == counts[(model, prompt_id)]
        assert from_end == n - 1 - position
    assert last == sorted((m, p, n - 1) for (m, p), n in counts.items())
