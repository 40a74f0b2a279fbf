"""Handles, table-driven: the layout and its code against a byte-wise SipHash written here from
the paper, what opens and what is refused, SQL forms on `vec` that must be refused or give the
row's own value, handles of other connections and stores, and the store limits.

Expected handles are built here from the bit layout in docs/FORMAT.md and this file's own
SipHash, never by the codec under test.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import actdb
from actdb.errors import IngestError, QueryError
from actdb.query import handles as H
from actdb.query.handles import Codec, Stream
from actdb.store import limits

MASK64 = (1 << 64) - 1


def siphash24(key: bytes, msg: bytes) -> int:
    """SipHash-2-4 as the paper (Aumasson and Bernstein, 2012) states it, byte by byte."""
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D,
         k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rotl(x: int, b: int) -> int:
        return ((x << b) | (x >> (64 - b))) & MASK64

    def sipround() -> None:
        v[0] = (v[0] + v[1]) & MASK64
        v[1] = rotl(v[1], 13) ^ v[0]
        v[0] = rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & MASK64
        v[3] = rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & MASK64
        v[3] = rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & MASK64
        v[1] = rotl(v[1], 17) ^ v[2]
        v[2] = rotl(v[2], 32)

    whole = len(msg) - len(msg) % 8
    for i in range(0, whole, 8):
        m = int.from_bytes(msg[i : i + 8], "little")
        v[3] ^= m
        sipround()
        sipround()
        v[0] ^= m
    b = ((len(msg) & 0xFF) << 56) | int.from_bytes(msg[whole:], "little")
    v[3] ^= b
    sipround()
    sipround()
    v[0] ^= b
    v[2] ^= 0xFF
    for _ in range(4):
        sipround()
    return v[0] ^ v[1] ^ v[2] ^ v[3]


KEY = bytes(range(16))


def test_the_reference_siphash_gives_the_papers_vector() -> None:
    # Appendix A of the paper: key 00..0f, message 00..0e
    assert siphash24(KEY, bytes(range(15))) == 0xA129CA6149BE45E5


@pytest.mark.parametrize("compiled", [False, True])
def test_codes_match_the_reference(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if compiled and not H._COMPILED:
        pytest.skip("no compiled module in this build")
    monkeypatch.setattr(H, "_COMPILED", compiled)
    rng = np.random.default_rng(0)
    fields = np.concatenate([rng.integers(0, 1 << 62, 300, dtype=np.int64),
                             [0, 1, (1 << 62) - 1, H.TAG]]).astype(np.int64)
    key = rng.bytes(16)
    sealed = Codec([], key=key).seal(fields)
    expected = [(int(f) << 64) | siphash24(key, int(f).to_bytes(8, "little")) for f in fields]
    assert H.to_ints(sealed) == expected
    assert Codec([], key=key).open(sealed).tolist() == fields.tolist()
    assert H.siphash_numpy(key, fields.view(np.uint64)).tolist() == [e & MASK64
                                                                      for e in expected]


# A store of two models: model 0 with sites 0 and 1 (site 1 has 2 heads), model 3 with site 0.
STREAMS = [
    Stream(model_id=3, site_id=0, head=-1, n_rows=7),
    Stream(model_id=0, site_id=1, head=1, n_rows=100),
    Stream(model_id=0, site_id=0, head=-1, n_rows=100),
    Stream(model_id=0, site_id=1, head=0, n_rows=100),
    Stream(model_id=1000, site_id=4095, head=-1, n_rows=2),
]
# Streams are numbered in (model_id, site_id, head) order: (0,0,-1)=0 (0,1,0)=1 (0,1,1)=2
# (3,0,-1)=3 (1000,4095,-1)=4


def word(row: int, stream: int, view: int = 0) -> int:
    """The fields word, by hand from the layout: tag bit 61, view 58-60, stream 38-57."""
    return (1 << 61) | (view << 58) | (stream << 38) | row


def handle(row: int, stream: int, view: int = 0, key: bytes = KEY) -> int:
    w = word(row, stream, view)
    return (w << 64) | siphash24(key, w.to_bytes(8, "little"))


DECODES = [
    # (handle, (model_id, site_id, head, row, view))
    (handle(0, 0), (0, 0, -1, 0, 0)),
    (handle(99, 0), (0, 0, -1, 99, 0)),
    (handle(5, 1), (0, 1, 0, 5, 0)),
    (handle(5, 2, view=2), (0, 1, 1, 5, 2)),
    (handle(6, 3, view=3), (3, 0, -1, 6, 3)),
    (handle(0, 3, view=1), (3, 0, -1, 0, 1)),
    (handle(1, 4, view=2), (1000, 4095, -1, 1, 2)),
    (handle((1 << 38) - 1, 4), (1000, 4095, -1, (1 << 38) - 1, 0)),
]


@pytest.mark.parametrize(("value", "fields"), DECODES)
def test_open_and_decode(value: int, fields: tuple[int, ...]) -> None:
    codec = Codec(STREAMS, key=KEY)
    d = codec.decode(codec.open(H.from_ints([value])))
    assert (int(d.model_id[0]), int(d.site_id[0]), int(d.head[0]), int(d.row[0]),
            int(d.view[0])) == fields
    assert 1 << 125 <= value < 1 << 126  # a positive DECIMAL(38, 0), past any BIGINT


PLAIN = "is not a vec handle of this connection (a plain number"
CHANGED = "is not a vec handle of this connection: its code does not match its fields"
REFUSED = [
    # (value, words the one sentence must hold)
    (0, PLAIN),
    (1, PLAIN),
    (12345, PLAIN),
    (-1, PLAIN),
    (-(1 << 127), PLAIN),
    ((1 << 64) - 1, PLAIN),
    (word(3, 0) << 64, CHANGED),  # fields without a code
    (handle(3, 0) + 1, CHANGED),  # the code changed
    (handle(3, 0) + (1 << 64), CHANGED),  # the next row, same code
    (handle(3, 0) - (1 << 64), CHANGED),  # the row before
    (handle(3, 0) ^ (1 << (64 + 38)), CHANGED),  # the next stream
    (handle(3, 0) | (2 << (64 + 58)), CHANGED),  # a view the codec did not seal
    (handle(3, 0, key=bytes(16)), CHANGED),  # another connection's key
    (handle(3, 0) * 2, CHANGED),
    (handle(3, 0) ^ (1 << (61 + 64)), CHANGED),  # without its tag bit
    ((1 << 127) - 1, CHANGED),
    (handle(3, 0) - (1 << 125), CHANGED),
]


@pytest.mark.parametrize(("value", "words"), REFUSED)
def test_refused(value: int, words: str) -> None:
    codec = Codec(STREAMS, key=KEY)
    good = handle(1, 0)
    with pytest.raises(QueryError) as info:
        codec.open(H.from_ints([good, value, good]))
    message = str(info.value)
    assert message.startswith(f"{value} ") and words in message, message
    assert "\n" not in message and "acts" in message, message
    assert not codec.opens(H.from_ints([good, value]))
    assert codec.opens(H.from_ints([good, handle(2, 3, view=1)]))


def test_opened_handles_keep_their_place_in_sliced_and_chunked_arrays() -> None:
    codec = Codec(STREAMS, key=KEY)
    values = [handle(r, 0) for r in range(10)]
    arr = H.from_ints(values)
    assert codec.open(arr.slice(3, 4)).tolist() == [word(r, 0) for r in range(3, 7)]
    chunked = pa.chunked_array([arr.slice(0, 2), arr.slice(5, 3)])
    assert codec.open(chunked).tolist() == [word(r, 0) for r in (0, 1, 5, 6, 7)]
    assert H.to_ints(arr) == values


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
    biggest = handle(limits.MAX_ROWS - 1, limits.MAX_STREAMS - 1, 7)
    assert biggest < 10 ** 38  # Arrow's decimal128(38, 0) carries it
    with pytest.raises(QueryError, match="streams"):
        Codec(Stream(model_id=0, site_id=i, head=-1, n_rows=1)
              for i in range(limits.MAX_STREAMS + 1))


# -- SQL on a real store ---------------------------------------------------------------------

REFUSE, OWN = "refused", "own"
# (the handle expression, what it must give: refused, or the row's own vector). `vec` is the
# row's handle; each is passed to vec_norm and compared with the row's stored norm.
FORMS = [
    ('"+"(vec, 1)', REFUSE),
    ("vec.add(1)", REFUSE),
    ("add(vec, 1)", REFUSE),
    ("vec + 1", REFUSE),
    ("vec - 1", REFUSE),
    ("-vec", REFUSE),
    ("vec * 2", REFUSE),
    ("abs(vec) + 1", REFUSE),
    ("round(vec) + 1", REFUSE),
    ("(SELECT vec) + 1", REFUSE),
    ("coalesce(vec) + 1", REFUSE),
    ("greatest(vec, vec + 1)", REFUSE),
    ("CASE WHEN true THEN vec + 1 END", REFUSE),
    ("CAST(vec::DOUBLE AS BIGINT)", REFUSE),
    ("CAST(vec::DOUBLE AS HUGEINT)", REFUSE),
    ("vec::DOUBLE::DECIMAL(38, 0)", REFUSE),
    ("vec::FLOAT::HUGEINT", REFUSE),
    ("xor(vec::HUGEINT, 1)", REFUSE),
    ("xor(vec::HUGEINT, 1::HUGEINT << 64)", REFUSE),  # the next row, same code
    ("vec::HUGEINT | (1::HUGEINT << 102)", REFUSE),  # another stream, same code
    ("vec::HUGEINT + (1::HUGEINT << 64)", REFUSE),
    ("~vec::HUGEINT", REFUSE),
    ("(vec::HUGEINT >> 64) << 64", REFUSE),  # the fields alone
    ("vec::HUGEINT >> 64", REFUSE),
    ("replace(vec::VARCHAR, '4', '5')::HUGEINT", REFUSE),
    ("position", REFUSE),
    ("token_id::HUGEINT << 64", REFUSE),
    ("vec", OWN),
    ("(SELECT vec)", OWN),
    ("vec::VARCHAR::HUGEINT", OWN),
    ("vec::VARCHAR::DECIMAL(38, 0)", OWN),
    ("vec::HUGEINT", OWN),
    ("vec::UHUGEINT", OWN),
    ("xor(vec::HUGEINT, 0)", OWN),
    ("vec * 1", OWN),
    ("vec + 0", OWN),
    ("abs(vec)", OWN),
    ("round(vec)", OWN),
    ("coalesce(NULL, vec)", OWN),
]
WHERE = "WHERE prompt_id = 1 AND position < 4 AND head IS NULL ORDER BY site, position"


@pytest.fixture(scope="module")
def gpt2(family_store: Callable[[str], Path]) -> Iterator[Any]:
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        yield db


def _one_sentence(e: QueryError) -> str:
    message = str(e)
    assert "\n" not in message and message.strip(), message
    return message


@pytest.mark.parametrize(("form", "outcome"), FORMS)
def test_forms_on_vec_are_refused_or_name_their_own_row(gpt2: Any, form: str,
                                                        outcome: str) -> None:
    sql = f"SELECT vec_norm({form}), norm FROM acts {WHERE}"
    if outcome == REFUSE:
        with pytest.raises(QueryError) as info:
            gpt2.sql(sql).fetchall()
        _one_sentence(info.value)
    else:
        rows = gpt2.sql(sql).fetchall()
        assert len(rows) > 8
        np.testing.assert_allclose([r[0] for r in rows], [r[1] for r in rows], rtol=1e-6)


AGGREGATE_FORMS = [
    "vec_norm(any_value(vec) + 1)",
    "vec_norm(max(vec) + 1)",
    "vec_norm(first(vec) - 1)",
    "mean_vector(list(vec + 1))",
    "mean_vector([any_value(vec) + 1])",
    "vec_norm(normed(any_value(vec)) + 1)",
    "vec_norm(normed(any_value(vec) + 1))",
    "cosine(any_value(vec), any_value(vec) + 1)",
    "to_list(any_value(vec)::DOUBLE::HUGEINT)",
]


@pytest.mark.parametrize("form", AGGREGATE_FORMS)
def test_aggregates_of_vec_changed_are_refused(gpt2: Any, form: str) -> None:
    with pytest.raises(QueryError) as info:
        gpt2.sql(f"SELECT {form} FROM acts WHERE prompt_id = 1 AND head IS NULL "
                 "GROUP BY site").fetchall()
    _one_sentence(info.value)


def test_views_take_raw_handles_and_name_their_row(gpt2: Any) -> None:
    rows = gpt2.sql(f"SELECT vec_norm(normalized(vec)), vec_norm(normed(vec::VARCHAR::HUGEINT)),"
                    f" vec_norm(normed(vec)) FROM acts {WHERE}").fetchall()
    assert len(rows) > 8 and all(r[1] == r[2] for r in rows)
    for sql in ("SELECT vec_norm(normed(normed(vec))) FROM acts",
                "SELECT vec_norm(normed(vec) + 1) FROM acts",
                "SELECT vec_norm(normed(vec + 1)) FROM acts",
                "SELECT vec_norm(final_norm(normalized(vec))) FROM acts"):
        with pytest.raises(QueryError) as info:
            gpt2.sql(sql).fetchall()
        _one_sentence(info.value)


def test_handles_of_a_real_store(family_store: Callable[[str], Path]) -> None:
    """Every vec opens to the row, site and head the catalog says."""
    with actdb.connect(family_store("qwen3"), device="cpu") as db:
        table = db.sql(
            "SELECT a.vec, t.row, s.site_id, coalesce(a.head, -1) AS head, m.model_id "
            "FROM acts a JOIN tokens t USING (model, prompt_id, position) "
            "JOIN sites s ON s.model = a.model AND s.site = a.site "
            "JOIN models m ON m.model = a.model").to_arrow_table()
        d = db.source.codec.decode(db.source.codec.open(table.column("vec")))
        assert d.row.tolist() == table.column("row").to_pylist()
        assert d.site_id.tolist() == table.column("site_id").to_pylist()
        assert d.head.tolist() == table.column("head").to_pylist()
        assert d.model_id.tolist() == table.column("model_id").to_pylist()
        assert (d.view == 0).all() and (d.head >= 0).any()  # qwen3 has q/k-norm heads
        # a handle's fields are not secret: reading them is plain SQL
        assert db.sql("SELECT min((vec::HUGEINT >> 64) & 274877906943) FROM acts"
                      ).fetchall() == [(0,)]


def test_a_handle_of_another_connection_or_store_is_refused(
        family_store: Callable[[str], Path], model_dir: Callable[[str], Path],
        tmp_path: Path) -> None:
    """A handle is good in the connection that made it only: another store of the same model
    and prompts, the same store opened again, or in another process, refuse it; its own
    connection reads the row's vector from it, as a parameter too."""
    from support.prompts import PROMPTS

    other = tmp_path / "other.actdb"
    actdb.ingest(other, model=str(model_dir("gpt2")), prompts=PROMPTS, device="cpu",
                 name="gpt2", batch_size=2)
    pick = ("SELECT vec, norm FROM acts WHERE prompt_id = 0 AND position = 1 "
            "AND site = 'blocks.1.ln1'")
    with actdb.connect(family_store("gpt2"), device="cpu") as a, \
            actdb.connect(other, device="cpu") as b, \
            actdb.connect(family_store("gpt2"), device="cpu") as a2:
        (hb, _), = b.sql(pick).fetchall()
        (ha, norm), = a.sql(pick).fetchall()
        for db, h in ((a, hb), (a2, ha), (b, ha)):
            for sql in ("SELECT vec_norm($h)", "SELECT vec_norm($h::VARCHAR::HUGEINT)",
                        "SELECT to_list(normed($h))"):
                with pytest.raises(QueryError, match=CHANGED):
                    db.sql(sql, params={"h": h}).fetchall()
            with pytest.raises(QueryError, match=CHANGED):
                db.vectors("SELECT $h::DECIMAL(38, 0) AS vec", params={"h": h})
        assert a.sql("SELECT vec_norm($h)", params={"h": ha}).fetchall() == [(norm,)]
        assert a.sql("SELECT vec_norm($h)", params={"h": int(ha)}).fetchall() == [(norm,)]


