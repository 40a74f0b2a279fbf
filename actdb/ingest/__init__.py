"""Ingest: run a model over prompts and store every norm site's input."""

from .pipeline import IngestPlan, IngestSummary, ingest

__all__ = ["IngestPlan", "IngestSummary", "ingest"]
