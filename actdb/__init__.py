"""actdb: an activation database for transformer interpretability.

Every normalization site's input is stored as a point on the unit sphere plus its magnitude;
SQL with geometric tensor functions queries it lazily.
"""

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
]
