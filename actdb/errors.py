"""The exception tree. Each error also inherits the builtin a caller would catch."""

from __future__ import annotations


class ActdbError(Exception):
    """Base class of every error actdb raises on purpose."""


class StoreNotFoundError(ActdbError, FileNotFoundError):
    """The store directory does not exist (or is not a store)."""


class StoreFormatError(ActdbError, ValueError):
    """The path is not a store, or its format version is not one we read."""


class StoreNotWritableError(ActdbError, PermissionError):
    """The store (or its parent directory) cannot be written."""


class DeviceError(ActdbError, ValueError):
    """The device asked for does not exist here."""


class StoreBusyError(ActdbError, RuntimeError):
    """Another process holds the store's catalog open for writing (an ingest)."""


class ModelLoadError(ActdbError, ValueError):
    """A model or tokenizer could not be loaded, or has nothing to capture."""


class PromptsError(ActdbError, ValueError):
    """The prompts given to an ingest are empty or malformed."""


class IngestError(ActdbError, RuntimeError):
    """An ingest could not complete (e.g. a norm site's stored maths is not faithful)."""


class QueryError(ActdbError, ValueError):
    """A query is malformed, refers to something unknown, or would modify the store."""


class QuerySyntaxError(QueryError):
    """The SQL does not parse; carries line and column."""

    def __init__(self, message: str, *, query: str, line: int, column: int) -> None:
        super().__init__(message)
        self.query = query
        self.line = line
        self.column = column

    def with_caret(self) -> str:
        """The message followed by the offending query line and a caret under the spot."""
        lines = self.query.splitlines() or [""]
        row = lines[min(max(self.line, 1), len(lines)) - 1]
        caret = " " * max(self.column - 1, 0) + "^"
        return f"{self.args[0]}\n  {row}\n  {caret}"


class OutputError(ActdbError, OSError):
    """A query's result cannot be written where asked (a missing folder, a folder as file)."""


class TokenError(QueryError):
    """A token string is not exactly one token of a model's vocabulary."""


class VerifyError(ActdbError, RuntimeError):
    """`verify` found the catalog and the tensors disagree."""


class StoreCorruptError(ActdbError, IOError):
    """Stored bytes are damaged or missing: a checksum, a size or a file does not match."""


class StoreFullError(ActdbError, OSError):
    """The file system holding the store is full, or a file of the store reached the
    process's file-size limit (`ulimit -f`); nothing committed is lost."""


class MissingDependencyError(ActdbError, ImportError):
    """An optional package a feature needs is not installed."""


class StoreStorageError(ActdbError, OSError):
    """Object storage could not be reached or refused a request (credentials, bucket, network)."""


class ShardSpecError(ActdbError, ValueError):
    """A shard or shard count given to a sharded ingest is not one (`--shard 3/2`, shards=0)."""


class ShardError(ActdbError, RuntimeError):
    """Shard ingests that cannot be merged (missing, unfinished, or of different plans)."""


class QueryTimeoutError(ActdbError, TimeoutError):
    """A query ran past its time limit (`--timeout`, `timeout=`) and was stopped."""


class QueryCancelledError(QueryError):
    """`actdb serve` cancelled a query because the client that sent it went away."""


class ServeError(ActdbError, ValueError):
    """`actdb serve` cannot start as asked (an address in use, a weak token, a bad limit)."""
