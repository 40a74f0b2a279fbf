"""Checksums bound to their place (format 5): every chunk's digest is recorded in the catalog
under (model, array path, chunk index), so a valid chunk moved, copied over another, swapped or
duplicated is damage naming both places, in `verify --full` and in any query reading it.
Digests are checked against an independent CRC-32C of the chunk files' bytes (the `crc32c`
package over the committed rows), and older stores are upgraded to the same digests."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import crc32c
import duckdb
import numpy as np
import pytest
from click.testing import CliRunner

import actdb
from actdb.cli import cli
from actdb.errors import StoreCorruptError

A, B = "blocks.0.ln1", "final"  # two LayerNorm sites of the tiny gpt2: gains and biases


def _site_query(site: str) -> str:
    return f"SELECT sum(list_sum(to_list(normed(vec)))) FROM acts WHERE site = '{site}'"


def _acts(site: str, field: str, chunk: int) -> tuple[str, int, str]:
    tail = ".0" if field == "direction" else ""
    return (f"tensors.zarr/models/0/acts/{site}/{field}/c.{chunk}{tail}", chunk,
            f"models/0/acts/{site}/{field}")


def _weight(name: str, two_d: bool) -> tuple[str, int, str]:
    return (f"tensors.zarr/models/0/{name}/c/0" + ("/0" if two_d else ""), 0,
            f"models/0/{name}")


# case -> (family, operation, place X, place Y, query): `swap` exchanges X and Y, `copy` puts
# a copy of Y's chunk at X (a duplicate), `move` renames Y's chunk over X (Y is then missing).
CASES = {
    "direction swapped within an array": (
        "gpt2", "swap", _acts(A, "direction", 0), _acts(A, "direction", 1), _site_query(A)),
    "direction duplicated within an array": (
        "gpt2", "copy", _acts(A, "direction", 3), _acts(A, "direction", 2), _site_query(A)),
    "direction copied from another site": (
        "gpt2", "copy", _acts(B, "direction", 2), _acts(A, "direction", 2), _site_query(B)),
    "direction moved from another site": (
        "gpt2", "move", _acts(B, "direction", 1), _acts(A, "direction", 1), _site_query(B)),
    "norm swapped between sites": (
        "gpt2", "swap", _acts(A, "norm", 0), _acts(B, "norm", 0), _site_query(A)),
    "norm moved from another site": (
        "gpt2", "move", _acts(B, "norm", 0), _acts(A, "norm", 0), _site_query(B)),
    "mean copied from another site": (
        "gpt2", "copy", _acts(B, "mean", 0), _acts(A, "mean", 0), _site_query(B)),
    "mean swapped between sites": (
        "gpt2", "swap", _acts(B, "mean", 0), _acts(A, "mean", 0), _site_query(B)),
    "gain and bias of a site swapped": (
        "gpt2", "swap", _weight(f"sites/{B}/gain", False), _weight(f"sites/{B}/bias", False),
        _site_query(B)),
    "bias copied from another site": (
        "gpt2", "copy", _weight(f"sites/{B}/bias", False), _weight(f"sites/{A}/bias", False),
        _site_query(B)),
    "gain moved from another site": (
        "gpt2", "move", _weight(f"sites/{B}/gain", False), _weight(f"sites/{A}/gain", False),
        _site_query(B)),
    "embedding and LM head swapped": (
        "llama", "swap", _weight("embed", True), _weight("lm_head", True),
        "SELECT sum(cosine_to_anchor(vec, 1, 'embed')) FROM acts WHERE site = 'final'"),
    "LM head copied from the embedding": (
        "llama", "copy", _weight("lm_head", True), _weight("embed", True),
        "SELECT sum(cosine_to_anchor(vec, 1)) FROM acts WHERE site = 'final'"),
}


def _apply(store: Path, how: str, x: str, y: str) -> None:
    px, py = store / x, store / y
    assert px.read_bytes() != py.read_bytes(), "a case must move different bytes"
    if how == "swap":
        tmp = px.with_name(px.name + ".swap")
        os.replace(px, tmp)
        os.replace(py, px)
        os.replace(tmp, py)
    elif how == "copy":
        shutil.copyfile(py, px)
    else:
        os.replace(py, px)


def _names_both(text: str, here: tuple[str, int, str], there: tuple[str, int, str]) -> bool:
    return (f"chunk {here[1]} of array '{here[2]}' holds the bytes of chunk {there[1]} of "
            f"array '{there[2]}'") in text


@pytest.mark.parametrize("case", list(CASES))
def test_a_valid_chunk_in_the_wrong_place_is_damage_naming_both_places(
    family_store: Callable[[str], Path], tmp_path: Path, case: str
) -> None:
    family, how, x, y, query = CASES[case]
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store(family), store)
    _apply(store, how, x[0], y[0])
    with actdb.connect(store) as db:
        problems = db.verify(full=True)
        assert any(_names_both(p, x, y) for p in problems), problems
        if how == "swap":
            assert any(_names_both(p, y, x) for p in problems), problems
        if how == "move":  # the place the chunk left is missing
            assert any(f"chunk {y[1]} of array '{y[2]}' is missing" in p for p in problems)
        with pytest.raises(StoreCorruptError) as e:
            db.sql(query).fetchall()
        assert _names_both(str(e.value), x, y) or (
            how != "copy" and _names_both(str(e.value), y, x)) or (
            how == "move" and "is missing" in str(e.value)), str(e.value)
    result = CliRunner().invoke(cli, ["verify", str(store), "--full"])
    assert result.exit_code == 1 and _names_both(result.output, x, y), result.output
    assert "Traceback" not in result.output


def test_a_query_names_both_places_of_a_chunk_from_another_site(
    family_store: Callable[[str], Path], tmp_path: Path
) -> None:
    """Through the query's own run reader (the C reader's stored CRCs compared with the
    digests), and through the CLI as one sentence."""
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    x, y = _acts(B, "direction", 1), _acts(A, "direction", 1)
    _apply(store, "copy", x[0], y[0])
    with actdb.connect(store) as db, pytest.raises(StoreCorruptError) as e:
        db.sql(_site_query(B)).fetchall()
    assert _names_both(str(e.value), x, y)
    assert str(store / x[0]) in str(e.value)  # the file itself is named too
    # A run of full chunks alone (a scan's runs of a large store): their own CRCs compared
    # with their digests at once.
    with actdb.connect(store) as db:
        arrays = db.store.arrays
        assert db.store.catalog.models()[0].n_rows > 4 * 8  # chunks 0-3 are full
        assert arrays.read_chunks(0, B, "direction", 2, 2).shape[0] == 16
        with pytest.raises(StoreCorruptError) as e:
            arrays.read_chunks(0, B, "direction", 0, 4)
    assert _names_both(str(e.value), x, y)
    result = CliRunner().invoke(cli, ["query", str(store), _site_query(B)])
    assert result.exit_code == 1 and _names_both(result.stderr, x, y)
    assert len(result.stderr.strip().splitlines()) == 1


def _recorded(store: Path) -> dict[tuple[str, str, int], tuple[int, int]]:
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    try:
        return {(m, p, int(c)): (int(r), int(crc)) for m, p, c, r, crc in con.execute(
            'SELECT model, path, chunk, "rows", crc FROM chunk_digests').fetchall()}
    finally:
        con.close()


def _chunk_file(store: Path, model_id: int, path: str, chunk: int) -> Path:
    folder = store / "tensors.zarr" / "models" / str(model_id) / path
    meta = json.loads((folder / "zarr.json").read_text())
    ndim = len(meta["shape"])
    sep = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    key = sep.join(["c", str(chunk), *["0"] * (ndim - 1)])
    return folder / key


def test_every_committed_chunk_has_the_digest_of_its_bytes(
    family_store: Callable[[str], Path]
) -> None:
    """The digests an ingest recorded, against the chunk files read with plain Python: each
    is the CRC-32C of the chunk's committed rows (all of them but in the last chunk of an
    array), and every chunk holding committed rows, and every weight chunk, has one."""
    store = family_store("gpt2")
    digests = _recorded(store)
    with actdb.connect(store) as db:
        m = db.store.catalog.models()[0]
        sites = db.store.catalog.sites(m.model)
    expected = set()
    for s in sites:
        for field, factor in (("direction", 1), ("norm", 32), ("mean", 32)):
            c = m.chunk_tokens * factor
            for chunk in range(-(-m.n_rows // c)):
                expected.add((m.model, f"acts/{s.site}/{field}", chunk))
                rows, crc = digests[(m.model, f"acts/{s.site}/{field}", chunk)]
                assert rows == min(c, m.n_rows - chunk * c)
                data = _chunk_file(store, 0, f"acts/{s.site}/{field}", chunk).read_bytes()
                row_bytes = (len(data) - 4) // c
                assert crc32c.crc32c(data[: rows * row_bytes]) == crc
        for name in ("gain", "bias"):
            expected.add((m.model, f"sites/{s.site}/{name}", 0))
            rows, crc = digests[(m.model, f"sites/{s.site}/{name}", 0)]
            data = _chunk_file(store, 0, f"sites/{s.site}/{name}", 0).read_bytes()
            assert rows == s.d and crc32c.crc32c(data[:-4]) == crc
    expected.add((m.model, "embed", 0))
    # the layer weights (neurons, heads, circuits), each array chunked along its rows
    from actdb.store.layer_weights import manifest_arrays, read_manifest

    with actdb.connect(store) as db:
        names = manifest_arrays(read_manifest(db.store.arrays, 0) or {})
    assert names
    for name in names:
        meta = json.loads((store / "tensors.zarr/models/0" / name / "zarr.json").read_text())
        n, c = meta["shape"][0], meta["chunk_grid"]["configuration"]["chunk_shape"][0]
        for chunk in range(-(-n // c)):
            expected.add((m.model, name, chunk))
            rows, crc = digests[(m.model, name, chunk)]
            data = _chunk_file(store, 0, name, chunk).read_bytes()
            row_bytes = (len(data) - 4) // c
            assert rows == min(c, n - chunk * c)
            assert crc32c.crc32c(data[: rows * row_bytes]) == crc
    assert set(digests) == expected


def _to_format(store: Path, version: int) -> None:
    """Rewrite a store as an older actdb left it: no chunk digests, an older version."""
    con = duckdb.connect(str(store / "catalog.duckdb"))
    con.execute("DROP TABLE chunk_digests")
    con.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", [str(version)])
    con.close()
    root = store / "tensors.zarr" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["actdb_format_version"] = version
    root.write_text(json.dumps(doc))


def test_a_format_2_store_is_read_as_it_is_and_upgraded_by_a_writer(
    family_store: Callable[[str], Path], tmp_path: Path
) -> None:
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    before = _recorded(store)
    _to_format(store, 2)
    x, y = _acts(A, "direction", 0), _acts(A, "direction", 1)
    with actdb.connect(store) as db:
        assert db.info().format_version == 2 and not db.store.has_digests
        reference = db.sql(_site_query(A)).fetchall()
        # the weaker guarantee of an older store: a chunk's own checksum alone
        _apply(store, "swap", x[0], y[0])
        assert db.verify(full=True) == []
        _apply(store, "swap", x[0], y[0])
    # A writer upgrades it: the digests read back from the chunks are those the ingest
    # recorded, and the store is format 5 in its catalog and its Zarr root.
    with actdb.connect(store, read_only=False) as db:
        assert db.info().format_version == 5
    assert _recorded(store) == before
    root = json.loads((store / "tensors.zarr" / "zarr.json").read_text())
    assert root["attributes"]["actdb_format_version"] == 5
    with actdb.connect(store) as db:
        assert db.sql(_site_query(A)).fetchall() == reference
        assert db.verify(full=True) == []
    _apply(store, "swap", x[0], y[0])
    with actdb.connect(store) as db:
        assert any(_names_both(p, x, y) for p in db.verify(full=True))


def test_digests_follow_a_resumed_ingest_into_a_partly_filled_chunk(
    model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Prompts added one ingest at a time patch the last, partly filled chunk of every array:
    its digest grows with its committed rows, and the store verifies after each."""
    from support.prompts import PROMPTS

    store = tmp_path / "s.actdb"
    for i in range(3):
        actdb.ingest(store, model=str(model_dir("gpt2")), prompts=PROMPTS[: 2 + i],
                     device="cpu", name="gpt2", chunk_tokens=8)
        with actdb.connect(store) as db:
            assert db.verify(full=True) == []
    digests = _recorded(store)
    with actdb.connect(store) as db:
        n_rows = db.store.catalog.models()[0].n_rows
    rows, crc = digests[("gpt2", f"acts/{B}/norm", 0)]
    data = _chunk_file(store, 0, f"acts/{B}/norm", 0).read_bytes()
    assert rows == n_rows and crc32c.crc32c(data[: 4 * n_rows]) == crc
    assert np.frombuffer(data[: 4 * n_rows], "<f4").all()  # every committed norm written