def test_no_sql_makes_a_handle_of_a_row_the_store_does_not_hold(gpt2: Any) -> None:
    """The functions that make handles are internal (the sandbox refuses their names); called
    on the connection itself, past the sandbox, they still make none for a row that holds no
    stored token, nor for a view, and the norm and mean columns read none."""
    session = gpt2._functions._session
    gpt2.sql("SELECT norm, vec FROM acts LIMIT 1").fetchall()
    n_rows = gpt2.sql("SELECT n_rows FROM models").fetchall()[0][0]
    n_streams = len(gpt2.source.codec.streams)  # the first stream number past the store's
    for fn in (f"_actdb_handle_{session}", f"_actdb_stored_norm_{session}"):
        for fields, why in ((word(n_rows, 0), f"row {n_rows} holds no stored token"),
                            (word(0, 0, view=2), "names no raw vector"),
                            (word(0, 5000), "names no raw vector"),
                            (word(0, n_streams), "names no raw vector"),
                            (word(0, 0) ^ (1 << 61), "names no raw vector")):
            with pytest.raises(Exception, match=why):
                gpt2.con.sql(f"SELECT {fn}({fields}::BIGINT)").fetchall()
    made = gpt2.con.sql(f"SELECT _actdb_handle_{session}({word(2, 0)}::BIGINT)").fetchall()
    assert gpt2.source.codec.decode(gpt2.source.codec.open(
        H.from_ints([int(made[0][0])]))).row.tolist() == [2]


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


