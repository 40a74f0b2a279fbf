"""The ingest refuses to write a store it cannot prove: a norm whose outputs the stored fields
do not reproduce, logits the recorded transform does not reproduce, a module that is no
normalization. Plus the probe's measurements on modules that hide what they do, and reading
a format-version-1 store (raw Gemma weights as gains)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
import torch
import zarr
from support.gen_models import Choices, GenForCausalLM, _Norm, build
from support.prompts import PROMPTS
from support.tiny_models import build_family_tokenizer
from torch import nn

import actdb
from actdb import norms
from actdb.errors import IngestError, ModelLoadError
from actdb.ingestion.probe import measure_norm


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_family_tokenizer("llama")


class ShiftyRMSNorm(_Norm):
    """A norm that behaves at every length the probe passes use (the padding probe's included,
    which stops at 32 tokens) and shifts its output on longer inputs: only the ingest's own
    batch (the longest prompt has 36 tokens) sees the shift, so its check of every site's
    output has to catch it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + 0.5 if x.shape[1] > 32 else y


class _Offset(GenForCausalLM):
    """Logits that follow W_U . h when measured (the probe passes' lengths, 11 and 7), and add
    an offset otherwise."""

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super()._logits(h)
        return logits if h.shape[1] in (7, 11) else logits + 0.3


def _rows(store: Path) -> int:
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    try:
        return con.execute("SELECT count(*) FROM prompt_runs").fetchall()[0][0]
    finally:
        con.close()


def test_a_norm_the_store_cannot_reproduce_fails_the_ingest(tokenizer: Any,
                                                             tmp_path: Path) -> None:
    model = build(Choices(seed=3), len(tokenizer))
    ln = model.model.layers[0].ln1
    shifty = ShiftyRMSNorm(32, centered=ln.centered, affine="none", eps=ln.epsilon,
                     gen=torch.Generator().manual_seed(0))
    model.model.layers[0].ln1 = shifty
    with pytest.raises(IngestError, match=r"site 'blocks.0.ln1'.*differs from the module"):
        actdb.ingest(tmp_path / "s.actdb", model=model, tokenizer=tokenizer, prompts=PROMPTS,
                     device="cpu", name="m")
    assert _rows(tmp_path / "s.actdb") == 0


def test_logits_the_store_cannot_reproduce_fail_the_ingest(tokenizer: Any,
                                                            tmp_path: Path) -> None:
    from support.gen_models import GenConfig

    model = _Offset(GenConfig(vocab_size=len(tokenizer)), Choices(seed=4)).eval()
    with pytest.raises(IngestError, match=r"logits recomputed from the stored final-site"):
        actdb.ingest(tmp_path / "s.actdb", model=model, tokenizer=tokenizer, prompts=PROMPTS,
                     device="cpu", name="m")
    assert _rows(tmp_path / "s.actdb") == 0


def test_logits_no_scale_or_cap_explains_fail_before_anything_is_written(
        tokenizer: Any, tmp_path: Path) -> None:
    model = build(Choices(seed=5), len(tokenizer))
    model._logits = lambda h: torch.relu(model.lm_head(h))  # type: ignore[method-assign]
    with pytest.raises(IngestError, match=r"not a scale and soft-cap"):
        actdb.ingest(tmp_path / "s.actdb", model=model, tokenizer=tokenizer, prompts=PROMPTS,
                     device="cpu", name="m")
    assert not (tmp_path / "s.actdb").exists()


def test_logits_masked_to_the_lowest_value_are_named(tokenizer: Any, tmp_path: Path) -> None:
    """A model that sets some tokens' logits to the dtype's minimum after its LM head
    (Chameleon's image tokens) is refused in one sentence that counts them."""
    model = build(Choices(seed=5), len(tokenizer))
    masked = [5, 9, 17]

    def logits(h: torch.Tensor) -> torch.Tensor:
        out = model.lm_head(h)
        out[..., masked] = torch.finfo(out.dtype).min
        return out

    model._logits = logits  # type: ignore[method-assign]
    with pytest.raises(IngestError, match=r"its logits of 3 tokens are the lowest value") as e:
        actdb.ingest(tmp_path / "s.actdb", model=model, tokenizer=tokenizer, prompts=PROMPTS,
                     device="cpu", name="m")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "s.actdb").exists()


