"""Integrity of a store on disk: a corruption matrix (each kind of damage to each kind of
file is found by `verify --full`, by `verify` where it is structural, and by a query touching
it, as one sentence), format-1 stores still open, and store creation's own errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest
from click.testing import CliRunner
from support.snapshots import snapshot

import actdb
from actdb.cli import cli
from actdb.errors import StoreCorruptError, StoreNotFoundError
from actdb.store.store import Store

SITE = "final"  # a LayerNorm site: direction, norm, mean, gain and bias all matter
TOUCH_SITE = f"SELECT sum(list_sum(to_list(normed(vec)))) FROM acts WHERE site = '{SITE}'"
TOUCH_EMBED = f"SELECT sum(cosine_to_anchor(vec, 1, 'embed')) FROM acts WHERE site = '{SITE}'"
TOUCH_CATALOG = "SELECT count(*) FROM tokens"

# kind of file -> (path inside the store, a query that reads it)
FILES = {
    # a local store's vectors: chunk keys with the separator "." (weights: zarr's default "/")
    "direction chunk": (f"tensors.zarr/models/0/acts/{SITE}/direction/c.0.0", TOUCH_SITE),
    "norm chunk": (f"tensors.zarr/models/0/acts/{SITE}/norm/c.0", TOUCH_SITE),
    "mean chunk": (f"tensors.zarr/models/0/acts/{SITE}/mean/c.0", TOUCH_SITE),
    "weight chunk": ("tensors.zarr/models/0/embed/c/0/0", TOUCH_EMBED),
    "site gain": (f"tensors.zarr/models/0/sites/{SITE}/gain/c/0", TOUCH_SITE),
    "array metadata": (f"tensors.zarr/models/0/acts/{SITE}/direction/zarr.json", TOUCH_SITE),
    "catalog": ("catalog.duckdb", TOUCH_CATALOG),
}
# Damage the quick (structural) verify must see too; a flipped byte inside a chunk is the
# full check's job.
STRUCTURAL = {"truncate", "delete"}


def _damage(path: Path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # never valid UTF-8 in JSON; a changed value in a chunk
        path.write_bytes(bytes(data))
    elif how == "truncate":
        os.truncate(path, len(path.read_bytes()) - 3)
    elif how == "delete" and path.name == "0" and "gain" in path.parts:
        shutil.rmtree(path.parents[1])  # the whole gain array: has_gain says it must exist
    else:
        path.unlink()


@pytest.fixture(scope="module")
def reference_answers(family_store: Callable[[str], Path]) -> dict[str, object]:
    with actdb.connect(family_store("gpt2")) as db:
        assert db.verify(full=True) == []
        return {q: db.sql(q).fetchall() for q in {q for _, q in FILES.values()}}


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("kind", list(FILES))
def test_damage_is_found_and_never_a_number(
    family_store: Callable[[str], Path], tmp_path: Path, reference_answers: dict[str, object],
    kind: str, how: str,
) -> None:
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    rel, query = FILES[kind]
    _damage(store / rel, how)
    if kind == "catalog" or (kind == "array metadata" and how != "truncate"):
        structural = True
    else:
        structural = how in STRUCTURAL

    # The Python API: verify --full lists it; the query raises, never answers.
    try:
        with actdb.connect(store) as db:
            assert db.verify(full=True), f"verify --full missed {how} of {kind}"
            if structural:
                assert db.verify(), f"verify missed {how} of {kind}"
            with pytest.raises(StoreCorruptError):
                answer = db.sql(query).fetchall()
                raise AssertionError(f"{how} of {kind} gave {answer}, reference "
                                     f"{reference_answers[query]}")
    except StoreCorruptError:
        assert kind in ("catalog",), f"{how} of {kind} should not stop the store opening"
    except actdb.StoreFormatError:
        assert kind == "catalog" and how == "delete"

    # The CLI: one sentence, exit 1, for the query and for verify --full.
    for args in (["query", str(store), query], ["verify", str(store), "--full"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1, (args, result.output)
        assert "Traceback" not in result.output
        if args[0] == "query":
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_flipped_byte_in_a_chunk_names_array_and_chunk(
    family_store: Callable[[str], Path], tmp_path: Path
) -> None:
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    _damage(store / FILES["direction chunk"][0], "flip")
    with actdb.connect(store) as db, pytest.raises(
        StoreCorruptError,
        match=rf"chunk 0 of array 'models/0/acts/{SITE}/direction' fails its checksum",
    ):
        db.sql(TOUCH_SITE).fetchall()


def _to_format_1(store: Path) -> None:
    """Rewrite a store as format 1 wrote it: the same layout without chunk checksums."""
    for meta in (store / "tensors.zarr").rglob("zarr.json"):
        doc = json.loads(meta.read_text())
        if doc.get("node_type") == "array":
            doc["codecs"] = [c for c in doc["codecs"] if c["name"] != "crc32c"]
            chunks = [*(meta.parent / "c").rglob("*"), *meta.parent.glob("c.*")]
            for chunk in chunks:
                if chunk.is_file():
                    chunk.write_bytes(chunk.read_bytes()[:-4])
        if meta.parent.name == "tensors.zarr":
            doc["attributes"]["actdb_format_version"] = 1
        meta.write_text(json.dumps(doc))
    con = duckdb.connect(str(store / "catalog.duckdb"))
    con.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    con.close()


def test_format_1_store_opens_reads_the_same_and_says_it_has_no_checksums(
    family_store: Callable[[str], Path], tmp_path: Path, reference_answers: dict[str, object],
) -> None:
    store = tmp_path / "v1.actdb"
    shutil.copytree(family_store("gpt2"), store)
    _to_format_1(store)
    with actdb.connect(store) as db:
        assert db.info().format_version == 1 and not db.store.has_checksums
        for query, expected in reference_answers.items():
            assert db.sql(query).fetchall() == expected
        assert db.verify(full=True) == []
    ok = CliRunner().invoke(cli, ["verify", str(store), "--full"])
    assert ok.exit_code == 0 and "carry no checksums" in ok.output
    # Without checksums, missing and short chunks are still errors.
    os.truncate(store / FILES["norm chunk"][0], 5)
    with actdb.connect(store) as db:
        assert db.verify()
        with pytest.raises(StoreCorruptError, match="has 5 bytes"):
            db.sql(TOUCH_SITE).fetchall()


def _to_folder_per_chunk(store: Path) -> int:
    """Rewrite a local store's vectors with the chunk keys stores had before 2026-11-27:
    separator "/", each chunk file in a folder of its own (`c/{i}/0`). Returns the files moved."""
    moved = 0
    for meta in (store / "tensors.zarr" / "models").rglob("acts/*/*/zarr.json"):
        doc = json.loads(meta.read_text())
        doc["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
        meta.write_text(json.dumps(doc))
        for chunk in meta.parent.glob("c.*"):
            target = meta.parent / "c" / "/".join(chunk.name.split(".")[1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            chunk.rename(target)
            moved += 1
    return moved


def test_a_store_with_a_folder_per_chunk_reads_the_same_and_takes_more_prompts(
    family_store: Callable[[str], Path], tmp_path: Path, reference_answers: dict[str, object],
    model_dir: Callable[[str], Path],
) -> None:
    """Stores written before the separator "." keep theirs: read, verified and appended to
    (the new rows' chunks in folders of their own, as their metadata says)."""
    store = tmp_path / "old.actdb"
    shutil.copytree(family_store("gpt2"), store)
    assert _to_folder_per_chunk(store) > 0
    with actdb.connect(store) as db:
        for query, expected in reference_answers.items():
            assert db.sql(query).fetchall() == expected
        assert db.verify(full=True) == []
        before = db.sql(TOUCH_SITE).fetchall()
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=["one more prompt, appended"],
                 device="cpu", name="gpt2")
    acts = store / "tensors.zarr" / "models" / "0" / "acts" / SITE / "direction"
    assert not list(acts.glob("c.*")) and list((acts / "c").rglob("*"))
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
        n = db.sql("SELECT count(*) FROM prompts").fetchall()[0][0]
        assert db.sql(f"{TOUCH_SITE} AND prompt_id < {n - 1}").fetchall() == before


