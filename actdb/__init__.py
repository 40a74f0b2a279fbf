"""actdb: an activation database for transformer interpretability.

Every normalization site's input is stored as a point on the unit sphere plus its magnitude;
SQL with geometric tensor functions queries it lazily.
"""

import os
from pathlib import Path

from .errors import (
    ActdbError,
    DeviceError,
    IngestError,
    ModelLoadError,
    OutputError,
    PromptsError,
    QueryError,
    QuerySyntaxError,
    StoreBusyError,
    StoreFormatError,
    StoreNotFoundError,
    StoreNotWritableError,
    TokenError,
)
from .ingest import IngestSummary, ingest
from .query import Database, Result, connect

__version__ = "0.1.0"


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
    "ModelLoadError",
    "OutputError",
    "PromptsError",
    "QueryError",
    "QuerySyntaxError",
    "StoreBusyError",
    "StoreFormatError",
    "StoreNotFoundError",
    "StoreNotWritableError",
    "TokenError",
    "ingest",
    "report",
]
