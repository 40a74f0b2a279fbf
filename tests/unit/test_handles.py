"""Handle encoding, table-driven: what decodes, what is refused and why, and the store limits.

The expected fields are written out by hand from the bit layout in docs/FORMAT.md, never
produced by the encoder under test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest

import actdb
from actdb.errors import IngestError, QueryError
from actdb.query.handles import Codec, Stream, encode_sql, view_sql
from actdb.store import limits

# A store of two models: model 0 with sites 0 and 1 (site 1 has 2 heads), model 3 with site 0.
STREAMS = [
    Stream(model_id=3, site_id=0, head=-1, n_rows=7),
    Stream(model_id=0, site_id=1, head=1, n_rows=100),
    Stream(model_id=0, site_id=0, head=-1, n_rows=100),
    Stream(model_id=0, site_id=1, head=0, n_rows=100),
    Stream(model_id=1000, site_id=4095, head=-1, n_rows=2),  # past the old 7-bit model ids
]
# Streams are numbered in (model_id, site_id, head) order: (0,0,-1)=0 (0,1,0)=1 (0,1,1)=2
# (3,0,-1)=3 (1000,4095,-1)=4
TAG = 0b101 << 60


def handle(row: int, stream: int, view: int = 0) -> int:
    return TAG | (view << 58) | (stream << 38) | row


DECODES = [
    # (handle, (model_id, site_id, head, row, view))
    (handle(0, 0), (0, 0, -1, 0, 0)),
    (handle(99, 0), (0, 0, -1, 99, 0)),
    (handle(5, 1), (0, 1, 0, 5, 0)),
    (handle(5, 2, view=2), (0, 1, 1, 5, 2)),
    (handle(6, 3, view=3), (3, 0, -1, 6, 3)),
    (handle(0, 3, view=1), (3, 0, -1, 0, 1)),
    (handle(1, 4, view=2), (1000, 4095, -1, 1, 2)),
]


@pytest.mark.parametrize(("value", "fields"), DECODES)
def test_decode(value: int, fields: tuple[int, ...]) -> None:
    d = Codec(STREAMS).decode(np.array([value], dtype=np.int64))
    assert (int(d.model_id[0]), int(d.site_id[0]), int(d.head[0]), int(d.row[0]),
            int(d.view[0])) == fields


REFUSED = [
    # (value, words the one sentence must hold)
    (0, "0 is not a vec handle of this store (a plain number"),
    (1, "1 is not a vec handle"),
    (12345, "12345 is not a vec handle"),
    (-1, "-1 is not a vec handle"),
    (-(1 << 63), "is not a vec handle"),
    ((1 << 63) - 1, "is not a vec handle"),
    ((1 << 60) | 5, "is not a vec handle"),  # a wrong tag
    ((0b111 << 60) | 5, "is not a vec handle"),
    (handle(0, 5), "names no model, site and head"),
    (handle(2, 4), "row 2 is past the 2 rows"),
    (handle(0, (1 << 20) - 1), "names no model, site and head"),
    (handle(7, 3), "row 7 is past the 7 rows"),
    (handle(100, 0), "row 100 is past the 100 rows"),
    (handle((1 << 38) - 1, 1), "is past the 100 rows"),
    (3 << 58, "is not a vec handle"),  # a view of 0: the plain number shows without view bits
]


@pytest.mark.parametrize(("value", "words"), REFUSED)
def test_refused(value: int, words: str) -> None:
    codec = Codec(STREAMS)
    good = handle(1, 0)
    with pytest.raises(QueryError) as info:
        codec.decode(np.array([good, value, good], dtype=np.int64))
    message = str(info.value)
    assert words in message and "\n" not in message and "acts" in message, message


def test_a_plain_number_given_to_a_view_is_shown_as_given() -> None:
    with pytest.raises(QueryError, match=r"^42 is not a vec handle"):
        Codec(STREAMS).decode(np.array([42 | (2 << 58)], dtype=np.int64))


@pytest.mark.parametrize(("row", "stream", "view"), [(0, 0, 0), (99, 1, 0), (3, 3, 0)])
def test_sql_encoding_matches_the_layout(row: int, stream: int, view: int) -> None:
    con = duckdb.connect()
    got = con.execute(f"SELECT {encode_sql(str(row), str(stream))}").fetchall()[0][0]
    assert got == handle(row, stream, view)


@pytest.mark.parametrize(("view", "code"), [("normalized", 1), ("normed", 2), ("final_norm", 3)])
def test_sql_views(view: str, code: int) -> None:
    con = duckdb.connect()
    raw = handle(4, 2)
    assert con.execute(f"SELECT {view_sql(str(raw), view)}").fetchall()[0][0] == handle(4, 2,
                                                                                        code)
    with pytest.raises(duckdb.Error, match="takes a raw vec"):
        con.execute(f"SELECT {view_sql(str(handle(4, 2, 1)), view)}").fetchall()
    # a plain number passes the view unchanged in its low bits and is refused on decode
    plain = con.execute(f"SELECT {view_sql('17', view)}").fetchall()[0][0]
    with pytest.raises(QueryError, match="^17 is not"):
        Codec(STREAMS).decode(np.array([plain]))


LIMITS = [
    # (existing streams, new streams, rows, refused by)
    (0, 10, 1000, None),
    (limits.MAX_STREAMS - 10, 10, 1000, None),
    (limits.MAX_STREAMS - 10, 11, 1000, "streams"),
    (0, limits.MAX_STREAMS + 1, 0, "streams"),
    (0, 1, limits.MAX_ROWS, None),
    (0, 1, limits.MAX_ROWS + 1, "rows"),
]


@pytest.mark.parametrize(("existing", "new", "rows", "refused"), LIMITS)
def test_store_limits(existing: int, new: int, rows: int, refused: str | None) -> None:
    def check() -> None:
        limits.check_streams(existing, new, "m")
        limits.check_rows(rows, "m")

    if refused is None:
        check()
    else:
        with pytest.raises(IngestError, match=refused):
            check()


def test_limits_match_the_handle_bits() -> None:
    assert limits.MAX_ROWS == 1 << 38 and limits.MAX_STREAMS == 1 << 20
    biggest = handle(limits.MAX_ROWS - 1, limits.MAX_STREAMS - 1, 3)
    assert 0 < biggest < (1 << 63)  # a positive BIGINT
    assert Codec([Stream(model_id=0, site_id=0, head=-1, n_rows=1)]).decode(
        np.array([handle(0, 0)])).row[0] == 0
    with pytest.raises(QueryError, match="streams"):
        Codec(Stream(model_id=0, site_id=i, head=-1, n_rows=1)
              for i in range(limits.MAX_STREAMS + 1))


def test_handles_of_a_real_store(family_store: Callable[[str], Path]) -> None:
    """On a real store: every vec decodes to the row, site and head the catalog says, and
    forged values around the real ones are refused with one sentence."""
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        db.sql("SELECT count(*) FROM acts").fetchall()  # the view is made by the first query
        rows = db.con.execute(
            "SELECT a.vec, t.\"row\", s.site_id, coalesce(a.head, -1), m.model_id FROM acts a "
            "JOIN tokens t USING (model, prompt_id, position) "
            "JOIN sites s ON s.model = a.model AND s.site = a.site "
            "JOIN models m ON m.model = a.model").fetchall()
        vec = np.array([r[0] for r in rows], dtype=np.int64)
        d = db.source.codec.decode(vec)
        assert d.row.tolist() == [r[1] for r in rows]
        assert d.site_id.tolist() == [r[2] for r in rows]
        assert d.head.tolist() == [r[3] for r in rows]
        assert d.model_id.tolist() == [r[4] for r in rows]
        assert (d.view == 0).all() and (d.head >= 0).any()  # qwen3 has q/k-norm heads
        n_rows = db.sql("SELECT n_rows FROM models").fetchall()[0][0]
        # Arithmetic on vec is refused by its syntax (plan.py); under a window the reading
        # of the syntax sees no handle, and the handle's own checks refuse what comes out.
        for forged in ("position", f"max(vec) OVER () + {n_rows}",
                       "max(vec) OVER () | (1000::BIGINT << 38)", "-max(vec) OVER ()",
                       "token_id::BIGINT", "xor(max(vec) OVER (), 1::BIGINT << 61)",
                       "normed(position)"):
            sql = f"SELECT vec_norm({forged}) FROM acts ORDER BY vec DESC LIMIT 3"
            with pytest.raises(QueryError, match="is not a vec handle of this store"):
                db.sql(sql).fetchall()
        for forged in (f"vec + {n_rows}", "vec | (1000::BIGINT << 38)", "-vec",
                       "xor(vec, 1::BIGINT << 61)", "vec * 1", "vec / norm"):
            sql = f"SELECT vec_norm({forged}) FROM acts ORDER BY vec DESC LIMIT 3"
            with pytest.raises(QueryError, match="arithmetic on a vec handle"):
                db.sql(sql).fetchall()
        # reading a handle's fields is not arithmetic that names another row
        assert db.sql(f"SELECT min(vec & {(1 << 38) - 1}) FROM acts").fetchall() == [(0,)]


def test_ingest_stops_at_the_limits(tmp_path: Path, model_dir: Callable[[str], Path],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The catalog enforces the limits where a model is registered and where rows are
    committed: with the limits made small, a real ingest stops with one sentence and the store
    still opens and verifies."""
    store = tmp_path / "s.actdb"

    def run(prompts: list[str]) -> None:
        actdb.ingest(store, model=str(model_dir("gpt2")), prompts=prompts, device="cpu",
                     name="gpt2", batch_size=1, chunk_tokens=4)

    monkeypatch.setattr(limits, "MAX_STREAMS", 3)
    with pytest.raises(IngestError, match=r"to \d+ \(model, site, head\) streams, more than "
                                          r"the 3"):
        run(["one two three"])
    monkeypatch.setattr(limits, "MAX_STREAMS", 1 << 20)
    monkeypatch.setattr(limits, "MAX_ROWS", 5)
    with pytest.raises(IngestError, match="token rows, more than the 5"):
        run(["one two three", "four five six seven", "eight"])
    with actdb.connect(store, device="cpu") as db:
        assert db.verify() == []
        rows, sites = db.sql("SELECT n_rows, n_sites FROM models").fetchall()[0]
        assert rows <= 5  # the commits that fit, if any (batches commit a chunk at a time)
        assert db.sql("SELECT count(*) FROM acts").fetchall()[0][0] == rows * sites


