"""The trajectory page's picture: positions' paths across layers on a 2-D projection of the
sphere, with the anchors of the tokens they pass near.

The projection is PCA fitted to a sample of the model's stored unit directions `u = x/||x||`
at the chosen role's sites and the final site (the sample: the rows first in the order of
`hash(prompt_id, position, site)`, so the same store always gives the same picture). A point
is `(u - mean) . [p1, p2]`, `p1, p2` the first two principal directions.

An anchor `a` (a unit LM-head row) is placed by the same map, `(a - mean) . p_k`, without
reading W_U: each principal direction is a combination of the centred sample rows,
`p_k = C^T A_k / S_k` for the SVD `C = A S B^T` of the centred sample `C = U - mean`, and
`A_k` sums to zero, so `a . p_k = (U a) . A_k / S_k`, where `(U a)_i = cos(u_i, a)` is
`cosine_to_anchor` over the sample rows: that is all it takes.

    >>> import numpy as np
    >>> u = unit_rows(np.random.default_rng(0).normal(size=(50, 6)) + [3, 0, 1, 0, 0, 0])
    >>> fit = fit_pca(u)
    >>> a = unit_rows(np.array([[1.0, 2, 0, 0, -1, 0]]))[0]
    >>> bool(np.allclose(place_anchors(fit, (u @ a)[:, None]), (a - fit.mean) @ fit.axes.T))
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import QueryError

if TYPE_CHECKING:
    from ..query import Database

SAMPLE_ROWS = 2000  # rows the projection is fitted to
MAX_ANCHORS = 24  # anchors drawn: the tokens the paths pass nearest, most often first

PATHS_SQL = """\
SELECT position, token, layer, site, to_list(vec) AS x,
       nearest_anchors(vec, 1)[1].token_id AS near_id,
       nearest_anchors(vec, 1)[1].token AS near
FROM acts
WHERE model = $model AND prompt_id = $prompt_id AND list_contains($positions, position)
  AND role IN ($role, 'final') AND norm > 0
ORDER BY position, layer, site"""

SAMPLE_SQL = """\
SELECT to_list(vec) AS x,
       list_transform($anchors, lambda t: cosine_to_anchor(vec, t)) AS cosines
FROM acts
WHERE model = $model AND role IN ($role, 'final') AND norm > 0
ORDER BY hash(prompt_id, position, site)
LIMIT $sample"""


@dataclass(frozen=True, kw_only=True)
class Pca:
    mean: np.ndarray  # [d] float64
    axes: np.ndarray  # [2, d] the principal directions, unit length
    left: np.ndarray  # [n, 2] A_k: the left singular vectors of the centred sample
    singular: np.ndarray  # [2] S_k
    explained: np.ndarray  # [2] each axis's share of the sample's variance


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Each row divided by its length (rows of zeros stay zeros)."""
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)


def list_matrix(column: Any) -> np.ndarray:
    """An Arrow column of equal-length number lists as float64 [rows, length] (NULL: nan)."""
    import pyarrow.compute as pc

    flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float64)
    return flat.reshape(len(column), -1) if len(column) else flat.reshape(0, 0)


def fit_pca(u: np.ndarray) -> Pca:
    """The first two principal directions of the rows of `u` [n, d] (float64)."""
    mean = u.mean(axis=0)
    c = u - mean  # [n, d]
    a, s, bt = np.linalg.svd(c, full_matrices=False)
    k = min(2, len(s))
    # a sign for each axis fixed by the data (its largest loading positive), not by LAPACK
    signs = np.sign(bt[np.arange(k), np.abs(bt[:k]).argmax(axis=1)])
    signs[signs == 0] = 1
    axes = np.zeros((2, u.shape[1]))
    left = np.zeros((u.shape[0], 2))
    singular = np.zeros(2)
    axes[:k], left[:, :k], singular[:k] = bt[:k] * signs[:, None], a[:, :k] * signs, s[:k]
    total = float((s ** 2).sum())
    explained = singular ** 2 / total if total > 0 else np.zeros(2)
    return Pca(mean=mean, axes=axes, left=left, singular=singular, explained=explained)


def place_anchors(fit: Pca, cosines: np.ndarray) -> np.ndarray:
    """Anchors' coordinates [m, 2] from their cosines with the sample rows [n, m]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        along = (cosines.T @ fit.left) / fit.singular  # a . p_k  [m, 2]
    along = np.where(fit.singular > 0, along, 0.0)
    return along - fit.mean @ fit.axes.T


def trajectory(db: Database, *, model: str, prompt_id: int, positions: list[int], role: str,
               sample: int = SAMPLE_ROWS) -> dict[str, Any]:
    """The trajectory page's data: each position's points, the anchors, and the SQL run."""
    params: dict[str, Any] = {"model": model, "prompt_id": prompt_id,
                              "positions": positions, "role": role}
    table = db.sql(PATHS_SQL, params=params).to_arrow_table()
    paths = table.drop_columns(["x"]).to_pylist()
    if not paths:
        raise QueryError(f"no stored vectors for model {model!r}, prompt {prompt_id}, "
                         f"positions {positions} at role {role!r} or the final site")
    counts: dict[int, int] = {}
    names: dict[int, str] = {}
    for p in paths:
        if p["near_id"] is not None:
            counts[p["near_id"]] = counts.get(p["near_id"], 0) + 1
            names[p["near_id"]] = p["near"]
    anchors = sorted(counts, key=lambda t: (-counts[t], t))[:MAX_ANCHORS]
    sample_params = {"model": model, "role": role, "anchors": anchors, "sample": sample}
    rows = db.sql(SAMPLE_SQL, params=sample_params).to_arrow_table()
    u = unit_rows(list_matrix(rows.column("x")))
    fit = fit_pca(u)
    xy = (unit_rows(list_matrix(table.column("x"))) - fit.mean) @ fit.axes.T
    placed: list[dict[str, Any]] = []
    if anchors:
        cos = list_matrix(rows.column("cosines"))  # NULL -> nan
        if not np.isnan(cos).any():
            at = place_anchors(fit, cos)
            placed = [{"token_id": t, "token": names[t], "x": float(at[i, 0]),
                       "y": float(at[i, 1])} for i, t in enumerate(anchors)]
    by_position: dict[int, dict[str, Any]] = {}
    for p, (x, y) in zip(paths, xy, strict=True):
        path = by_position.setdefault(p["position"], {"position": p["position"],
                                                      "token": p["token"], "points": []})
        path["points"].append({"layer": p["layer"], "site": p["site"], "near": p["near"],
                               "x": float(x), "y": float(y)})
    return {
        "projection": {
            "method": "PCA", "fitted_on": int(u.shape[0]),
            "explained": [float(e) for e in fit.explained],
        },
        "paths": list(by_position.values()),
        "anchors": placed,
        "sql": [{"sql": PATHS_SQL, "params": params},
                {"sql": SAMPLE_SQL, "params": sample_params}],
    }