def test_the_copied_store_keeps_its_handles_apart(family_store: Callable[[str], Path],
                                                  tmp_path: Path) -> None:
    """A byte-for-byte copy of a store (the same models, names and times) opened beside it:
    each connection's handles open only there."""
    copy = tmp_path / "copy.actdb"
    shutil.copytree(family_store("gpt2"), copy)
    pick = "SELECT vec FROM acts WHERE prompt_id = 0 AND position = 0 LIMIT 1"
    with actdb.connect(family_store("gpt2"), device="cpu") as a, \
            actdb.connect(copy, device="cpu") as b:
        (h,), = a.sql(pick).fetchall()
        with pytest.raises(QueryError, match=CHANGED):
            b.sql("SELECT vec_norm($h)", params={"h": h}).fetchall()


def test_the_model_of_a_range_of_streams_is_asked_of_that_range():
    """Codec.model_ids keeps its answers: each range of streams gets its own, found from the
    streams themselves, before and after weight streams are added (whose rows are no acts)."""
    streams = [Stream(model_id=m, site_id=s, head=-1, n_rows=10) for m in (0, 1) for s in (0, 1)]
    codec = Codec(streams, key=KEY)

    def want(lo: int, hi: int) -> int | None:
        if not 0 <= lo < hi <= len(codec.streams):
            return None
        kinds = {(s.model_id, s.kind) for s in codec.streams[lo:hi]}
        return next(iter(kinds))[0] if len(kinds) == 1 and ("acts" in {k for _, k in kinds}) \
            else None

    ranges = [(0, 2), (0, 3), (0, 1), (1, 2), (1, 4), (2, 4), (2, 3), (0, 4), (3, 5), (2, 2)]
    for lo, hi in ranges + ranges:  # asked again: the kept answer
        assert codec.model_ids(lo, hi) == want(lo, hi), (lo, hi)
    codec.extend([Stream(model_id=1, site_id=-1, head=-1, n_rows=3, kind="weights",
                         array="w")])
    for lo, hi in ranges + [(2, 5), (4, 5)]:
        assert codec.model_ids(lo, hi) == want(lo, hi), (lo, hi)
