"""Whether a process is alive: the one test the local lock's and an S3 lease's takeovers share."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts: it may not be
    signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["alive"]
