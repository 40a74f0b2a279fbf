"""A Dask client from what a user names: `local:N`, a scheduler address, or a client or
cluster object. Shared by cluster queries (query/) and cluster ingests (ingestion/)."""

from __future__ import annotations

import logging
from typing import Any

from .errors import ActdbError


class DaskClient:
    """A `distributed.Client` and what to close with it. A client made here never becomes
    dask's default scheduler: a default left behind by one closed out of order made every
    later dask or xarray computation in the process ask for a client that no longer exists.

    Args:
        spec: `local:N` (a LocalCluster of N single-thread worker processes on 127.0.0.1,
            started here and closed with this), a scheduler address (`tcp://host:8786`), or
            a `distributed.Client` / cluster object.
        error: the ActdbError subclass a bad spec is reported as.
    """

    def __init__(self, spec: Any, error: type[ActdbError]) -> None:
        try:
            from distributed import Client, LocalCluster
        except ImportError:  # pragma: no cover - a dependency of actdb
            raise error("clusters need dask[distributed]: pip install 'dask[distributed]'"
                        ) from None
        self._own: Any = None
        if isinstance(spec, str) and spec.startswith("local:"):
            n = spec.removeprefix("local:")
            if not n.isdigit() or int(n) < 1:
                raise error(f"cluster {spec!r}: write local:N with N a number of workers "
                            "of 1 or more, e.g. local:2")
            self._own = LocalCluster(n_workers=int(n), threads_per_worker=1, processes=True,
                                     host="127.0.0.1", dashboard_address=None,
                                     silence_logs=logging.ERROR)
            self.client = Client(self._own, set_as_default=False)
        elif isinstance(spec, str):
            try:
                self.client = Client(spec, timeout=20, set_as_default=False)
            except (OSError, TimeoutError) as e:
                raise error(f"cannot reach the Dask scheduler {spec!r}: {e}") from None
            except ValueError as e:  # distributed's parse of the address
                raise error(f"cluster {spec!r} is not local:N or a scheduler address such as "
                            f"tcp://host:8786 ({e})") from None
        elif isinstance(spec, Client):
            self.client = spec
        elif hasattr(spec, "scheduler_address"):
            self.client = Client(spec, set_as_default=False)
        else:
            raise error(f"cluster must be 'local:N', a scheduler address or a Dask client, "
                        f"not {type(spec).__name__}")
        self._made_client = not isinstance(spec, Client)

    def workers(self) -> list[str]:
        """The workers' addresses, sorted."""
        return sorted(self.client.scheduler_info()["workers"])

    def close(self) -> None:
        if self._made_client:
            self.client.close()
        if self._own is not None:
            self._own.close()
