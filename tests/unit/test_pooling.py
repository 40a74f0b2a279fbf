"""The proof that a classification head averages its positions (ingestion/pooling.py), on toy
heads whose maths is known: a mean through a projector is proven, with the composed map equal
to the float64 NumPy product of the layers; a head whose rows pass a ReLU before the mean, which
the sample never exercises (its normed rows are all positive), passes on the sample alone and is
refused by the random rows sent in the norm's place; a softmax-weighted pool is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from actdb.ingestion.pooling import prove_pooled
from actdb.ingestion.sites import FoundSite
from actdb.store.records import SiteRecord

D, T, B, L = 8, 5, 3, 4


class Toy(nn.Module):
    """A final norm, then `pool` of its rows, then a head (through a projector)."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.norm.bias.fill_(6.0)  # every normed row positive: a ReLU does nothing here
        self.projector = nn.Linear(D, 6)
        self.classifier = nn.Linear(6, L)
        self.score = nn.Linear(D, 1)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> Any:
        y = self.norm(x)  # [B, T, D]
        if self.pool == "relu":
            y = torch.relu(y)
        p = self.projector(y)  # [B, T, 6]
        if self.pool == "attention":
            w = torch.softmax(self.score(y), dim=1)  # [B, T, 1]
            pooled = (w * p).sum(1)
        else:
            pooled = p.mean(1)
        return SimpleNamespace(logits=self.classifier(pooled))


def _site(model: Toy) -> FoundSite:
    record = SiteRecord(site="final", site_id=0, layer=1, role="final", kind="layernorm", d=D,
                        n_heads=None, eps=1e-5, module="norm", has_gain=True, has_bias=True)
    return FoundSite(record=record, hooks=(("norm", model.norm),), layout="btd", gain=None,
                     bias=None)


def _sample() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(B, T, D, generator=torch.Generator().manual_seed(1)) * 3.0}


def test_a_mean_through_a_projector_is_the_composed_head() -> None:
    model = Toy("mean").eval()
    head, why = prove_pooled(model, model.classifier, _site(model), _sample())
    assert head is not None, why
    wc = model.classifier.weight.detach().double().numpy()
    wp = model.projector.weight.detach().double().numpy()
    bc = model.classifier.bias.detach().double().numpy()
    bp = model.projector.bias.detach().double().numpy()
    np.testing.assert_allclose(head.weight.numpy(), wc @ wp, rtol=1e-12)
    np.testing.assert_allclose(head.bias.numpy(), wc @ bp + bc, rtol=1e-12)
    with torch.no_grad():  # each row's logits, averaged: the model's own
        y = model.norm(_sample()["x"]).double().numpy()
        real = model(**_sample()).logits.double().numpy()
    np.testing.assert_allclose((y @ (wc @ wp).T + wc @ bp + bc).mean(1), real, rtol=1e-5)


@pytest.mark.parametrize("pool", ["relu", "attention"])
def test_a_head_that_is_no_mean_of_its_rows_is_refused(pool: str) -> None:
    model = Toy(pool).eval()
    head, why = prove_pooled(model, model.classifier, _site(model), _sample())
    assert head is None
    if pool == "relu":  # the sample alone cannot tell: the random rows do
        assert why.startswith("its logits are not the mean of its rows' logits"), why
    else:  # what the head reads is no mean of the rows nor of a linear layer's outputs
        assert why.startswith("its head reads vectors of width 6 that are not the mean"), why


def test_the_batch_check_averages_each_inputs_own_rows() -> None:
    """LogitCheck, pooled: the stored rows of a right-padded batch (inputs of 3, 2, 0 and 4
    real tokens, their rows consecutive) are averaged per input and compared with the model's
    logits, here the float64 NumPy mean of each input's rows' logits; rows given to the wrong
    input (one shifted along) are caught."""
    from actdb.ingestion.logits import LogitCheck, LogitTransform
    from actdb.store.store import ActBatch

    rng = np.random.default_rng(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    n = int(mask.sum())
    x = rng.standard_normal((n, D)) * 3.0
    w, b = rng.standard_normal((L, D)), rng.standard_normal(L)
    head = nn.Linear(D, L)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(w))
        head.bias.copy_(torch.from_numpy(b))
    record = SiteRecord(site="final", site_id=0, layer=1, role="final", kind="rmsnorm", d=D,
                        n_heads=None, eps=1e-6, module="norm", has_gain=False, has_bias=False)
    site = FoundSite(record=record, hooks=(), layout="btd", gain=None, bias=None)
    check = LogitCheck(site, head, LogitTransform(scale=None, softcap=None, error=0.0),
                       torch.device("cpu"), position=None, pooled=True)

    def acts(rows: np.ndarray) -> ActBatch:
        norm = np.linalg.norm(rows, axis=-1)
        return ActBatch(direction=(rows / norm[:, None]).astype(np.float16),
                        norm=norm.astype(np.float32), mean=rows.mean(-1).astype(np.float32))

    y = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)  # RMSNorm, float64
    own = y @ w.T + b
    owner = np.repeat(np.arange(4), mask.sum(1).numpy())
    real = np.zeros((4, 1, L))
    for i in (0, 1, 3):
        real[i, 0] = own[owner == i].mean(0)
    positions = check.positions(4)
    assert check.error(torch.from_numpy(real), acts(x), mask, positions) < 2e-3
    shifted = np.roll(x, 1, axis=0)  # each row stored one place on: another input's
    assert check.error(torch.from_numpy(real), acts(shifted), mask, positions) > 0.05