def test_the_run_reader_hands_back_each_chunk_files_stored_crc(tmp_path: Path) -> None:
    """`_native.read_chunks` with a `crcs` buffer: each file's stored CRC-32C (the one the
    digests are compared with), whether or not it checks them against the bytes."""
    from actdb import _native

    if _native is None:
        pytest.skip("built without a C compiler")
    n = 4096
    rng = np.random.default_rng(0)
    paths, want = [], []
    for i in range(3):
        data = rng.integers(0, 255, n, dtype=np.uint8).tobytes()
        crc = crc32c.crc32c(data)
        (tmp_path / f"c.{i}").write_bytes(data + crc.to_bytes(4, "little"))
        paths.append(os.fsencode(tmp_path / f"c.{i}"))
        want.append(crc)
    for check in (True, False):
        buf = np.empty(3 * n, np.uint8)
        crcs = np.zeros(3, np.uint32)
        assert _native.read_chunks(paths, buf, n, True, check, crcs) == [n + 4] * 3
        assert crcs.tolist() == want
    with pytest.raises(ValueError, match="4 bytes a chunk"):
        _native.read_chunks(paths, np.empty(3 * n, np.uint8), n, True, True,
                            np.zeros(2, np.uint32))


@pytest.mark.parametrize("reader", ["python", "compiled without crcs"])
def test_without_the_compiled_reader_a_chunk_in_the_wrong_place_is_found_too(
    family_store: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    reader: str
) -> None:
    """The Python run reader, and a compiled one built before it handed CRCs back (the
    digests then checked from the bytes)."""
    from actdb.store import chunks

    if reader == "python":
        monkeypatch.setattr(chunks, "_native", None)
    else:
        monkeypatch.setattr(chunks, "_NATIVE_CRCS", False)
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    x, y = _acts(B, "direction", 2), _acts(A, "direction", 2)
    _apply(store, "copy", x[0], y[0])
    with actdb.connect(store) as db, pytest.raises(StoreCorruptError) as e:
        db.sql(_site_query(B)).fetchall()
    assert _names_both(str(e.value), x, y)


def test_layer_weights_swapped_are_damage_naming_both_places(
    family_store: Callable[[str], Path], tmp_path: Path
) -> None:
    """A block's MLP input and output matrices (same shape, both valid) swapped: verify --full
    names each place and the other."""
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    x, y = _weight("weights/0/mlp/W_in", True), _weight("weights/0/mlp/W_out", True)
    _apply(store, "swap", x[0], y[0])
    with actdb.connect(store) as db:
        problems = db.verify(full=True)
    assert any(_names_both(p, x, y) for p in problems), problems
    assert any(_names_both(p, y, x) for p in problems), problems
