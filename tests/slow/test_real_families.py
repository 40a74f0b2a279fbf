"""Real `transformers` decoder families beyond the 13 of tests/support/tiny_models.py, built
from tiny configs offline (tests/support/real_families.py): every norm site's output through the
query layer (`normed(vec)`) equals the module's own output, and `logit` equals the model's own
logits, both against the model's own run (float32, compared in float64); roles where the
architecture fixes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.neuron_check import check_neurons
from support.prompts import PROMPTS as ALL_PROMPTS
from support.real_families import TESTED, build
from support.tiny_models import build_family_tokenizer

import actdb
from actdb import devices

# Roles that must appear, by dataflow (not names): latent norms are inner, per-head norms
# q/k, parallel blocks' MLP norm pre_mlp, a post-norm block's mid-block norm (XLM's
# layer_norm1(x + attn), whose output the MLP reads and the block carries on) post_attn.
MUST_HAVE = {
    "deepseek_v2": {"inner"}, "deepseek_v3": {"inner"}, "bitnet": {"inner"},
    "cohere": {"q_norm", "k_norm"}, "stablelm": {"q_norm", "k_norm"},
    "falcon": {"pre_mlp"}, "gemma3_text": {"q_norm", "k_norm", "post_attn", "post_mlp"},
    "xlm": {"embed", "post_attn", "post_mlp", "final"},
}
WANT_LOGITS = {"cohere": (0.125, None), "cohere2": (0.25, None), "granite": (0.25, None),
               "granitemoe": (0.125, None), "gemma3_text": (None, 30.0)}


# The norm inside the LM head, whose output the unembedding reads (the final site of logits).
HEAD_NORM = {"bert": "cls.predictions.transform.LayerNorm", "roberta": "lm_head.layer_norm",
             "electra": "generator_predictions.LayerNorm",
             "roberta-prelayernorm": "lm_head.layer_norm", "xlm-roberta-xl": "lm_head.layer_norm",
             "xlm": "transformer.layer_norm2.1"}
# Families whose norms are all sites of their own (lists of one norm a block are not per-head)
SITE_COUNT = {"xlm": 5}
PROMPTS = ALL_PROMPTS[:3]  # padded batches still (lengths differ); fewer keep 47 families fast


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_family_tokenizer("llama")


def _reference(model: torch.nn.Module, tok: Any, modules: set[str], device: torch.device
               ) -> tuple[dict[str, list[np.ndarray]], list[np.ndarray]]:
    """The model's own run, one prompt at a time, on the device the ingest ran on: in its own
    float32 (grouped MoE kernels take no float64), outputs in float64. A model's GPU run can
    differ from its CPU run by more than the tolerance (ernie4_5_moe's final site by up to
    10% on an H100), so the store is compared with the model as it ran there."""
    named = dict(model.named_modules())
    outs: dict[str, list[np.ndarray]] = {p: [] for p in modules}
    seen: dict[str, np.ndarray] = {}

    def keep(path: str, out: Any) -> None:
        out = out[0] if isinstance(out, tuple) else out
        seen.setdefault(path, out.detach().double().cpu().numpy())

    home = next(model.parameters()).device
    model.to(device)
    handles = [named[p].register_forward_hook(lambda _m, _a, o, p=p: keep(p, o))
               for p in modules]
    logits = []
    try:
        for text in PROMPTS:
            seen.clear()
            with torch.no_grad():
                out = model(**tok(text, return_tensors="pt").to(device))
            logits.append(out.logits[0].double().cpu().numpy())
            for p in modules:
                outs[p].append(seen[p])
    finally:
        for h in handles:
            h.remove()
        model.to(home)
    return outs, logits


@pytest.mark.slow
@pytest.mark.parametrize("family", TESTED)
def test_real_family_is_faithful(family: str, tokenizer: Any, tmp_path: Path) -> None:
    model = build(family, len(tokenizer))
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4,
                 device="cpu", name=family)
    with actdb.connect(store) as db:
        sites = db.sql("SELECT site, role, module, n_heads FROM sites ORDER BY site_id").fetchall()
        scale, cap, err, final = db.sql("SELECT logit_scale, logit_softcap, logit_max_rel_error, "
                                        "final_site FROM models").fetchall()[0]
        named = dict(model.named_modules())
        single = {s[2] for s in sites if not isinstance(named[s[2]], torch.nn.ModuleList)}
        # (`cpu` unless ACTDB_TEST_DEVICE names another, tests/conftest.py)
        outs, ref_logits = _reference(model, tokenizer, single, devices.resolve_device("cpu"))
        assert MUST_HAVE.get(family, set()) <= {s[1] for s in sites}
        if family in SITE_COUNT:
            assert len(sites) == SITE_COUNT[family] and single == {s[2] for s in sites}, sites
        if family in WANT_LOGITS:
            assert (scale, cap) == pytest.approx(WANT_LOGITS[family])
        assert err is not None and err < 1e-2
        # the logits come from the last final site: the one whose output the LM head reads
        finals = [s[0] for s in sites if s[1] == "final"]
        assert finals and final == finals[-1], (final, finals)
        if family in HEAD_NORM:
            assert dict((s[0], s[2]) for s in sites)[final] == HEAD_NORM[family]

        for site, _role, module, n_heads in sites:
            if module not in single:
                continue  # per-head lists: the generative test covers them
            rows = db.sql(
                "SELECT p.text, a.position, a.head, to_list(normed(vec)) FROM acts a "
                "JOIN prompts p USING (prompt_id) WHERE a.site = $s "
                "ORDER BY a.prompt_id, a.position, a.head", params={"s": site}).fetchall()
            got: dict[str, list[Any]] = {}
            for text, _pos, _head, vec in rows:
                got.setdefault(text, []).append(vec)
            for text, y in zip(PROMPTS, outs[module], strict=True):
                t = len(tokenizer(text)["input_ids"])
                if n_heads is None:
                    ref = y.reshape(t, -1)
                elif y.shape[1] == t and y.shape[2] == n_heads:
                    ref = y[0].reshape(t * n_heads, -1)
                else:
                    ref = np.swapaxes(y[0], 0, 1).reshape(t * n_heads, -1)
                mine = np.asarray(got[text], np.float64)
                rel = np.linalg.norm(mine - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
                assert rel.max() < 5e-3, (site, rel.max())

        tokens = [3, 50, len(tokenizer) - 1]
        cols = ", ".join(f"logit(vec, {t})" for t in tokens)
        rows = db.sql(f"SELECT p.text, a.position, {cols} FROM acts a JOIN prompts p "
                      "USING (prompt_id) WHERE a.site = $s", params={"s": final}).fetchall()
        # neuron_pre and neuron_act on every pre-MLP row against the MLPs' own values
        check_neurons(store, model)
    by_text = dict(zip(PROMPTS, ref_logits, strict=True))
    assert len(rows) == sum(len(r) for r in ref_logits)
    for text, pos, *vals in rows:
        ref = by_text[text][pos]
        np.testing.assert_allclose(vals, ref[tokens], atol=5e-3 * (np.abs(ref).max() + 1.0))