def test_a_handle_of_another_store_is_refused(family_store: Callable[[str], Path],
                                              model_dir: Callable[[str], Path],
                                              tmp_path: Path) -> None:
    """Two stores of the same model and prompts, open in one process: a handle of one is not a
    handle of the other (it used to read the other store's row at the same stream and row).
    The same store opened twice agrees on its handles (workers of a cluster query do too)."""
    from support.prompts import PROMPTS

    other = tmp_path / "other.actdb"
    actdb.ingest(other, model=str(model_dir("gpt2")), prompts=PROMPTS, device="cpu",
                 name="gpt2", batch_size=2)
    pick = ("SELECT vec FROM acts WHERE prompt_id = 0 AND position = 1 "
            "AND site = 'blocks.1.ln1'")
    with actdb.connect(family_store("gpt2"), device="cpu") as a, \
            actdb.connect(other, device="cpu") as b, \
            actdb.connect(family_store("gpt2"), device="cpu") as a2:
        assert a.source.codec.salt != b.source.codec.salt
        (hb,), = b.sql(pick).fetchall()
        (ha,), = a.sql(pick).fetchall()
        with pytest.raises(QueryError, match="is not a vec handle of this store"):
            a.sql("SELECT vec_norm($h::BIGINT)", params={"h": hb}).fetchall()
        (mine,), = a.sql("SELECT vec_norm(vec) FROM (" + pick + ")").fetchall()
        assert a2.sql("SELECT vec_norm($h::BIGINT)", params={"h": ha}).fetchall() == [(mine,)]
