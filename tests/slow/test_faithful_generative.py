"""Generative faithfulness: many tiny random models built by combining architectural choices
(tests/support/gen_models.py), each ingested and checked against a float64 run of the model
itself: the stored vectors are the hooked inputs, the outputs recomputed from what is stored are the
modules' outputs, roles are as built, and `logit` through SQL is the model's own logit."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
import torch
import zarr
from support.gen_models import Choices, build, sample_choices
from support.prompts import PROMPTS
from support.tiny_models import build_family_tokenizer

import actdb
from actdb.ingestion import run

CASES = sample_choices(24, seed=9)
OFF_STREAM = {"inner", "q_norm", "k_norm"}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_family_tokenizer("llama")


def _label(c: Choices) -> str:
    return (f"{c.mode}-qk{c.qk}-lat{int(c.latent)}-sub{int(c.sub_norm)}-ffn{int(c.ffn_norm)}-"
            f"{c.logits}-bias{int(c.head_bias)}-tied{int(c.tied)}-{c.seed}")


def _reference(model: torch.nn.Module, tok: Any) -> tuple[dict[str, list[Any]], list[np.ndarray]]:
    """Per norm module path: per prompt, (input, output) as float64 [T, (H,) d], laid out as
    the model built it; and per prompt the float64 logits [T, V]."""
    m64 = copy.deepcopy(model).double()
    leaves = {p: mod for p, mod in m64.named_modules() if type(mod).__name__.startswith("Gen")
              and type(mod).__name__.endswith("Norm")}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(path: str, args: tuple[Any, ...], out: torch.Tensor) -> None:
        seen.setdefault(path, (args[0].detach(), out.detach()))

    handles = [mod.register_forward_hook(lambda _m, a, o, p=p: keep(p, a, o))
               for p, mod in leaves.items()]
    per_site: dict[str, list[Any]] = {p: [] for p in model.roles}
    logits = []
    try:
        for text in PROMPTS:
            seen.clear()
            ids = tok(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                logits.append(m64(ids).logits[0].numpy())
            for path, layout in model.layouts.items():
                if layout == "list":
                    x = torch.stack([seen[f"{path}.{i}"][0] for i in range(4)], dim=-2)
                    y = torch.stack([seen[f"{path}.{i}"][1] for i in range(4)], dim=-2)
                else:
                    x, y = seen[path]
                    if layout == "bhtd":
                        x, y = x.transpose(1, 2), y.transpose(1, 2)
                per_site[path].append((x[0].numpy(), y[0].numpy()))
    finally:
        for h in handles:
            h.remove()
    return per_site, logits


def _replay(centered: bool, x: np.ndarray, gain: np.ndarray | None, bias: np.ndarray | None,
            eps: float) -> np.ndarray:
    w = x - x.mean(-1, keepdims=True) if centered else x
    z = w / np.sqrt((w * w).mean(-1, keepdims=True) + eps)
    return (z * gain if gain is not None else z) + (bias if bias is not None else 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("choices", CASES, ids=_label)
def test_generated_model_is_stored_faithfully(choices: Choices, tokenizer: Any,
                                              tmp_path: Path) -> None:
    _check_stored_faithfully(choices, tokenizer, tmp_path, batch_size=4)


@pytest.mark.parametrize("case", [0, 6, 7, 13])  # per-head layouts bthd, list, bhtd; btd
@pytest.mark.parametrize("batch_size,group_tokens", [(2, 5), (1, 40)])
def test_small_commit_groups_store_the_same_vectors(case: int, batch_size: int,
                                                    group_tokens: int, tokenizer: Any,
                                                    tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit groups of a few rows: the ingest's two sets of row buffers alternate many times
    (padded batches of two uneven prompts, a group each), and groups of several prompts fill
    their buffers to the size the ingest computed (prompts of 17, 31, 6, 36, 19 and 20 tokens,
    groups of at least 40)."""
    monkeypatch.setattr(run, "FLUSH_TOKENS", group_tokens)
    _check_stored_faithfully(CASES[case], tokenizer, tmp_path, batch_size=batch_size,
                             chunk_tokens=4)


