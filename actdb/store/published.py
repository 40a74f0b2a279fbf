"""The catalog on object storage: immutable catalog objects and a pointer swapped per commit.

DuckDB cannot open a database on S3 offline (no httpfs), so the catalog lives as objects:
`catalogs/{seq:012d}-{random}.duckdb` (each a whole DuckDB file, never changed once written)
and the pointer `catalog.json` naming the current one. An ingest works on a local copy and,
after each commit, publishes it: upload a new catalog object, then replace the pointer with
a write conditional on the pointer's ETag as this writer last saw it, so that of two writers
only one can ever advance it. Readers read the pointer, then the object it names.

When the writer closes, its last catalog is published once more, compacted (DuckDB's
`COPY FROM DATABASE` into a fresh file: a file checkpointed at every commit keeps the blocks
its checkpoints freed), and the catalog objects before it are deleted, so a finished store
holds one catalog object about the size of a local store's catalog file.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import duckdb

from ..errors import StoreBusyError, StoreCorruptError, StoreFormatError
from .faults import fault
from .objects import AlreadyExistsError, Objects, PreconditionError, not_found

POINTER_KEY = "catalog.json"
CATALOGS = "catalogs"
_READ_TRIES = 8  # a reader racing two publications may find its catalog object deleted


def _catalog_key(seq: int) -> str:
    return f"{CATALOGS}/{seq:012d}-{uuid.uuid4().hex[:8]}.duckdb"


def read_pointer(objects: Objects) -> tuple[dict[str, Any], str | None]:
    """The pointer and its ETag; StoreNotFoundError when there is no store."""
    try:
        data, etag = objects.get(POINTER_KEY)
    except FileNotFoundError:
        raise not_found(objects.url) from None
    try:
        pointer = json.loads(data)
        if not isinstance(pointer, dict) or not isinstance(pointer.get("catalog"), str):
            raise ValueError("no catalog named")
    except ValueError as e:
        raise StoreCorruptError(
            f"the catalog pointer {objects.where(POINTER_KEY)!r} cannot be read ({e}): "
            "the store is damaged"
        ) from None
    return pointer, etag


def download(objects: Objects, dest: Path) -> tuple[dict[str, Any], str | None]:
    """The current catalog into the local file `dest`; returns the pointer and its ETag."""
    for _ in range(_READ_TRIES):
        pointer, etag = read_pointer(objects)
        try:
            data, _ = objects.get(pointer["catalog"])
        except FileNotFoundError:
            continue  # superseded and removed between our two reads: read the pointer again
        dest.write_bytes(data)
        return pointer, etag
    raise StoreCorruptError(
        f"the catalog object named by {objects.where(POINTER_KEY)!r} is missing: "
        "the store is damaged"
    )


def create(objects: Objects, local: Path, version: int) -> bool:
    """Publish the first catalog of a new store; False when another creator won."""
    key = _catalog_key(0)
    objects.put(key, local.read_bytes(), if_absent=True)
    pointer = {"format": "actdb", "format_version": version, "catalog": key, "seq": 0}
    try:
        objects.put(POINTER_KEY, json.dumps(pointer).encode(), if_absent=True)
    except AlreadyExistsError:
        objects.delete(key)
        return False
    return True


class Publisher:
    """Publishes one writer's working copy after each commit, conditionally."""

    def __init__(self, objects: Objects, local: Path, location: str) -> None:
        self.objects = objects
        self.local = local
        self.location = location
        self.pointer, self.etag = download(objects, local)
        self._previous: str | None = None
        self._published = False  # this writer advanced the pointer at least once
        self._pending = False  # the working copy may differ from the catalog last published
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Catalog objects no pointer names: uploads of killed writers' last publications.
        Called only under the lease, by the one writer."""
        current = self.pointer["catalog"]
        for key, _ in self.objects.list(CATALOGS):
            if key != current:
                self.objects.delete(key)

    def publish(self) -> None:
        self._pending = True
        self._publish(self.local)
        self._pending = False

    def finish(self) -> None:
        """The last catalog this writer published, again, compacted, and the objects before
        it deleted; nothing when this writer published nothing, or when its working copy
        holds a commit it could not publish."""
        if not self._published or self._pending:
            return
        compacted = self.local.with_name(self.local.name + ".compacted")
        compacted.unlink(missing_ok=True)
        try:
            if not compact(self.local, compacted):
                return
            self._publish(compacted)
        finally:
            compacted.unlink(missing_ok=True)
        if self._previous is not None:
            self.objects.delete(self._previous)  # readers of it read the pointer again
            self._previous = None

    def _publish(self, source: Path) -> None:
        seq = int(self.pointer.get("seq", 0)) + 1
        key = _catalog_key(seq)
        self.objects.put(key, source.read_bytes(), if_absent=True)
        fault("catalog_uploaded")
        pointer = {**self.pointer, "catalog": key, "seq": seq}
        try:
            etag = self.objects.put(POINTER_KEY, json.dumps(pointer).encode(),
                                    if_match=self.etag)
        except PreconditionError:
            self.objects.delete(key)
            raise StoreBusyError(
                f"store {self.location!r} was changed by another writer while this ingest ran "
                "(its catalog pointer moved); this ingest's last batch was not published: "
                "run it again to resume"
            ) from None
        # Keep the catalog just replaced for readers that read the old pointer a moment ago;
        # the one before it has had a whole commit's time to be read.
        if self._previous is not None:
            self.objects.delete(self._previous)
        self._previous = self.pointer["catalog"]
        self.pointer, self.etag = pointer, etag
        self._published = True


_SCHEMA = ("SELECT table_name, column_name, ordinal_position, data_type, column_default, "
           "is_nullable FROM information_schema.columns WHERE table_catalog = $db ORDER BY ALL")


def compact(source: Path, dest: Path) -> bool:
    """A copy of the DuckDB file `source` in the fresh file `dest`, holding only live blocks;
    False (and no `dest`) where the copy does not have the same tables, columns and row
    counts."""
    con = duckdb.connect(str(dest), config={"threads": 1})
    try:
        here = str((con.execute("SELECT current_database()").fetchone() or ("",))[0])
        path = str(source).replace("'", "''")  # a SQL string: TMPDIR may hold a quote
        con.execute(f"ATTACH '{path}' AS src (READ_ONLY)")
        con.execute(f"COPY FROM DATABASE src TO {_quoted(here)}")
        tables = [str(r[0]) for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = 'src'").fetchall()]

        def shape(db: str) -> list[Any]:
            counts = [con.execute(f"SELECT count(*) FROM {_quoted(db)}.main.{_quoted(t)}"
                                  ).fetchone() for t in tables]
            return [con.execute(_SCHEMA, {"db": db}).fetchall(), counts]

        same = shape("src") == shape(here)
        con.execute("DETACH src")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    if not same:
        dest.unlink(missing_ok=True)
    return same


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def check_version(pointer: dict[str, Any], location: str, newest: int) -> None:
    version = pointer.get("format_version")
    if isinstance(version, int) and version > newest:
        raise StoreFormatError(
            f"store {location!r} was written by format version {version}; this actdb reads "
            f"versions up to {newest}: upgrade actdb"
        )
