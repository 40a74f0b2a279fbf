"""Each head's OV and QK circuits as singular value decompositions, exact from the factors.

A head's OV circuit is the d x d map `M = diag(g) W_V W_O` (row vectors: x M is what the head
writes reading x, one key's worth), its QK circuit `M = diag(g) W_Q W_K^T diag(g)` (x_q M x_k^T
is the score before scaling, position and bias), with g the gain of the norm the attention
reads. Both are products of a [d, r] and an [r, d] factor with r = d_head, so rank <= r, and
their SVD comes from the factors alone: QR of each, then the SVD of the small r x r core,
in float64. `u` (left singular vectors) are the directions read, `v` the directions written
(OV) or the key directions (QK); each pair's sign is fixed so that v's largest entry is
positive.

>>> import numpy as np
>>> a, b = np.eye(3)[:, :1] * 2.0, np.eye(3)[:1] * 3.0
>>> s, u, v = factored_svd(a, b)
>>> float(s[0]), u[0].tolist(), v[0].tolist()
(6.0, [1.0, 0.0, 0.0], [1.0, 0.0, 0.0])
"""

from __future__ import annotations

import numpy as np

# Stored float32, computed float64: sigma within this of a float64 SVD of the full product
# (relative to the largest singular value), vectors within it in cosine distance.
SVD_BOUND = 2.0**-20


def factored_svd(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sigma [r], u [r, d], v [r, d]) of `a @ b` for a [d, r] and b [r, d], largest first."""
    return _from_qr(_left(a), _right(b))


QR = tuple[np.ndarray, np.ndarray]


def _left(a: np.ndarray) -> QR:
    """QR of a left factor a [d, r]: ([d, r], [r, r])."""
    return np.linalg.qr(np.asarray(a, dtype=np.float64))


def _right(b: np.ndarray) -> QR:
    """QR of a right factor's transpose, b [r, d]: ([d, r], [r, r])."""
    return np.linalg.qr(np.asarray(b, dtype=np.float64).T)


def _from_qr(left: QR, right: QR) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qa, ra = left
    qb, rb = right
    us, s, vts = np.linalg.svd(ra @ rb.T)
    u = (qa @ us).T  # [r, d]
    v = (qb @ vts.T).T  # [r, d]
    flip = np.sign(v[np.arange(len(v)), np.abs(v).argmax(axis=1)])
    flip[flip == 0] = 1.0
    return s, u * flip[:, None], v * flip[:, None]


def head_circuits(w_q: np.ndarray, w_k: np.ndarray, w_v: np.ndarray, w_o: np.ndarray,
                  kv_of_head: tuple[int, ...], gain: np.ndarray | None
                  ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """{'OV': (sigma [H, r], u [H, r, d], v [H, r, d]), 'QK': ...} for every head; the
    weights are per head [heads, d_head, d] as rows (AttentionWeights)."""
    d = w_q.shape[-1]
    g = np.ones(d) if gain is None else np.asarray(gain, dtype=np.float64).reshape(d)
    # A key-value head's factor serves every query head of its group: its QR once.
    kvs = sorted(set(kv_of_head))
    values = {kv: _left(g[:, None] * w_v[kv].astype(np.float64).T) for kv in kvs}
    keys = {kv: _right(w_k[kv].astype(np.float64) * g[None, :]) for kv in kvs}
    out: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {"OV": [], "QK": []}
    for h, kv in enumerate(kv_of_head):
        wq, wo = w_q[h].astype(np.float64), w_o[h].astype(np.float64)
        out["OV"].append(_from_qr(values[kv], _right(wo)))
        out["QK"].append(_from_qr(_left(g[:, None] * wq.T), keys[kv]))
    return {k: (np.stack([t[0] for t in v]), np.stack([t[1] for t in v]),
                np.stack([t[2] for t in v])) for k, v in out.items()}