class _Flattened(nn.Module):
    """Hands its per-head norm the tokens flattened, [B*T, H, d] (Chameleon's q_norm)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h, d = x.shape
        return self.inner(x.reshape(b * t, h, d)).view(b, t, h, d)


def test_a_per_head_norm_over_flattened_tokens_is_stored_per_token_and_head(
        tokenizer: Any, tmp_path: Path) -> None:
    model = build(Choices(seed=6, qk="bthd", logits="none", affines=("gain_bias",)),
                  len(tokenizer))
    attn = model.model.layers[0].self_attn
    attn.q_norm = _Flattened(attn.q_norm)
    seen: list[torch.Tensor] = []
    handle = attn.q_norm.inner.register_forward_hook(
        lambda _m, a, _o: seen.append(a[0].detach().double()))
    with torch.no_grad():
        for text in PROMPTS[:2]:
            model(tokenizer(text, return_tensors="pt")["input_ids"])
    handle.remove()
    summary = actdb.ingest(tmp_path / "s.actdb", model=model, tokenizer=tokenizer,
                           prompts=PROMPTS[:2], device="cpu", name="m")
    db = actdb.connect(tmp_path / "s.actdb")
    site, d = db.sql("SELECT site, d FROM sites WHERE module = $m",
                     params={"m": "model.layers.0.self_attn.q_norm.inner"}).fetchall()[0]
    assert d == 8 and summary.max_rel_error[site] < 1e-3
    for prompt, x in enumerate(seen):  # x [T, H, d], the tokens' heads
        got = db.sql("SELECT position, head, norm, mean FROM acts WHERE site = $s AND "
                     "prompt_id = $p ORDER BY position, head",
                     params={"s": site, "p": prompt}).fetchall()
        want = [(t, h, float(x[t, h].norm()), float(x[t, h].mean()))
                for t in range(x.shape[0]) for h in range(x.shape[1])]
        assert [(t, h) for t, h, _, _ in got] == [(t, h) for t, h, _, _ in want]
        np.testing.assert_allclose([g[2:] for g in got], [w[2:] for w in want], rtol=1e-5,
                                   atol=1e-6)


class _NotANorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class _Bf16OnlyRMSNorm(nn.Module):
    """Accepts only bfloat16 inputs, its own dtype."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or self.w.dtype != torch.bfloat16:
            raise TypeError("bfloat16 only")
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w.float()).to(
            x.dtype)


def _probe(m: nn.Module, d: int = 16, dtype: torch.dtype = torch.float32) -> Any:
    return measure_norm(m, d, dtype=dtype, device=torch.device("cpu"), name="blocks.1.odd")


@pytest.mark.parametrize("affine", ["none", "gain", "gain1p", "bias", "gain1p_bias"])
@pytest.mark.parametrize("centered", [True, False])
def test_probe_recovers_the_effective_affine_exactly(affine: str, centered: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    m = _Norm(16, centered=centered, affine=affine, eps=3e-4, gen=gen).double()
    m.epsilon_hidden = m.epsilon  # the eps under a name the probe does not know
    del m.epsilon
    m.epsilon = 3e-4  # type: ignore[assignment]
    fit = _probe(m)
    g = getattr(m, "scale", None)
    want_g = None if g is None else (1.0 + g if affine.startswith("gain1p") else g).detach()
    b = getattr(m, "shift", None)
    assert fit.centered is centered
    assert fit.eps == pytest.approx(3e-4, rel=1e-9)
    assert (fit.gain is None) == (want_g is None)
    if want_g is not None:
        torch.testing.assert_close(fit.gain, want_g.double(), rtol=1e-12, atol=1e-12)
    assert (fit.bias is None) == (b is None)
    if b is not None:
        torch.testing.assert_close(fit.bias, b.detach().double(), rtol=1e-12, atol=1e-12)
    assert fit.kind.endswith("_1p") == affine.startswith("gain1p")


def test_probe_measures_eps_without_an_eps_attribute() -> None:
    m = _Norm(16, centered=False, affine="gain", eps=2e-3, gen=torch.Generator().manual_seed(2))
    m.__dict__["hidden"] = m.__dict__.pop("epsilon")
    type(m).epsilon = property(lambda self: self.hidden)  # type: ignore[attr-defined]
    try:
        fit = measure_norm(m, 16, dtype=torch.float32, device=torch.device("cpu"), name="x")
    finally:
        del type(m).epsilon  # type: ignore[attr-defined]
    assert fit.eps == pytest.approx(2e-3, rel=1e-6)


def test_probe_works_on_a_module_that_takes_only_its_own_dtype() -> None:
    fit = _probe(_Bf16OnlyRMSNorm(16), dtype=torch.bfloat16)
    assert fit.centered is False
    assert fit.gain is not None
    torch.testing.assert_close(fit.gain.float(), torch.linspace(0.5, 1.5, 16,
                               dtype=torch.bfloat16).float())


def test_a_module_that_is_no_normalization_is_one_sentence() -> None:
    with pytest.raises(ModelLoadError) as e:
        _probe(_NotANorm())
    msg = str(e.value)
    assert "'blocks.1.odd'" in msg and "_NotANorm" in msg and "\n" not in msg


def test_a_version_1_store_reads_gemma_gains_as_raw_weights(
        family_store: Callable[[str], Path], model_dir: Callable[[str], Path],
        tmp_path: Path) -> None:
    """Version 1 stored Gemma's raw weight for `rmsnorm_1p` and no `centered` column."""
    v2 = family_store("gemma")
    v1 = tmp_path / "v1.actdb"
    shutil.copytree(v2, v1)
    con = duckdb.connect(str(v1 / "catalog.duckdb"))
    kinds = con.execute("SELECT site, kind FROM sites").fetchall()
    for col in ("centered",):
        con.execute(f"ALTER TABLE sites DROP COLUMN {col}")
    for col in ("logit_scale", "logit_max_rel_error"):
        con.execute(f"ALTER TABLE models DROP COLUMN {col}")
    con.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    con.close()
    group = zarr.open_group(str(v1 / "tensors.zarr"), mode="r+")
    for site, kind in kinds:
        assert kind == "rmsnorm_1p"
        arr = group[f"models/0/sites/{site}/gain"]
        arr[...] = np.asarray(arr[...]) - 1.0  # what version 1 wrote: the raw weight
    sql = ("SELECT site, position, to_list(normed(vec)) AS y, logit(vec, 5) AS l FROM acts "
           "WHERE prompt_id = 0 ORDER BY site, position")
    with actdb.connect(v2) as a, actdb.connect(v1) as b:
        new, old = a.sql(sql).fetchall(), b.sql(sql).fetchall()
    assert len(new) == len(old) > 0
    for (s1, p1, y1, l1), (s2, p2, y2, l2) in zip(new, old, strict=True):
        assert (s1, p1) == (s2, p2)
        np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-5)
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-5)

    # A new model ingested into the old store is stored and read the version-2 way beside it.
    actdb.ingest(v1, model=str(model_dir("gemma")), prompts=PROMPTS[:1], device="cpu",
                 name="again")
    with actdb.connect(v1) as b:
        pair = b.sql("SELECT a.model, to_list(normed(a.vec)) FROM acts a WHERE prompt_id = 0 "
                     "AND site = 'final' AND position = 2 ORDER BY a.model").fetchall()
    assert [m for m, _ in pair] == ["again", "gemma"]
    np.testing.assert_allclose(pair[0][1], pair[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 16), (5, 3, 8)])
