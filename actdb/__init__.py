"""actdb: an activation database for transformer interpretability.

Every normalization site's input is stored as a point on the unit sphere plus its magnitude;
SQL with geometric tensor functions queries it lazily.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (
    ActdbError,
    DeviceError,
    IngestError,
    ModelLoadError,
    OutputError,
    PromptsError,
    QueryError,
    QuerySyntaxError,
    QueryTimeoutError,
    StoreBusyError,
    StoreFormatError,
    StoreNotFoundError,
    StoreNotWritableError,
    TokenError,
)

if TYPE_CHECKING:
    from .ingestion import IngestSummary, ingest, merge
    from .query import Database, Result, connect

# The query and ingest layers load on first use, so `import actdb` (and the CLI) stays cheap.
# `actdb.ingest` is the function; its package is `actdb.ingestion`.
_LAZY = {"IngestSummary": "ingestion", "ingest": "ingestion", "merge": "ingestion",
         "Database": "query", "Result": "query", "connect": "query"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.2.0"


def report(db: Database | str | os.PathLike[str], output: str | os.PathLike[str] | None = None,
           *, models: list[str] | None = None, device: str = "auto") -> Path:
    """Run the papers' measurements on a store and write one self-contained HTML page.

    Args:
        db: an open Database or a store path.
        output: the .html file (default: report.html in the current folder).
        models: the models to report on (default: every model in the store).
        device: where the tensor functions run when `db` is a path.

    Returns:
        The path written.
    """
    from .plot.report import report as write_report

    return write_report(db, output, models=models, device=device)


__all__ = [
    "ActdbError",
    "Database",
    "DeviceError",
    "Result",
    "connect",
    "IngestError",
    "IngestSummary",
    "merge",
    "ModelLoadError",
    "OutputError",
    "PromptsError",
    "QueryError",
    "QuerySyntaxError",
    "QueryTimeoutError",
    "StoreBusyError",
    "StoreFormatError",
    "StoreNotFoundError",
    "StoreNotWritableError",
    "TokenError",
    "ingest",
    "report",
]
