"""The stored vectors: per site, `direction`, `norm` and `mean` arrays chunked along the token
row axis; made and grown as an ingest needs them, written a batch of rows at a time (each chunk
replaced whole, its digest kept until the commit takes it), and read back a chunk or a run of
chunks at a time, checked (chunk_reads.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from . import durable
from .array_group import ArrayGroup, ArrayInfo, Layout
from .chunk_reads import ChunkReader
from .chunks import RawLayout, row_dots
from .digests import WrittenDigests, chunk_digest
from .lens_layout import LENS_FIELDS, lens_shapes
from .object_chunks import ShardedChunks
from .write_sync import WriteSync

if TYPE_CHECKING:
    import zarr
    import zarr.codecs
else:
    from ..lazy import lazy_module

    zarr = lazy_module("zarr")

ACT_FIELDS = ("direction", "norm", "mean")
# Small direction chunks keep selective queries from reading much they do not need (a
# 128-token prompt of a d=768 model is one chunk); chunk files are read raw, so many small
# chunks cost a full scan little. norm and mean are 4 bytes a row: their chunks hold more rows.
_TARGET_CHUNK_BYTES = 256 << 10
SCALAR_CHUNK_FACTOR = 32
# Inner chunks per shard on object storage: a direction shard of 16 chunks of about 256 KiB
# (3 MiB at d = 768; one PUT per shard an ingest batch touches), read back by range one inner
# chunk at a time.
SHARD_CHUNKS = 16


def write_alignment(chunk_tokens: int, *, sharded: bool) -> int:
    """Rows at which one writer's range may start without sharing a file with another's:
    a whole norm/mean chunk (SCALAR_CHUNK_FACTOR direction chunks), or on object storage a
    whole shard object of those."""
    return chunk_tokens * SCALAR_CHUNK_FACTOR * (SHARD_CHUNKS if sharded else 1)


def default_chunk_tokens(width: int) -> int:
    """Token rows per direction chunk: about 256 KiB, a power of two, at least 64."""
    rows = max(_TARGET_CHUNK_BYTES // (2 * max(width, 1)), 64)
    return int(2 ** round(np.log2(rows)))


class ActArrays:
    """The vectors of the models in `group`."""

    def __init__(self, group: ArrayGroup, reader: ChunkReader, durability: WriteSync,
                 written: WrittenDigests) -> None:
        self.group = group
        self.reader = reader
        self.durability = durability
        self.written = written
        # (inner shape, rows, chunk rows, sharded) -> a new site's metadata files (_site_metadata)
        self._site_templates: dict[tuple[object, ...], dict[str, bytes]] = {}

    # -- making and growing ------------------------------------------------------------------

    def ensure_groups(self, model_id: int) -> None:
        """The model's `acts` group, made before sites' arrays are made concurrently."""
        label = f"models/{model_id}/acts"
        path = self.group.path
        if path is None:
            self.group.model_group(model_id).require_group("acts")
            return
        if self.group.exists(label):
            return
        fs = self.durability.file_system_sync()
        # Written whole, not through zarr: zarr would read a file a power cut left empty.
        self.group.put_metadata(label, {"zarr.json": self.group.group_metadata()})
        if fs is not None:  # with the sites' files, by `sync`
            self.durability.mark_unsynced()
        else:
            durable.fsync_file(path / "models" / str(model_id) / "acts" / "zarr.json")
            durable.fsync_dir(path / "models" / str(model_id))

    def ensure_arrays(self, model_id: int, site: str, *, inner: tuple[int, ...], rows: int,
                      chunk_tokens: int, lens: int = 0) -> None:
        """Create the site's arrays or grow them to at least `rows` token rows; `lens`: the K
        of the materialized lens the site carries (0: none; lens_layout.py)."""
        label = f"models/{model_id}/acts/{site}"
        path = self.group.path
        self.group.forget(f"{label}/")
        if not self._site_exists(label, lens):
            # New, or metadata a power cut lost (written, not yet synced, when it came: no
            # row of the site can be committed then): the site's files, whole.
            fs = self.durability.file_system_sync()
            self.group.put_metadata(label, self._site_metadata(inner, rows, chunk_tokens, lens))
            if fs is not None:  # new files: one syncfs for every site's (`sync`)
                self.durability.mark_unsynced()
            elif path is not None:
                durable.sync_tree(path / label, skip="c")
                durable.fsync_dir((path / label).parent)
            return
        g = self.group.model_group(model_id).require_group(f"acts/{site}")
        self.create_arrays(g, inner=inner, rows=rows, chunk_tokens=chunk_tokens, lens=lens)
        if path is not None:
            # the metadata zarr rewrote (grown arrays), not the chunk files beside it: those
            # are already durable, and a shard ingest running beside this one renames its own
            folder = path / "models" / str(model_id) / "acts" / site
            for name in site_fields(lens):
                durable.fsync_file(folder / name / "zarr.json")
                durable.fsync_dir(folder / name)
            durable.fsync_file(folder / "zarr.json")
            durable.fsync_dir(folder)

    def _site_exists(self, label: str, lens: int = 0) -> bool:
        """Whether the site `label` and its arrays exist (on object storage, a PUT is whole:
        the site's group is enough)."""
        if self.group.path is None:
            return self.group.exists(label)
        return all(self.group.exists(f"{label}/{name}") for name in ("", *site_fields(lens)))

    def _site_metadata(self, inner: tuple[int, ...], rows: int, chunk_tokens: int,
                       lens: int = 0) -> dict[str, bytes]:
        """A new site's metadata files (its group's and its three arrays'), by path under the
        site's folder. They hold no name, so sites of one shape share them: zarr builds them
        once per shape, not once per array (each costs a dozen round trips through its event
        loop, on the commit thread beside the first forward passes)."""
        key = (inner, rows, chunk_tokens, self.group.sharded, self.group.objects is None, lens)
        made = self._site_templates.get(key)
        if made is None:  # two threads at once build the same bytes
            staged: dict[str, Any] = {}
            root = zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
            self.create_arrays(root.require_group("site"), inner=inner, rows=rows,
                                chunk_tokens=chunk_tokens, lens=lens)
            made = self._site_templates[key] = {
                k.removeprefix("site/"): v.to_bytes() for k, v in staged.items()
                if k.startswith("site/")}
        return made

    def create_arrays(self, g: zarr.Group, *, inner: tuple[int, ...], rows: int,
                       chunk_tokens: int, lens: int = 0) -> None:
        """In the site's group `g`: each field's array, created, or grown to `rows`. The lens
        arrays are chunked as norm and mean are: a writer's aligned range shares none of
        their files with another's either."""
        specs = {
            "direction": ((*inner,), "float16"),
            "norm": (inner[:-1], "float32"),
            "mean": (inner[:-1], "float32"),
            **(lens_shapes(lens) if lens else {}),
        }
        for name, (tail, dtype) in specs.items():
            if name in g:
                arr = g[name]
                assert isinstance(arr, zarr.Array)
                if arr.shape[0] < rows:
                    arr.resize((rows, *tail))
            else:
                step = chunk_tokens * (1 if name == "direction" else SCALAR_CHUNK_FACTOR)
                shards = (step * SHARD_CHUNKS, *tail) if self.group.sharded else None
                # On a local disk the chunk files lie in the array's folder (`c.{i}.0`), not
                # each in a folder of its own (`c/{i}/0`): a folder made and fsynced per
                # chunk costs an ingest about half of what writing the chunk does. Object
                # storage keeps zarr's default keys.
                separator = "." if self.group.objects is None else "/"
                g.create_array(
                    name, shape=(rows, *tail), dtype=dtype, chunks=(step, *tail), shards=shards,
                    chunk_key_encoding={"name": "default", "separator": separator},
                    compressors=[zarr.codecs.Crc32cCodec()], fill_value=0,
                    config={"write_empty_chunks": True},  # missing is damage, never zeros
                    dimension_names=_dimension_names(name, len(tail)),
                )

    # -- reading -----------------------------------------------------------------------------

    def array(self, model_id: int, site: str, field: str) -> zarr.Array:
        return self.group.zarr_array(f"models/{model_id}/acts/{site}/{field}")

    def info(self, model_id: int, site: str, field: str) -> ArrayInfo:
        info = self.group.info(f"models/{model_id}/acts/{site}/{field}")
        assert info is not None
        return info

    def layout(self, model_id: int, site: str, field: str) -> Layout | None:
        return self.info(model_id, site, field).raw

    def read_chunk(self, model_id: int, site: str, field: str, chunk: int) -> np.ndarray:
        """One whole chunk of a site's field (the rows chunk * C .. chunk * C + C - 1),
        checked: a missing, short, damaged or misplaced chunk is a StoreCorruptError naming
        it.

        Chunks are stored raw (no compression), so where the array is laid out as this
        format writes it, the chunk file is read straight into memory, past zarr-python's
        per-chunk overhead. Anything else goes through zarr."""
        raw = self.layout(model_id, site, field)
        if raw is not None:
            return self.reader.read_raw(raw, chunk)
        return self.reader.read_through_zarr(self.array(model_id, site, field),
                                             f"models/{model_id}/acts/{site}/{field}", chunk)

    def read_chunk_dots(self, model_id: int, site: str, field: str, chunk: int,
                        v: np.ndarray, into: np.ndarray | None = None
                        ) -> tuple[np.ndarray, np.ndarray | None]:
        """`read_chunk`, and the chunk's rows of a float16 field dotted with `v` (float32
        [d]) where the chunk file is read raw and the CPU checks its checksum in the
        product's own pass (RawLayout.read_with_dots, `into` a buffer to read it into
        there); None for the products elsewhere."""
        raw = self.layout(model_id, site, field)
        if isinstance(raw, RawLayout):
            return raw.read_with_dots(chunk, v, check=self.reader.check_checksums,
                                      expect=self.reader.expect(raw.label), into=into)
        return self.read_chunk(model_id, site, field, chunk), None

    def read_chunks(self, model_id: int, site: str, field: str, first: int,
                    count: int) -> np.ndarray:
        """Chunks `first` .. `first + count - 1` of a site's field as one array of their rows
        in order, each checked as `read_chunk` checks it (one buffer, no joining copy, where
        the chunk files are read raw)."""
        raw = self.layout(model_id, site, field)
        if isinstance(raw, RawLayout):
            return raw.read_run(first, count, check=self.reader.check_checksums,
                                expect=self.reader.expect(raw.label))
        parts = [self.read_chunk(model_id, site, field, first + i) for i in range(count)]
        return parts[0] if count == 1 else np.concatenate(parts)

    def read_dots(self, model_id: int, site: str, field: str, first: int, count: int,
                  v: np.ndarray) -> np.ndarray:
        """float32: the rows of chunks `first` .. `first + count - 1` of a site's float16
        field dotted with `v` (float32 [d]) by the compiled product, each chunk checked as
        `read_chunks` checks it (where the chunk files are read raw, its checksum in the
        product's own pass: RawLayout.read_run_dots)."""
        raw = self.layout(model_id, site, field)
        if isinstance(raw, RawLayout):
            return raw.read_run_dots(first, count, v, check=self.reader.check_checksums,
                                     expect=self.reader.expect(raw.label))
        return row_dots(self.read_chunks(model_id, site, field, first, count), v)

    # -- writing -----------------------------------------------------------------------------

    def write_whole_chunks(self, model_id: int, site: str, start: int,
                           direction: np.ndarray) -> tuple[int, int]:
        """Write the direction chunks that rows [start, start + n) fill whole, where the array
        is stored raw on a local disk; returns the rows written, [a, b) (empty: none). No other
        rows share those chunks, so no other write touches their files: this may run beside
        the commit of earlier rows (`write_rows` with `done` then writes the rest)."""
        raw = self.layout(model_id, site, "direction")
        if not isinstance(raw, RawLayout):
            return start, start
        c, stop = raw.shape[0], start + direction.shape[0]
        a, b = -(-start // c) * c, stop // c * c
        if a >= b:
            return start, start
        self._write_raw(raw, a, direction[a - start : b - start])
        return a, b

    def write_rows(self, model_id: int, site: str, start: int, values: dict[str, np.ndarray],
                   *, done: tuple[int, int] | None = None) -> None:
        """Write token rows [start, start + n) of a site's fields (direction, norm, mean and
        any lens arrays); the direction's rows `done` ([a, b), by `write_whole_chunks`) are
        written already."""
        for name, value in values.items():
            if name == "direction" and done is not None and done[0] < done[1]:
                a, b = done
                if a > start:
                    self._write_field(model_id, site, name, start, value[: a - start])
                if b < start + value.shape[0]:
                    self._write_field(model_id, site, name, b, value[b - start :])
                continue
            self._write_field(model_id, site, name, start, value)

    def _write_field(self, model_id: int, site: str, name: str, start: int,
                     value: np.ndarray) -> None:
        """Write token rows [start, start + n) of one field of a site."""
        raw = self.layout(model_id, site, name)
        if isinstance(raw, ShardedChunks):
            for chunk, lo, end, data, crc in raw.write_rows(
                    start, value, expect=self.reader.expect(raw.label)):
                self.written.add(chunk_digest(raw.label, chunk, lo, end, data, crc))
        elif isinstance(raw, RawLayout):
            self._write_raw(raw, start, value)
        else:
            self._write_through_zarr(f"models/{model_id}/acts/{site}/{name}",
                                     self.array(model_id, site, name), start, value)

    def _write_through_zarr(self, label: str, arr: zarr.Array, start: int,
                            value: np.ndarray) -> None:
        """Rows [start, start + n) of an array only zarr writes; each chunk they touch read
        back for its digest."""
        stop = start + value.shape[0]
        arr[start:stop] = value
        c = arr.chunks[0]
        for chunk in range(start // c, (stop - 1) // c + 1):
            lo = chunk * c
            whole = np.zeros((c, *arr.shape[1:]), dtype=arr.dtype)
            held = np.asarray(arr[lo : min(lo + c, arr.shape[0])])
            whole[: held.shape[0]] = held
            self.written.add(chunk_digest(label, chunk, lo, min(stop, lo + c), whole, None))

    def _write_raw(self, raw: RawLayout, start: int, value: np.ndarray) -> None:
        """Write rows straight into raw chunk files, each replaced whole and atomically (a
        temporary file renamed over it), as zarr's local store would, minus its per-chunk
        overhead. A chunk only partly covered is read (checked), patched, fsynced and
        replaced: its rows below `start` are committed. The others hold no committed row and,
        where the file system allows it, wait for `sync`'s one syncfs instead of an fsync
        each."""
        c, stop = raw.shape[0], start + value.shape[0]
        value = np.ascontiguousarray(value, dtype=raw.dtype)
        for chunk in range(start // c, (stop - 1) // c + 1):
            lo = chunk * c
            a, b = max(start, lo), min(stop, lo + c)
            path = raw.path(chunk)
            # Rows are written from the committed count on: a chunk written from its first
            # row holds none committed, and its file may wait for the commit's one syncfs.
            fresh = a == lo
            if fresh and b == lo + c:
                data = value[a - start : b - start]
            elif fresh:  # a chunk's first rows: what follows them is not committed
                data = np.zeros(raw.shape, dtype=raw.dtype)
                data[: b - a] = value[a - start : b - start]
            else:
                data = self.reader.read_raw(raw, chunk)  # a fresh buffer of our own
                data[a - lo : b - lo] = value[a - start : b - start]
            parent = os.path.dirname(path)
            self.durability.make_folder(parent, os.path.dirname(parent),
                                        os.path.dirname(raw.folder))
            defer = fresh and self.durability.syncs_with(parent)
            crc = raw.write(chunk, data, sync=not defer)
            self.written.add(chunk_digest(raw.label, chunk, lo, b, data, crc))
            self.durability.wrote(parent, deferred=defer)


def site_fields(lens: int) -> tuple[str, ...]:
    """The arrays of a site that carries a lens of `lens` tokens (0: none)."""
    return (*ACT_FIELDS, *LENS_FIELDS) if lens else ACT_FIELDS


def _dimension_names(name: str, tail: int) -> tuple[str, ...]:
    if name == "direction":
        return ("row", "head", "dim") if tail == 2 else ("row", "dim")
    if name in LENS_FIELDS:
        return ("row", "rank" if name != "lens_stats" else "stat")
    return ("row", "head")[: 1 + tail]


__all__ = ["ACT_FIELDS", "SCALAR_CHUNK_FACTOR", "SHARD_CHUNKS", "ActArrays",
           "default_chunk_tokens", "site_fields", "write_alignment"]
