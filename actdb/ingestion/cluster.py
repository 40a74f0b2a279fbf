"""An ingest on a Dask cluster: N shard ingests (`shard=(i, N)`) run as tasks on the
workers, one a worker where there are enough, then merge their catalogs here."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from ..cluster import DaskClient
from ..errors import IngestError
from ..store.store import Store
from .options import IngestOptions, IngestSummary
from .process import ingest_here
from .prompts import read_prompts
from .shards import check_shard_count, merge


def ingest_on_cluster(opts: IngestOptions, *, cluster: Any, shards: int | None = None
                      ) -> IngestSummary:
    """Ingest `opts.prompts` with `shards` shard ingests on the cluster (default: one per
    worker), then merge them. The workers must reach the store and the model at the same
    path or URL.

    Returns:
        The whole ingest's summary (counts summed over shards; seconds of the whole run).
    """
    if not isinstance(opts.model, str | os.PathLike):
        raise IngestError("a cluster ingest loads the model on every worker: pass its hub name "
                          "or folder, not a model object")
    wanted = check_shard_count(shards)
    started = time.perf_counter()
    # Read here, once: workers get the same prompts even when the file is only local.
    rows = [{**p.extra, "text": p.text}
            for p in read_prompts(opts.prompts or [], format=opts.prompts_format)]
    location = os.fspath(opts.store)
    if "://" not in location:
        location = os.path.abspath(location)
    source = os.fspath(opts.model)
    if os.path.exists(source):
        source = os.path.abspath(source)
    storage_options = opts.storage_options
    # What each worker runs: its shard of the same prompts, without this process's progress
    # display or plan callback.
    worker = replace(opts, store=location, model=source, prompts=rows, prompts_format=None,
                     progress=False, on_plan=None)
    dask = DaskClient(cluster, IngestError)
    try:
        workers = dask.workers()
        n = wanted or max(1, len(workers))
        futures = [
            dask.client.submit(
                ingest_here, replace(worker, shard=(i, n)), pure=False,
                workers=[workers[i % len(workers)]] if workers else None,
                allow_other_workers=True,
            )
            for i in range(n)
        ]
        parts: list[IngestSummary] = dask.client.gather(futures)
    finally:
        dask.close()
    if not all(p.note for p in parts):  # else no shard had anything to do or to merge
        merge(location, storage_options=storage_options)
    with Store(location, storage_options=storage_options) as st:  # as `actdb info` counts
        store_bytes = st.disk_bytes()["total"]
    errors: dict[str, float] = {}
    for p in parts:
        for k, v in p.max_rel_error.items():
            errors[k] = max(errors.get(k, 0.0), v)
    first = parts[0]
    return IngestSummary(
        model=first.model, store=location, prompts_total=first.prompts_total,
        prompts_new=sum(p.prompts_new for p in parts),
        prompts_skipped=first.prompts_total - sum(p.prompts_new for p in parts),
        prompts_truncated=sum(p.prompts_truncated for p in parts),
        tokens_written=sum(p.tokens_written for p in parts), sites=first.sites,
        bytes_stored=sum(p.bytes_stored for p in parts), store_bytes=store_bytes,
        seconds=time.perf_counter() - started, max_rel_error=errors,
    )
