"""The lens's bfloat16 vocabulary kernel (actdb/query/vocab_scan.py, actdb/_native_vocab.c)
against float64 references: ranks exactly equal to the exact (correctly rounded, math.fsum)
logits' ranks on adversarial rows (ties, near-ties inside the proven band, a duplicated
anchor, rows of large norm, a zero row, with and without a bias); log-sum-exp, entropy,
logprob and KL within the bounds vocab_scan.py derives, which are below the stated c."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actdb.query import vocab_rank as vr
from actdb.query import vocab_scan as vs

pytestmark = pytest.mark.skipif(
    not vs.usable(torch.device("cpu"), SimpleNamespace(logit_scale=None, logit_softcap=None)),
    reason="no AVX-512 BF16 on this CPU (or no compiled vocab_scan)")

V, D = 1500, 64


def exact_logits(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """float64 [n, V]: each x . w_t + b_t correctly rounded (products of float32 values are
    exact in float64, math.fsum sums them exactly): ties are ties."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    out = np.empty((len(x), len(w)))
    for i, row in enumerate(x64):
        prods = row[None, :] * w64  # [V, D], exact
        extra = [[float(v)] for v in b] if b is not None else [[] for _ in range(len(w))]
        out[i] = [math.fsum(list(p) + e) for p, e in zip(prods, extra, strict=True)]
    return out


def adversarial(seed: int, bias: bool, *, big: bool = True, top: bool = False):
    """(x [n, D], w [V, D], b, tid [n]) float32 with the ties and near-ties a wrong margin
    or a skipped rescore miscounts; `big`: a row and two anchors of large norm (which make
    the log-sum-exp's uniform bound, max over the anchors, loose); `top`: the targets are
    each row's largest logit (the ties then sit at the top, for top_logits)."""
    g = np.random.default_rng(seed)
    w = (g.standard_normal((V, D)) * 0.05).astype(np.float32)
    x = g.standard_normal((12, D)).astype(np.float32) * 3
    x[5] = 0.0  # a zero row: every logit ties (is the bias)
    if big:
        x[7] *= 1e4  # a row of large norm
        w[[11, 12]] *= 1e3  # anchors of large norm
    b = (g.standard_normal(V) * 0.1).astype(np.float32) if bias else None
    tid = g.integers(0, V, len(x))
    tid[3] = 11
    if top:
        tid = (x.astype(np.float64) @ w.astype(np.float64).T
               + (b if b is not None else 0.0)).argmax(-1)
    x64 = x.astype(np.float64)
    for i, t in enumerate(tid):
        # A duplicated anchor: a tie that counts as not larger.
        w[100 + i] = w[t]
        if b is not None:
            b[100 + i] = b[t]
        # Near-ties around this row's target: its row plus tiny steps along x_i, so the
        # logit moves by about +-eps times the scale of the bound's band (and never ties).
        if not x[i].any():
            continue
        unit = x64[i] / (x64[i] @ x64[i])
        band = 1.4e-4 * np.linalg.norm(x64[i]) * np.linalg.norm(w64 := w[t].astype(np.float64))
        for j, eps in enumerate([3e-3, -3e-3, 3e-2, -3e-2, 0.3, -0.3, 1.0, -1.0]):
            w[200 + 10 * i + j] = (w64 + eps * band * unit).astype(np.float32)
            if b is not None:
                b[200 + 10 * i + j] = b[t]
        if top:  # rows that bfloat16 rounds differently, each just below the target exactly
            for j in range(20):
                r = w64 * (1 + g.uniform(-2.0**-8, 2.0**-8, D))
                r += (x64[i] @ w64 - 2e-5 * band / 1.4e-4 - x64[i] @ r) * unit
                w[400 + 20 * i + j] = r.astype(np.float32)
                if b is not None:
                    b[400 + 20 * i + j] = b[t]
    return x, w, b, tid