def test_plain_zarr_checks_the_checksums_too(
    family_store: Callable[[str], Path], tmp_path: Path
) -> None:
    import zarr

    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    arr = group[f"models/0/acts/{SITE}/norm"]
    assert np.isfinite(np.asarray(arr[:8])).all()
    _damage(store / FILES["norm chunk"][0], "flip")
    with pytest.raises(ValueError, match="checksum"):
        np.asarray(group[f"models/0/acts/{SITE}/norm"][:8])


def test_store_whose_parent_is_missing_gets_its_own_sentence(
    tmp_path: Path, model_dir: Callable[[str], Path]
) -> None:
    target = tmp_path / "no" / "such" / "s.actdb"
    with pytest.raises(StoreNotFoundError, match="its parent folder .* does not exist"):
        Store.open_or_create(target)
    result = CliRunner().invoke(cli, ["ingest", str(target), "--model", str(model_dir("gpt2")),
                                      "--prompts", "-", "--device", "cpu"], input="hello\n")
    assert result.exit_code == 1 and "does not exist" in result.stderr
    assert "not writable" not in result.stderr


def test_second_ingest_into_a_store_being_ingested_is_one_sentence(tmp_path: Path) -> None:
    store = tmp_path / "s.actdb"
    with Store.open_or_create(store):
        with pytest.raises(actdb.StoreBusyError, match=rf"another ingest \(PID {os.getpid()}\)"):
            Store.open_or_create(store)
        # Readers are not turned away while it runs.
        with actdb.connect(store) as db:
            assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(0,)]
    with Store.open_or_create(store):  # released on close
        pass


def test_reader_next_to_a_writer_in_one_process_is_told_to_close_it(tmp_path: Path) -> None:
    """DuckDB refuses a second handle on a file this process holds for writing: that is a
    busy store to close, never "the store is damaged"."""
    store = tmp_path / "s.actdb"
    Store.open_or_create(store).close()
    with actdb.connect(store, read_only=False):
        with pytest.raises(actdb.StoreBusyError, match="by this same process"):
            actdb.connect(store)
    with actdb.connect(store) as db:  # and fine once closed
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(0,)]


