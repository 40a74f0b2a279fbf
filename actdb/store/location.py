"""What a store location names: a local folder, or object storage (`s3://bucket/prefix`).
Decided here, not in objects.py: a local store never imports the object-storage client."""

from __future__ import annotations

import os

SCHEME = "s3://"


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether a store location names object storage (`s3://bucket/prefix`)."""
    return isinstance(location, str) and location.startswith(SCHEME)


__all__ = ["SCHEME", "is_remote"]