def test_split_is_the_float64_direction_norm_and_mean_in_a_new_buffer(
        shape: tuple[int, ...]) -> None:
    """norms.split, which the ingest runs on every norm input, against NumPy float64: rows with
    a zero or a NaN norm give an all-zero direction; the direction is a new tensor (the ingest
    overwrites it with the rebuilt vector, which must never touch the model's activation)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 40 + 3
    x[1] = 0.0
    x[2, ..., 0] = float("nan")
    before = x.clone()
    direction, norm, mean = norms.split(x)
    ref = x.double().numpy()
    ref_norm = np.linalg.norm(ref, axis=-1)
    np.testing.assert_allclose(norm[3:].double().numpy(), ref_norm[3:], rtol=1e-6)
    np.testing.assert_allclose(mean[3:].double().numpy(), ref.mean(-1)[3:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(direction[3:].double().numpy(),
                               ref[3:] / ref_norm[3:, ..., None], rtol=1e-6, atol=1e-7)
    assert torch.all(direction[:3][~(norm[:3] > 0)] == 0)  # zero and NaN norms
    assert torch.all(direction[0] != 0)
    assert direction.data_ptr() != x.data_ptr() and torch.equal(
        torch.nan_to_num(x), torch.nan_to_num(before))
    # all norms nonzero: the fast path, the same values bit for bit
    y = x[3:].clone()
    ok = norms.split(y)[0]
    assert torch.equal(ok, direction[3:]) and torch.equal(y, before[3:])

    # into a caller's buffer (the ingest reuses one): the same values, in that buffer
    buf = torch.full(shape, 7.0)
    into, _, _ = norms.split(x, out=buf)
    assert into.data_ptr() == buf.data_ptr() and torch.equal(into, direction)


@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("affine", ["none", "gain", "both", "heads"])
def test_apply_in_place_is_the_float64_norm_output(centered: bool, affine: str) -> None:
    """norms.apply_, the ingest's faithfulness check on every stored vector, against the norm
    computed in NumPy float64 from its definition, at magnitudes where eps matters and where
    it does not; it overwrites its input and returns that buffer."""
    gen = torch.Generator().manual_seed(11)
    heads = affine == "heads"
    x = torch.randn(6, 3, 16, generator=gen) if heads else torch.randn(6, 16, generator=gen)
    x = x * torch.tensor([1e-3, 0.1, 1.0, 10.0, 300.0, 1.0]).reshape(6, *([1] * (x.dim() - 1)))
    x = x + 0.25
    gain = (torch.randn(3, 16, generator=gen) if heads else torch.randn(16, generator=gen)
            ) if affine != "none" else None
    bias = torch.randn(16, generator=gen) if affine in ("both", "heads") else None
    eps = 1e-5
    ref = x.double().numpy()
    if centered:
        ref = ref - ref.mean(-1, keepdims=True)
    ref = ref / np.sqrt((ref * ref).mean(-1, keepdims=True) + eps)
    if gain is not None:
        ref = ref * gain.double().numpy()
    if bias is not None:
        ref = ref + bias.double().numpy()
    buf = x.clone()
    out = norms.apply_(centered, buf, gain=gain, bias=bias, eps=eps)
    assert out.data_ptr() == buf.data_ptr()
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=2e-5, atol=2e-5)
    # and equal to the out-of-place form the query side runs
    np.testing.assert_allclose(out.numpy(), norms.apply(centered, x, gain=gain, bias=bias,
                                                        eps=eps).numpy(), rtol=2e-5, atol=2e-5)
