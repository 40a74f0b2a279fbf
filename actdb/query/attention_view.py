"""The view `attention(model, prompt_id, layer, head, query_position, key_position, weight)`:
the attention weights `ingest --attention` stored (store/attention.py), one row per (prompt,
layer, head, query, key). The rows are made in SQL from the prompts that have weights; `weight`
is an Arrow UDF reading one layer's chunk per (prompt, layer) it meets, so a query filtered to
a prompt, layer or head reads only those chunks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import duckdb
import numpy as np
from duckdb.func import FunctionNullHandling, PythonUDFType

from ..errors import ActdbError, QueryError
from ..lazy import lazy_module
from ..store.attention import stored_prompts
from ..store.digests import TABLE as DIGESTS
from .threads import torch_threads
from .timeout import watching
from .vectors import VectorSource

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read

_KEPT_LAYERS = 32  # (prompt, layer) chunks a connection keeps read


class ErrorBox(Protocol):
    """What the view's UDF shares with the connection's queries (execute.ErrorBox)."""

    error: ActdbError | None
    stop: threading.Event


def make_attention_view(con: duckdb.DuckDBPyConnection, src: VectorSource, box: ErrorBox,
                        session: str, sqltype: Callable[[str], duckdb.sqltypes.DuckDBPyType]
                        ) -> None:
    """Create the view on `con`; a QueryError, one sentence, for a store without weights."""
    has_digests = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?",
                              [DIGESTS]).fetchall()[0][0]
    prompts = stored_prompts(lambda sql, p: con.execute(sql, p).fetchall()) if has_digests \
        else []
    if not prompts:
        raise QueryError(f"store {src.store.location!r} holds no attention weights: ingest "
                         "with --attention (Python: actdb.ingest(..., attention=True)) to "
                         "store them")
    ids = {m.model: m.model_id for m in src.models.values()}
    shapes: dict[str, tuple[int, ...]] = {}
    for model, pid in prompts:  # one array's metadata a model: every layer has its heads
        if model not in shapes:
            shapes[model] = src.store.arrays.attention.shape(ids[model], pid)
    con.create_function(
        f"_actdb_attention_{session}", _weight_udf(src, box),
        [sqltype("BIGINT")] * 6, sqltype("DOUBLE"), type=PythonUDFType.ARROW,
        null_handling=FunctionNullHandling.SPECIAL, side_effects=False)
    con.execute("CREATE OR REPLACE TEMP TABLE _actdb_attention_prompts "
                "(model VARCHAR, model_id BIGINT, prompt_id BIGINT, n_layers BIGINT, "
                "n_heads BIGINT)")
    con.execute(
        "INSERT INTO _actdb_attention_prompts SELECT unnest($1), unnest($2), unnest($3), "
        "unnest($4), unnest($5)",
        [[m for m, _ in prompts], [ids[m] for m, _ in prompts], [p for _, p in prompts],
         [shapes[m][0] for m, _ in prompts], [shapes[m][1] for m, _ in prompts]])
    con.execute(f"""
        CREATE OR REPLACE TEMP VIEW attention AS
        SELECT p.model, p.prompt_id, l.range::INTEGER AS layer, h.range::INTEGER AS head,
               q.range::INTEGER AS query_position, k.range::INTEGER AS key_position,
               _actdb_attention_{session}(p.model_id, p.prompt_id, l.range, h.range, q.range,
                                          k.range) AS weight
        FROM _actdb_attention_prompts p
        JOIN prompt_runs r ON r.model = p.model AND r.prompt_id = p.prompt_id,
             range(p.n_layers) l, range(p.n_heads) h, range(r.n_tokens) q, range(r.n_tokens) k
    """)


def _weight_udf(src: VectorSource, box: ErrorBox) -> Callable[..., pa.Array]:
    """weight(model_id, prompt_id, layer, head, query, key), a layer's chunk at a time."""
    kept: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()

    def layer(mid: int, pid: int, lay: int) -> np.ndarray:
        key = (mid, pid, lay)
        got = kept.get(key)
        if got is None:
            got = kept[key] = src.store.arrays.attention.layer(mid, pid, lay)
            while len(kept) > _KEPT_LAYERS:
                kept.popitem(last=False)
        else:
            kept.move_to_end(key)
        return got

    def udf(a0: pa.Array, a1: pa.Array, a2: pa.Array, a3: pa.Array, a4: pa.Array,
            a5: pa.Array) -> pa.Array:
        mid, pid, lay, head, q, k = (c.to_numpy(zero_copy_only=False).astype(np.int64)
                                     for c in (a0, a1, a2, a3, a4, a5))
        out = np.empty(len(mid), dtype=np.float64)
        try:
            with torch_threads(1), watching(box.stop):
                # one chunk per (model, prompt, layer)
                _, group = np.unique(np.stack([mid, pid, lay], axis=1), axis=0,
                                     return_inverse=True)
                group = group.reshape(-1)
                for g in np.unique(group):
                    at = np.nonzero(group == g)[0]
                    w = layer(int(mid[at[0]]), int(pid[at[0]]), int(lay[at[0]]))
                    out[at] = w[head[at], q[at], k[at]]
        except ActdbError as e:
            box.error = e
            raise
        return pa.array(out, type=pa.float64())

    return udf
