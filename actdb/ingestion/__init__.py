"""Ingest: run a model over prompts and store every norm site's input."""

from .pipeline import IngestPlan, IngestSummary, ingest
from .shards import merge

__all__ = ["IngestPlan", "IngestSummary", "ingest", "merge"]
