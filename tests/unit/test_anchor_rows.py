"""One token's anchor or LM-head row without the whole vocabulary: `VectorSource.anchor`,
`unembed_row` and `Arrays.weight_rows` read one chunk of the weights and give, bit for bit,
the row of the whole matrix that `anchors`/`unembed` make; and the whole set's values are
the float64 unit rows of the stored weights."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import actdb
from actdb.errors import StoreCorruptError
from actdb.query.model_weights import ANCHOR_SETS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from generate import Shape, generate  # noqa: E402


def _model(db):
    return next(iter(db.source.models.values()))


@pytest.mark.parametrize("anchor_set", ANCHOR_SETS)
def test_an_anchor_made_alone_is_its_row_of_the_whole_set(family_store, anchor_set):
    path = family_store("gpt2")
    tids = [0, 7, 123, 399]  # model_weights._ROWS_ALONE rows: each read alone
    with actdb.connect(path, device="cpu") as db:  # rows first, on a fresh connection
        src, model = db.source, _model(db)
        alone = [src.weights.anchor(model, anchor_set, t) for t in tids]
        assert ("anchors", model.model_id, anchor_set) not in src.weights._weights
        assert ("w", model.model_id, "embed") not in src.weights._weights, "the whole was read"
        whole = src.weights.anchors(model, anchor_set)
        for t, a in zip(tids, alone, strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, whole[t]), t
        # from the set now
        assert torch.equal(src.weights.anchor(model, anchor_set, 123), whole[123])
        if anchor_set != "unembed_folded":  # the folded set is checked through queries
            name = "embed" if anchor_set == "embed" or model.tied_embeddings else "lm_head"
            w = src.store.arrays.weight(model.model_id, name).astype(np.float64)
            n = np.linalg.norm(w, axis=1, keepdims=True)
            want = w / np.where(n > 0, n, 1)
            np.testing.assert_allclose(whole.double().cpu().numpy(), want, rtol=0, atol=2e-7)


def test_an_lm_head_row_read_alone_is_its_row_of_unembed(family_store):
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        src, model = db.source, _model(db)
        rows = {t: src.weights.unembed_row(model, t) for t in (0, 42, 399)}
        w, b = src.weights.unembed(model)
        for t, (wr, br) in rows.items():
            assert torch.equal(wr, w[t])
            assert (br is None) == (b is None) and (b is None or torch.equal(br, b[t]))


def test_weight_rows_read_only_the_chunks_that_hold_them(tmp_path, monkeypatch):
    path = tmp_path / "s.actdb"
    generate(path, tokens=64, shape=Shape(d=8, vocab=20000, n_sites=1, prompt_tokens=8))
    with actdb.connect(path, device="cpu") as db:
        arrays = db.store.arrays
        mid = _model(db).model_id
        whole = arrays.weight(mid, "embed")
        read: list[int] = []
        checked = arrays.reader.chunk
        monkeypatch.setattr(arrays.reader, "chunk",
                            lambda label, info, i: read.append(i) or checked(label, info, i))
        got = arrays.weight_rows(mid, "embed", [19999, 5, 8191, 8192, 6])
        np.testing.assert_array_equal(got, whole[[19999, 5, 8191, 8192, 6]])
        assert sorted(read) == [0, 1, 2], read  # 8,192-row chunks: each read once
        with pytest.raises(IndexError):
            arrays.weight_rows(mid, "embed", [20000])
        chunk = path / "tensors.zarr" / "models" / str(mid) / "embed" / "c" / "1" / "0"
        chunk.write_bytes(b"\0" * 16 + chunk.read_bytes()[16:])  # damage chunk 1
        monkeypatch.undo()
        assert np.array_equal(arrays.weight_rows(mid, "embed", [3]), whole[[3]])  # chunk 0: fine
        with pytest.raises(StoreCorruptError):
            arrays.weight_rows(mid, "embed", [9000])


@pytest.mark.parametrize("function", ["cosine_to_anchor(vec, token_id)",
                                      "logit(vec, token_id)",
                                      "anchor_contribution(vec, 3, token_id)"])
def test_a_column_of_many_tokens_reads_a_few_rows_alone_then_the_whole_weight(
        family_store, monkeypatch, function):
    """A per-row token column asks for hundreds of tokens: at most a few are read alone (a
    chunk each), then the whole weight once; the values are those of a connection that
    read the whole weight first."""
    from actdb.query import model_weights

    path = family_store("gpt2")
    q = f"SELECT prompt_id, position, site, {function} AS v FROM acts ORDER BY ALL"
    with actdb.connect(path, device="cpu") as db:
        src = db.source
        alone: list[list[int]] = []
        wholes: list[str] = []
        rows_of, weight = src.store.arrays.weight_rows, src.store.arrays.weight
        monkeypatch.setattr(src.store.arrays, "weight_rows",
                            lambda mid, name, rows: alone.append(rows) or rows_of(mid, name, rows))
        monkeypatch.setattr(src.store.arrays, "weight",
                            lambda mid, name, **kw: wholes.append(name) or weight(mid, name, **kw))
        got = db.sql(q).fetchall()
        again = db.sql(q).fetchall()
    assert len({r[0] for r in db_tokens(path)}) > 50  # the column holds many tokens
    assert 0 < len(alone) <= 2 * model_weights._ROWS_ALONE, len(alone)  # the weight, and a bias
    assert wholes.count("lm_head") + wholes.count("embed") == 1, wholes
    assert got == again
    with actdb.connect(path, device="cpu") as db:
        model = _model(db)
        db.source.weights.unembed(model)  # the whole weights first, then the same query
        db.source.weights.anchors(model, None)
        assert db.sql(q).fetchall() == got


def db_tokens(path):
    with actdb.connect(path, device="cpu") as db:
        return db.sql("SELECT DISTINCT token_id FROM acts").fetchall()


def test_checks_keep_their_order_and_an_id_past_the_head_is_one_sentence(family_store):
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        with pytest.raises(actdb.QueryError, match="dim 999 is out of range"):
            db.sql("SELECT logit_contribution(vec, 999, 'zzzqqq') FROM acts").fetchall()
        with pytest.raises(actdb.QueryError, match="dim 999 is out of range"):
            db.sql("SELECT anchor_contribution(vec, 999, 'zzzqqq') FROM acts").fetchall()
        with pytest.raises(actdb.QueryError, match="token id 100000 is out of range"):
            db.sql("SELECT logit(vec, 100000) FROM acts").fetchall()


def test_many_token_strings_build_the_vocabulary_index_once(family_store):
    from actdb.query import tokens

    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        src, model = db.source, _model(db)
        strings = [r[0] for r in db.sql(
            "SELECT token FROM vocab WHERE model = 'gpt2' AND token IS NOT NULL "
            "ORDER BY token_id").fetchall()]
        first = {}
        for tid, text in enumerate(db.sql("SELECT token FROM vocab WHERE model = 'gpt2' "
                                          "ORDER BY token_id").fetchall()):
            if text[0] is not None:
                first.setdefault(text[0], tid)
        unique = [t for t in strings if strings.count(t) == 1][: 3 * tokens._STRINGS_ALONE]
        got = [src.tokens.resolve_token(model, t, "VARCHAR") for t in unique]
        assert got == [first[t] for t in unique]
        assert model.model_id in src.tokens._vocab  # built once the scans passed their number


@pytest.mark.parametrize("vec", ["vec", "normed(vec)"])
def test_a_token_column_gives_each_row_its_own_tokens_value(family_store, vec):
    """`cosine_to_anchor(vec, token_id)`: each row's value, bit for bit, is what the query with
    that row's token as a constant gives it (each token's rows are projected alone)."""
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        got = db.sql(f"SELECT prompt_id, position, site, token_id, "
                     f"cosine_to_anchor({vec}, token_id) FROM acts ORDER BY ALL").fetchall()
        tokens = sorted({r[3] for r in got})
        assert len(tokens) > 20
        for t in tokens[::5]:
            want = db.sql(f"SELECT prompt_id, position, site, token_id, "
                          f"cosine_to_anchor({vec}, {t}) FROM acts ORDER BY ALL").fetchall()
            mine = [r for r in got if r[3] == t]
            theirs = [r for r in want if r[3] == t]
            assert mine == theirs, t


def test_a_token_anchor_looked_up_once_serves_only_its_model_and_set(two_models, model_dir):
    """`cosine_to_anchor` keeps each token's anchor a connection looked up
    (kernels._token_anchor): a later query of the same token in another anchor set, or of
    another model, gets its own anchor, against float64 unit rows of the models' own weights
    (transformers) and the stored vectors."""
    from transformers import AutoModelForCausalLM

    want_rows = {}
    for family in ("gpt2", "llama"):
        model = AutoModelForCausalLM.from_pretrained(model_dir(family))
        want_rows[family] = {
            "embed": model.get_input_embeddings().weight.detach().double().numpy(),
            "unembed": model.get_output_embeddings().weight.detach().double().numpy()}
    assert not np.allclose(want_rows["llama"]["embed"][:20], want_rows["llama"]["unembed"][:20])
    with actdb.connect(two_models, device="cpu") as db:
        # the same token in other sets and models in turn: a key too coarse would serve one
        # query the anchor an earlier one looked up
        for family, tid, anchors in [("llama", 5, "embed"), ("llama", 5, "unembed"),
                                     ("gpt2", 5, "unembed"), ("llama", 5, ""),
                                     ("llama", 7, "unembed"), ("gpt2", 5, "embed")]:
            arg = f", '{anchors}'" if anchors else ""
            rows = db.sql(f"SELECT to_list(vec) AS x, cosine_to_anchor(vec, {tid}{arg}) AS c "
                          "FROM acts WHERE model = $m", params={"m": family}).fetchall()
            x = np.array([r[0] for r in rows], dtype=np.float64)
            a = want_rows[family][anchors or "unembed"][tid]
            want = x @ a / (np.linalg.norm(x, axis=1) * np.linalg.norm(a))
            got = np.array([r[1] for r in rows], dtype=np.float64)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-3,
                                       err_msg=f"{family} {tid} {anchors!r}")