@pytest.mark.slow
def test_two_ingests_racing_to_create_one_store(
    tmp_path: Path, model_dir: Callable[[str], Path]
) -> None:
    """Both start at once: one creates the store; the other either waits its turn or is
    told in one sentence that the store is being written; the store ends whole."""
    store = tmp_path / "s.actdb"
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"racing prompt {i}\n" for i in range(6)))
    argv = [sys.executable, "-m", "actdb.cli", "ingest", str(store), "--model",
            str(model_dir("gpt2")), "--prompts", str(prompts), "--device", "cpu", "--name", "m"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    assert sorted(code for code, _ in results) in ([0, 0], [0, 1]), results
    for code, err in results:
        if code == 1:
            errors = [line for line in err.splitlines() if line.startswith("Error:")]
            assert len(errors) == 1 and "being written by another ingest" in errors[0], err
            assert "Traceback" not in err
    assert not list(tmp_path.glob(".s.actdb.creating-*"))
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
        assert db.sql("SELECT count(*) FROM prompt_runs").fetchall() == [(6,)]
    assert len(snapshot(store, "m")["prompts"]) == 6  # type: ignore[arg-type]


# Metadata files verify reads: every group's and array's `zarr.json`, the saved tokenizer.
METADATA = {
    "root group": "tensors.zarr/zarr.json",
    "models group": "tensors.zarr/models/zarr.json",
    "model group": "tensors.zarr/models/0/zarr.json",
    "acts group": "tensors.zarr/models/0/acts/zarr.json",
    "site group": f"tensors.zarr/models/0/acts/{SITE}/zarr.json",
    "norm array": f"tensors.zarr/models/0/acts/{SITE}/norm/zarr.json",
    "weights group": "tensors.zarr/models/0/sites/zarr.json",
    "site weights group": f"tensors.zarr/models/0/sites/{SITE}/zarr.json",
    "gain array": f"tensors.zarr/models/0/sites/{SITE}/gain/zarr.json",
    "embed array": "tensors.zarr/models/0/embed/zarr.json",
    "tokenizer": "tokenizers/0/tokenizer.json",
    "tokenizer config": "tokenizers/0/tokenizer_config.json",
}


@pytest.mark.parametrize("how", ["delete", "garbage"])
@pytest.mark.parametrize("kind", list(METADATA))
def test_damaged_metadata_is_found_by_verify_in_one_sentence(
    family_store: Callable[[str], Path], tmp_path: Path, kind: str, how: str
) -> None:
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    path = store / METADATA[kind]
    if how == "delete":
        path.unlink()
    else:
        path.write_bytes(b'{"zarr_format": 3, "node_type": ')  # cut short, as a torn write
    # Deleting tokenizer.json leaves a folder whose files all parse: loading it (--full) tells.
    quick_sees = not (kind == "tokenizer" and how == "delete")
    for args in (["verify", str(store), "--full"], ["verify", str(store)]):
        result = CliRunner().invoke(cli, args)
        if args[-1] != "--full" and not quick_sees:
            continue
        assert result.exit_code == 1, (args, result.output)
        assert "Traceback" not in result.output, result.output
        problems = [line for line in result.stderr.splitlines() if line.startswith("problem:")]
        if not problems:  # the store does not open: that one sentence
            problems = result.stderr.strip().splitlines()
            assert len(problems) == 1, result.stderr
        assert problems and all(p.endswith("the store is damaged") for p in problems), problems
        label = str(Path(METADATA[kind]).parent.relative_to("tensors.zarr")) if METADATA[
            kind].startswith("tensors.zarr") else "tokenizer"
        named = {".": "'/'"}.get(label, label if label == "tokenizer" else f"'{label}'")
        assert any(named in p or (label == "." and "root metadata" in p) for p in problems), (
            named, problems)


def test_a_selective_querys_damaged_chunk_is_named_on_every_read_and_only_where_needed(
    family_store: Callable[[str], Path], tmp_path: Path
) -> None:
    """A selective query's one-chunk group: its first read (a reused buffer, not kept) and
    its second (kept) both name the damaged chunk; a query whose rows lie elsewhere answers."""
    store = tmp_path / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    _damage(store / FILES["direction chunk"][0], "flip")
    one = (f"SELECT cosine_to_anchor(vec, 1, 'embed') FROM acts WHERE site = '{SITE}' AND "
           "prompt_id = {p} AND position = 0")
    with actdb.connect(store) as db:
        c = db.sql("SELECT chunk_tokens FROM models").fetchall()[0][0]
        elsewhere = db.sql("SELECT min(prompt_id) FROM tokens WHERE position = 0 AND row >= $c",
                           params={"c": c}).fetchall()[0][0]
        for _ in range(2):
            with pytest.raises(StoreCorruptError, match=rf"chunk 0 of array "
                               rf"'models/0/acts/{SITE}/direction' fails its checksum"):
                db.sql(one.format(p=0)).fetchall()
        assert db.sql(one.format(p=elsewhere)).fetchall()[0][0] is not None
