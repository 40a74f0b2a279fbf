"""One ingest at a time on object storage: a lease object taken and renewed with conditional
writes (an flock does not reach across machines).

`ingest.lease` holds who writes (host, PID, a random owner id) and until when. Taking it is a
create-if-absent PUT; a lease whose time ran out, or whose process is known dead (same host,
PID gone: a killed ingest resumed on the same machine), is taken over with a PUT conditional
on its ETag, so of two takers exactly one wins. The holder renews it every third of its
lifetime, each time conditional on its own last ETag: a holder that finds it taken stops
publishing (the catalog pointer's own conditional write is the final guard).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..errors import StoreBusyError
from .objects import AlreadyExistsError, Objects, PreconditionError
from .pids import alive
from .retry import retry

LEASE_KEY = "ingest.lease"
LEASE_S = 60.0  # ACTDB_LEASE_S overrides it


def lease_seconds() -> float:
    return float(os.environ.get("ACTDB_LEASE_S", LEASE_S))


class Lease:
    def __init__(self, objects: Objects, location: str, key: str = LEASE_KEY) -> None:
        self.objects = objects
        self.location = location
        self.key = key
        self.owner = uuid.uuid4().hex
        self.ttl = lease_seconds()
        self._etag: str | None = None
        self._lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(),
                           "pid": os.getpid(), "expires": time.time() + self.ttl}).encode()

    def acquire(self) -> None:
        """Take the lease, or StoreBusyError in one sentence naming its holder."""
        try:
            self._etag = self.objects.put(self.key, self._body(), if_absent=True)
        except AlreadyExistsError:
            self._take_over()
        self._thread = threading.Thread(target=self._renew, name="actdb-lease", daemon=True)
        self._thread.start()

    def acquire_waiting(self, seconds: float | None) -> None:
        """Take the lease, waiting up to `seconds` (None: as long as it takes) while another
        holder has it. A live holder renews it; one that died stops renewing, its lease runs
        out within `lease_seconds()` and is taken over, so an endless wait ends."""
        # a long wait costs a request a second
        retry(self.acquire, again=lambda e: isinstance(e, StoreBusyError),
              deadline=None if seconds is None else time.monotonic() + seconds,
              pause=0.05, grow=1.5, longest=1.0)

    def _take_over(self) -> None:
        try:
            data, etag = self.objects.get(self.key)
        except FileNotFoundError:  # released meanwhile: try once more from the start
            self._etag = self._put_or_busy(None, {})
            return
        holder = _parse(data)
        left = float(holder.get("expires", 0)) - time.time()
        if left > 0 and not _dead_here(holder):
            raise self._busy(holder, f"its lease runs {left:.0f} s more unless renewed")
        self._etag = self._put_or_busy(etag, holder)

    def _put_or_busy(self, etag: str | None, holder: dict[str, Any]) -> str | None:
        try:
            if etag is None:
                return self.objects.put(self.key, self._body(), if_absent=True)
            return self.objects.put(self.key, self._body(), if_match=etag)
        except (AlreadyExistsError, PreconditionError):
            raise self._busy(holder, "it took the lease just now") from None

    def _busy(self, holder: dict[str, Any], detail: str) -> StoreBusyError:
        who = (f" (PID {holder.get('pid')} on host {holder.get('host')!r})"
               if holder.get("pid") else "")
        return StoreBusyError(
            f"store {self.location!r} is being written by another ingest{who}; {detail}: "
            "run this one again when it has finished (it will skip what is stored)"
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                if self._lost or self._etag is None:
                    return
                try:
                    self._etag = self.objects.put(self.key, self._body(), if_match=self._etag)
                except PreconditionError:
                    self._lost = True
                except Exception:  # a network hiccup: the next renewal tries again
                    continue

    def check(self) -> None:
        """StoreBusyError when another ingest took the lease from this one."""
        if self._lost:
            raise StoreBusyError(
                f"store {self.location!r}: this ingest's lease was taken over by another "
                "ingest (it was not renewed in time); nothing more was published"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._etag is None or self._lost:
                return
            try:
                data, etag = self.objects.get(self.key)
            except FileNotFoundError:
                return
            if etag == self._etag and _parse(data).get("owner") == self.owner:
                self.objects.delete(self.key)
            self._etag = None


def live_holder(objects: Objects, key: str) -> dict[str, Any] | None:
    """Who holds the lease `key`, or None when it is absent, ran out, or its process died
    on this machine."""
    try:
        data, _ = objects.get(key)
    except FileNotFoundError:
        return None
    holder = _parse(data)
    if float(holder.get("expires", 0)) <= time.time() or _dead_here(holder):
        return None
    return holder


def _parse(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _dead_here(holder: dict[str, Any]) -> bool:
    """The holder ran on this machine and its process is gone (killed: resume at once)."""
    pid = holder.get("pid")
    return (holder.get("host") == socket.gethostname() and isinstance(pid, int)
            and pid != os.getpid() and not alive(pid))
