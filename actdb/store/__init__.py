"""Storage: the DuckDB catalog, the Zarr tensors, and the commit protocol joining them."""

from .records import ModelRecord, SiteRecord
from .store import ActBatch, Store

__all__ = ["ActBatch", "ModelRecord", "SiteRecord", "Store"]