@pytest.mark.parametrize("bias", [False, True])
def test_rank_equals_the_exact_rank(bias):
    x, w, b, tid = adversarial(1, bias)
    s = exact_logits(x, w, b)
    want = 1 + (s > s[np.arange(len(x)), tid][:, None]).sum(-1)
    wt, bt = torch.from_numpy(w), None if b is None else torch.from_numpy(b)
    head = vs.pack(wt, bt)
    got = vs.ranks(torch.from_numpy(x), wt, bt, torch.from_numpy(tid), head)
    np.testing.assert_array_equal(got.rank.numpy(), want)
    # the target's logit in float64: off the exact one by at most d 2^-53 sum |x_i w_i|
    mag = (np.abs(x.astype(np.float64)) * np.abs(w[tid].astype(np.float64))).sum(-1)
    err = np.abs(got.logit.numpy() - s[np.arange(len(x)), tid])
    assert (err <= D * 2.0**-53 * mag).all()
    # the band was needed: near-ties, the duplicate and the target itself were rescored
    assert (got.band.numpy()[np.arange(len(x)) != 5] >= 3).all()
    if b is None:  # the zero row: every logit ties at 0, every token in the band
        assert got.band[5] == V and got.rank[5] == 1


@pytest.mark.skipif(not vr.usable(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("bias,width", [(False, D), (True, D), (True, D - 1)])
def test_rank16_equals_the_exact_rank(bias, width):
    """token_rank's 16-bit integer pass (vocab_rank.py): the same exact ranks, on the same
    adversarial rows (and an odd width, the last pair half zero)."""
    x, w, b, tid = adversarial(1, bias)
    x, w = np.ascontiguousarray(x[:, :width]), np.ascontiguousarray(w[:, :width])
    s = exact_logits(x, w, b)
    want = 1 + (s > s[np.arange(len(x)), tid][:, None]).sum(-1)
    wt, bt = torch.from_numpy(w), None if b is None else torch.from_numpy(b)
    got, done = vr.ranks(torch.from_numpy(x), wt, bt, torch.from_numpy(tid), vr.pack(wt))
    assert done.all()
    np.testing.assert_array_equal(got.rank.numpy(), want)
    mag = (np.abs(x.astype(np.float64)) * np.abs(w[tid].astype(np.float64))).sum(-1)
    err = np.abs(got.logit.numpy() - s[np.arange(len(x)), tid])
    assert (err <= width * 2.0**-53 * mag + 2.0**-52 * np.abs(got.logit.numpy())).all()
    assert (got.band.numpy()[np.arange(len(x)) != 5] >= 3).all()
    if b is None:
        assert got.band[5] == V and got.rank[5] == 1
    # the band is the kernel's, not the vocabulary: a few near-ties and the row's neighbours
    assert np.median(got.band.numpy()) < V / 4


@pytest.mark.skipif(not vr.usable(), reason="no AVX-512 VNNI on this CPU")
def test_rank16_holds_where_each_rounding_is_near_its_bound():
    """Rows and tokens built so that the integer product misses by most of one term of its
    bound (x's rounding aligned with a token's row, or a token's rounding aligned with x),
    and a token's exact logit sits just above the target's: only the whole bound keeps it
    in the band (a spike of 32767 steps fixes each scale, so the roundings are as built)."""
    g = np.random.default_rng(7)
    d, s, st = 64, 2.0**-10, 2.0**-12
    w = (g.standard_normal((40, d)) * 0.05).astype(np.float32)
    x = np.zeros((4, d), dtype=np.float64)
    # row 0: x's rounding (0.49 of a step) along token 0's signs
    x[0, 0] = 32767 * s
    x[0, 1:] = s * (g.integers(-1000, 1000, d - 1) + 0.49 * np.sign(w[0, 1:]))
    # row 1: x exact in its steps; token 1's rounding (0.49 of a step) along x's signs
    q = g.integers(-1000, 1000, d)
    q[0] = 32767
    x[1] = s * q
    w[1] = st * (np.r_[32767, g.integers(-1000, 1000, d - 1) + 0.49 * np.sign(q[1:])])
    x[2:] = g.standard_normal((2, d)) * 3
    x = x.astype(np.float32)
    x64 = x.astype(np.float64)
    tid = np.array([2, 3, 4, 5])
    for i, (a, gap) in enumerate([(0, 5 * s * 0.05), (1, 5000 * s * st)]):
        # the target: token a moved along x to `gap` below it
        w[tid[i]] = (w[a] - gap * x64[i] / (x64[i] @ x64[i])).astype(np.float32)
    s_ = exact_logits(x, w, None)
    assert s_[0, 0] > s_[0, 2] and s_[1, 1] > s_[1, 3]
    want = 1 + (s_ > s_[np.arange(4), tid][:, None]).sum(-1)
    wt = torch.from_numpy(w)
    head = vr.pack(wt)
    assert head.sw[1] == np.float32(st)
    r = vr.rows(torch.from_numpy(x[:2]), head)
    assert r.sx[:2].tolist() == [s, s]
    got, done = vr.ranks(torch.from_numpy(x), wt, None, torch.from_numpy(tid), head)
    assert done.all()
    np.testing.assert_array_equal(got.rank.numpy(), want)


@pytest.mark.skipif(not vr.usable(), reason="no AVX-512 VNNI on this CPU")
def test_rank16_leaves_rows_whose_sums_could_overflow():
    from dataclasses import replace

    x, w, _, tid = adversarial(2, False)
    wt = torch.from_numpy(w)
    head = vr.pack(wt)
    assert 0 < head.p2max < 2**31
    _, done = vr.ranks(torch.from_numpy(x), wt, None, torch.from_numpy(tid),
                       replace(head, p2max=2**40))
    assert done.tolist() == [i == 5 for i in range(len(x))]  # the zero row's sums are 0


def test_rank_of_rows_of_mixed_targets_in_one_call_matches_each_alone():
    x, w, _, tid = adversarial(2, False)
    wt = torch.from_numpy(w)
    head = vs.pack(wt, None)
    together = vs.ranks(torch.from_numpy(x), wt, None, torch.from_numpy(tid), head).rank
    alone = [int(vs.ranks(torch.from_numpy(x[i : i + 1]), wt, None,
                          torch.from_numpy(tid[i : i + 1]), head).rank[0])
             for i in range(len(x))]
    assert together.tolist() == alone


def _softmax_stats(s: np.ndarray):
    m = s.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[:, 0]
    p = np.exp(s - lse[:, None])
    mean = (p * s).sum(-1)
    sd = np.sqrt((p * (s - mean[:, None]) ** 2).sum(-1))
    return lse, p, mean, sd


@pytest.mark.parametrize("bias", [False, True])
def test_lse_entropy_logprob_within_their_bounds(bias):
    x, w, b, tid = adversarial(3, bias, big=False)
    s = exact_logits(x, w, b)
    lse, p, mean, sd = _softmax_stats(s)
    head = vs.pack(torch.from_numpy(w), None if b is None else torch.from_numpy(b))
    sums = vs.lse(torch.from_numpy(x), head, moments=True)
    scale = vs.row_scale(torch.from_numpy(x), head).numpy()
    # the bound E is below the stated c X max N
    assert (sums.err <= vs.stated_error(D) * scale * head.n_max + 1e-30).all()
    assert (np.abs(sums.lse - lse) <= sums.err + 2.0**-16).all()
    h = lse - mean
    assert sums.mean is not None
    assert (np.abs((sums.lse - sums.mean) - h) <= vs.entropy_bound(sums)).all()
    assert sd.max() > 0.5 and np.ptp(h) > 10 * vs.entropy_bound(sums).max()


def test_kl_pairs_within_the_bound():
    x, w, _, _ = adversarial(4, False, big=False)
    pairs = np.stack([x, np.roll(x, 1, 0)], 1).reshape(-1, D)  # (v, target) rows
    s = exact_logits(pairs, w, None)
    lse, p, _, _ = _softmax_stats(s)
    lp = s - lse[:, None]
    lpv, lpt, pt = lp[0::2], lp[1::2], p[1::2]
    kl = (pt * (lpt - lpv)).sum(-1)
    head = vs.pack(torch.from_numpy(w), None)
    sums = vs.lse(torch.from_numpy(pairs), head, pairs=True)
    assert sums.cross is not None and sums.cross_abs is not None
    got = sums.cross[1::2] - sums.lse[1::2] + sums.lse[0::2]
    ev, et = sums.err[0::2] + 2.0**-16, sums.err[1::2] + 2.0**-16
    dist = sums.cross_abs[1::2] + np.abs(sums.lse[1::2] - sums.lse[0::2])
    bound = 2 * ev + np.expm1(2 * et) * dist + 2 * et * np.exp(2 * et)
    assert (np.abs(got - kl) <= bound).all()
    assert kl.min() > 10 * bound.max()  # the KLs are far apart from 0 and each other


def test_exp_relative_error_below_2_to_the_minus_21():
    """Logits 0 and y, y = k / 2^16 in [-0.75, 0] (exact in the bfloat16 split, so the
    product is exact): log(1 + e^y (1 + delta)) measures the kernel exp's error delta over
    its whole reduced range."""
    y = -np.arange(0, 0.75 * 2**16, 7, dtype=np.float64) / 2**16
    x = np.zeros((len(y), 2), dtype=np.float32)
    x[:, 0], x[:, 1] = y, 1.0
    w = np.array([[0.0, 0.0], [1.0, 0.0]], dtype=np.float32)  # logits 0 and y
    head = vs.pack(torch.from_numpy(w), None)
    got = vs.lse(torch.from_numpy(x), head).lse
    ey = np.exp(y)
    delta = np.expm1(got - np.log1p(ey)) * (1 + ey) / ey
    assert np.abs(delta).max() < 2.0**-21


def test_threads_share_the_vocabulary_with_the_same_answers(monkeypatch):
    x, w, _, tid = adversarial(5, False)
    wt = torch.from_numpy(w)
    head = vs.pack(wt, None)
    one = vs.ranks(torch.from_numpy(x), wt, None, torch.from_numpy(tid), head).rank
    s1 = vs.lse(torch.from_numpy(x), head, moments=True)
    monkeypatch.setattr(vs, "threads_for", lambda flops, device=None: 3)
    three = vs.ranks(torch.from_numpy(x), wt, None, torch.from_numpy(tid), head).rank
    if vr.usable():
        monkeypatch.setattr(vr, "threads_for", lambda flops, device=None: 3)
        r16, _ = vr.ranks(torch.from_numpy(x), wt, None, torch.from_numpy(tid), vr.pack(wt))
        assert r16.rank.tolist() == one.tolist()
    s3 = vs.lse(torch.from_numpy(x), head, moments=True)
    assert one.tolist() == three.tolist()
    # each thread sums exp(a - m) from its own largest value: the same within the
    # evaluation's 2^-16 (module docstring)
    np.testing.assert_allclose(s3.lse, s1.lse, rtol=0, atol=2.0**-16)
    assert s1.mean is not None and s3.mean is not None
    np.testing.assert_allclose(s3.mean, s1.mean, rtol=0, atol=2.0**-16)


@pytest.mark.parametrize("bias", [False, True])
def test_top_k_is_the_float32_top_k(bias):
    """top_logits' candidates from the kernel: the same answer as topk.py's float32 path
    (float32 rescores, ties lower id first) on rows whose largest logit is duplicated and
    surrounded by near-ties; the ids are the exact top k wherever float32 separates them."""
    from actdb.query import topk
    from actdb.query.topk_lists import topk_block

    x, w, b, _ = adversarial(6, bias, big=False, top=True)
    wt, bt = torch.from_numpy(w), None if b is None else torch.from_numpy(b)
    head = vs.pack(wt, bt)
    s = exact_logits(x, w, b)
    model = SimpleNamespace(logit_scale=None, logit_softcap=None)
    for k in (1, 5):
        _, _, done = vs.top_k(torch.from_numpy(x), wt, bt, k, head)
        # the zero row's logits are the bias, or tie everywhere without one: then too many
        # candidates, and topk.py's path takes it
        assert done.tolist() == [i != 5 or bias for i in range(len(x))]
        vals, ids = topk_block(torch.from_numpy(x), wt, bt, k, torch.bfloat16, model)
        want_v, want_i = topk.topk(torch.from_numpy(x), wt, bt, k, lowp=None, transform=None)
        np.testing.assert_array_equal(ids.numpy(), want_i.numpy())
        np.testing.assert_array_equal(vals.numpy(), want_v.numpy())
        # against the exact logits: ties (the duplicate) lower id first, values within float32
        order = np.lexsort((np.broadcast_to(np.arange(V), s.shape), -s), axis=-1)[:, :k]
        mag = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
        sep = np.diff(-np.sort(-s, -1)[:, : k + 1], axis=-1).min(-1) < -1e-5 * mag.max(-1)
        np.testing.assert_array_equal(ids.numpy()[sep], order[sep])
        err = np.abs(vals.numpy() - np.take_along_axis(s, ids.numpy(), -1))
        assert (err <= (D + 2) * 2.0**-23 * np.take_along_axis(mag, ids.numpy(), -1)
                + 2.0**-23 * np.abs(vals.numpy())).all()
        assert sep.sum() >= 4
