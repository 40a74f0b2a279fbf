"""A model whose logits are scaled and then soft-capped (Cohere's scale, then Gemma 2's cap):
the logit-lens functions at the final site equal the model's own float64 logits.

No model of transformers has both, so the generated decoder of tests/support/gen_models.py is
built with both, with a scale and a cap chosen so the order matters: logits of a few units,
scaled by 3 and capped at 4, sit where tanh bends, and a cap applied before the scale would
give other numbers (3 * 4 tanh(2 / 4) = 5.5 where 4 tanh(3 * 2 / 4) = 3.6).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from support.gen_models import Choices, build
from support.prompts import PROMPTS
from support.tiny_models import build_family_tokenizer

import actdb

SCALE, CAP = 3.0, 4.0
TOKENS = [0, 7, 123, 250]
K = 5


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tokenizer = build_family_tokenizer("llama")
    torch.manual_seed(0)
    model = build(Choices(logits="scale_softcap", head_bias=True, seed=5), len(tokenizer))
    model.config.logit_scale, model.config.logit_softcap = SCALE, CAP
    store = tmp_path_factory.mktemp("transforms") / "s.actdb"
    actdb.ingest(store, model=model, tokenizer=tokenizer, prompts=PROMPTS, device="cpu",
                 name="gen", batch_size=2)
    m64 = copy.deepcopy(model).double()
    logits = {}
    with torch.no_grad():
        for text in PROMPTS:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            logits[text] = m64(ids).logits[0].numpy()  # [T, V] float64, the model's own
    with actdb.connect(store, device="cpu") as db:
        yield {"db": db, "logits": logits}


def _rows(db: actdb.Database, select: str) -> list[tuple[Any, ...]]:
    return db.sql(f"SELECT p.text, a.position, {select} FROM acts a JOIN prompts p "
                  "USING (prompt_id) WHERE a.site = 'final' ORDER BY a.prompt_id, a.position"
                  ).fetchall()


def test_both_transforms_are_recorded(built: dict[str, Any]) -> None:
    scale, cap = built["db"].sql("SELECT logit_scale, logit_softcap FROM models").fetchone()
    assert scale == pytest.approx(SCALE, rel=1e-6) and cap == pytest.approx(CAP, rel=1e-6)
    # the logits reach where the order of the two matters: the model's own logits, taken back
    # through the cap and the scale and then capped before scaling, differ by far more than
    # the tests below allow
    real = np.concatenate(list(built["logits"].values()))
    pre = CAP * np.arctanh(real / CAP) / SCALE
    swapped = SCALE * CAP * np.tanh(pre / CAP)
    assert np.abs(swapped - real).max() > 100 * 5e-3 * CAP


def test_logit_is_the_models_own(built: dict[str, Any]) -> None:
    rows = _rows(built["db"], ", ".join(f"logit(vec, {t})" for t in TOKENS))
    assert len(rows) == sum(len(x) for x in built["logits"].values())
    for text, pos, *got in rows:
        want = built["logits"][text][pos][TOKENS]
        np.testing.assert_allclose(got, want, rtol=0, atol=5e-3 * CAP)


def test_top_logits_are_the_models_own(built: dict[str, Any]) -> None:
    for text, pos, top in _rows(built["db"], f"top_logits(vec, {K})"):
        ref = built["logits"][text][pos]
        got_ids = [t["token_id"] for t in top]
        got = np.array([t["logit"] for t in top])
        np.testing.assert_allclose(got, ref[got_ids], rtol=0, atol=5e-3 * CAP)
        # the k best of the model's own, up to ties within the store's rounding
        kth = np.sort(ref)[::-1][K - 1]
        assert ref[got_ids].min() >= kth - 5e-3 * CAP
        assert np.all(np.diff(got) <= 1e-6)


def test_the_lens_distribution_is_the_models_own(built: dict[str, Any]) -> None:
    t = TOKENS[2]
    for text, pos, p, lp, h in _rows(built["db"], f"prob(vec, {t}), logprob(vec, {t}), "
                                                  "entropy(vec)"):
        ref = built["logits"][text][pos]
        logz = np.log(np.exp(ref - ref.max()).sum()) + ref.max()
        want_lp = ref[t] - logz
        probs = np.exp(ref - logz)
        assert lp == pytest.approx(want_lp, abs=1e-2)
        assert p == pytest.approx(np.exp(want_lp), abs=1e-3)
        assert h == pytest.approx(float(-(probs * (ref - logz)).sum()), abs=1e-2)
