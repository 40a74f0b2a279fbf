"""The materialized lens's top k: logit descending, ties lower id first, also where the k-th
place falls among tied tokens (torch.topk leaves their order open)."""

from __future__ import annotations

import numpy as np
import torch

from actdb.ingestion.lens import top_k


def test_ties_keep_the_lower_id_first() -> None:
    rng = np.random.default_rng(0)
    lg = rng.integers(0, 6, size=(64, 300)).astype(np.float32)  # many ties, at every place
    lg[0] = 1.0  # a row of one value: the k lowest ids
    for k in (1, 5, 17):
        v, i = top_k(torch.from_numpy(lg), k)
        ids = np.arange(lg.shape[1])
        want = np.lexsort((np.broadcast_to(ids, lg.shape), -lg), axis=1)[:, :k]
        np.testing.assert_array_equal(i.numpy(), want)
        np.testing.assert_array_equal(v.numpy(), np.take_along_axis(lg, want, 1))
