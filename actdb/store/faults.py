"""Named fault points in the commit protocol, for the fault-injection tests.

`ACTDB_FAULT=point[:n[:action]]` makes the process act the n-th time (default 1) it reaches
`point`: `kill` (default) sends itself SIGKILL, `enospc` raises OSError(ENOSPC) as a full disk
would. Unset, `fault()` is one comparison. Points (docs/FORMAT.md lists them):
create_before_catalog, create_after_catalog, weight_write (a weight chunk file mid-write),
weights_written, chunk_write (a vector chunk file mid-write), attention_write (a chunk of
attention weights mid-write, `ingest --attention`), tensors_written,
catalog_commit, committed, catalog_fold (the catalog's log folded into a new copy of the file,
not yet renamed over it), catalog_folded (renamed, the old log not yet deleted),
catalog_uploaded (object storage: a catalog uploaded, its
pointer not yet swapped), shard_removal (a merge removing a merged shard's catalog: all of
it removed but what names it as a shard).
"""

from __future__ import annotations

import errno
import os
import signal
import threading

POINTS = ("create_before_catalog", "create_after_catalog", "weight_write", "weights_written",
          "chunk_write", "attention_write", "tensors_written", "catalog_commit", "committed",
          "catalog_fold", "catalog_folded", "catalog_uploaded",
          "shard_removal")


def _parse(spec: str | None) -> tuple[str, int, str] | None:
    if not spec:
        return None
    point, _, rest = spec.partition(":")
    count, _, action = rest.partition(":")
    if point not in POINTS or action not in ("", "kill", "enospc"):
        raise ValueError(f"ACTDB_FAULT={spec!r}: points are {POINTS}, actions kill or enospc")
    return point, int(count or 1), action or "kill"


_SPEC = _parse(os.environ.get("ACTDB_FAULT"))
_seen = 0
_lock = threading.Lock()


def fault(point: str) -> None:
    """Act here if ACTDB_FAULT names this point and this is its n-th passage."""
    global _seen
    if _SPEC is None or _SPEC[0] != point:
        return
    with _lock:
        _seen += 1
        hit = _seen == _SPEC[1]
    if not hit:
        return
    if _SPEC[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"<ACTDB_FAULT {point}>")