def _check_stored_faithfully(choices: Choices, tokenizer: Any, tmp_path: Path,
                             **ingest_kw: Any) -> None:
    torch.manual_seed(0)
    model = build(choices, len(tokenizer))
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, tokenizer=tokenizer, prompts=PROMPTS, device="cpu",
                 name="gen", **ingest_kw)
    per_site, ref_logits = _reference(model, tokenizer)

    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    sites = con.execute(
        "SELECT site, role, module, centered, eps, n_heads, has_gain, has_bias, max_rel_error "
        "FROM sites WHERE model = 'gen' ORDER BY site_id").fetchall()
    scale, cap, logit_err = con.execute(
        "SELECT logit_scale, logit_softcap, logit_max_rel_error FROM models").fetchone()
    runs = dict(con.execute("SELECT p.text, r.row_start FROM prompt_runs r "
                            "JOIN prompts p USING (prompt_id)").fetchall())
    con.close()

    # Roles as built, every norm a site (a per-head list is one site).
    assert {m: r for _, r, m, *_ in sites} == model.roles
    # The logit transform as built (the config's numbers, independently of the measurement).
    cfg = model.config
    want_scale = {"scale": cfg.logit_scale, "divide": 1 / cfg.logit_scale,
                  "scale_softcap": cfg.logit_scale, "pre_divide": 4.0 / cfg.hidden_size}
    assert (scale or 1.0) == pytest.approx(want_scale.get(choices.logits, 1.0), rel=1e-5)
    want_cap = cfg.logit_softcap if "softcap" in choices.logits else None
    assert cap == (pytest.approx(want_cap, rel=1e-5) if want_cap else None)
    assert logit_err is not None and logit_err < 1e-2

    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    for site, _role, module, centered, eps, n_heads, has_gain, has_bias, err in sites:
        assert err is not None and err < 1e-2
        acts = group[f"models/0/acts/{site}"]
        sg = f"models/0/sites/{site}"
        gain = np.asarray(group[f"{sg}/gain"][...], np.float64) if has_gain else None
        bias = np.asarray(group[f"{sg}/bias"][...], np.float64) if has_bias else None
        for text, (x_ref, y_ref) in zip(PROMPTS, per_site[module], strict=True):
            row, n = runs[text], x_ref.shape[0]
            assert (n_heads is not None) == (x_ref.ndim == 3)
            direction = np.asarray(acts["direction"][row : row + n], np.float64)
            norm = np.asarray(acts["norm"][row : row + n], np.float64)
            x = direction * norm[..., None]
            rel = np.linalg.norm(x - x_ref, axis=-1) / np.linalg.norm(x_ref, axis=-1)
            assert rel.max() < 2e-3, (site, rel.max())
            y = _replay(centered, x, gain, bias, eps)
            rel_y = np.linalg.norm(y - y_ref, axis=-1) / np.linalg.norm(y_ref, axis=-1)
            assert rel_y.max() < 5e-3, (site, rel_y.max())

    # logit through SQL at the final site equals the model's own (float64) logits.
    tokens = [0, 7, 123, len(tokenizer) - 1]
    with actdb.connect(store) as db:
        cols = ", ".join(f"logit(vec, {t})" for t in tokens)
        rows = db.sql(f"SELECT p.text, a.position, {cols}, top_logits(vec, 1)[1].token_id "
                      "FROM acts a JOIN prompts p USING (prompt_id) WHERE a.site = 'final'"
                      ).fetchall()
        off = db.sql("SELECT count(*) FROM acts WHERE role IN ('inner', 'q_norm', 'k_norm') "
                     "AND (logit(vec, 7) IS NOT NULL OR cosine_to_anchor(vec, 7) IS NOT NULL "
                     "OR uniform_angle(vec) IS NULL)").fetchall()[0][0]
    assert off == 0
    assert len(rows) == sum(len(r) for r in ref_logits)
    by_text = dict(zip(PROMPTS, ref_logits, strict=True))
    for text, pos, *vals in rows:
        ref = by_text[text][pos]
        spread = float(np.abs(ref).max()) + 1.0
        np.testing.assert_allclose(vals[:-1], ref[tokens], atol=5e-3 * spread)
        assert ref[vals[-1]] >= ref.max() - 5e-3 * spread
