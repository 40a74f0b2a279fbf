"""Independent float64 reference for the query functions (tests only; imports nothing of actdb).

A tiny model is loaded, cast to float64, and run over each prompt ALONE (no padding) with our
own forward hooks on every normalization module: each module's input x and output y are
captured. Everything the tensor functions should return is then computed here in float64
NumPy from those tensors and the model's own weights, following the maths of DESIGN.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .tiny_models import load_tiny_model, norm_modules

LM_FAMILIES = ("gpt2", "llama", "gemma", "gemma2")


@dataclass
class SiteRef:
    """One norm module: its captured inputs/outputs over all tokens and its parameters."""

    module: str
    kind: str  # layernorm | rmsnorm | rmsnorm_1p, from the module class (not from actdb)
    eps: float
    gain: np.ndarray | None  # effective gain: weight, or 1 + weight for Gemma norms
    bias: np.ndarray | None
    x: np.ndarray  # float64 [N, d] or [N, H, d] (per-head q/k norms)
    y: np.ndarray  # the module's real output, same shape

    @property
    def d(self) -> int:
        return self.x.shape[-1]

    def normalized(self, x: np.ndarray) -> np.ndarray:
        """z: the norm's output before gain and bias, from the formula (float64)."""
        d = x.shape[-1]
        if self.kind == "layernorm":
            xc = x - x.mean(-1, keepdims=True)
            return xc / np.sqrt((xc * xc).sum(-1, keepdims=True) / d + self.eps)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) / d + self.eps)

    def normed(self, x: np.ndarray) -> np.ndarray:
        """y = gain * z + bias (float64)."""
        y = self.normalized(x)
        if self.gain is not None:
            y = y * self.gain
        if self.bias is not None:
            y = y + self.bias
        return y


@dataclass
class FamilyRef:
    family: str
    model: torch.nn.Module
    tokenizer: object
    prompts: list[str]
    input_ids: list[list[int]]
    offsets: list[int]  # first reference row of each prompt
    sites: dict[str, SiteRef]  # by module path
    W_E: np.ndarray
    W_U: np.ndarray | None = None
    b_U: np.ndarray | None = None
    logits: np.ndarray | None = None  # model(**enc).logits, float64 [N, V]
    final_module: str | None = None
    softcap: float | None = None  # the model's final logit soft-cap (Gemma 2), from its config
    _anchors: dict[str, np.ndarray] = field(default_factory=dict)

    # -- rows -----------------------------------------------------------------------------

    def rows(self, prompt_id, position) -> np.ndarray:
        """Reference row index of each (prompt_id, position)."""
        p = np.asarray(prompt_id, dtype=np.int64)
        pos = np.asarray(position, dtype=np.int64)
        n = np.asarray([len(ids) for ids in self.input_ids])
        assert np.all(pos < n[p]), "position past the end of its prompt"
        return np.asarray(self.offsets)[p] + pos

    def per_site(self, site_modules, prompt_id, position, fn, head=None) -> np.ndarray:
        """Apply fn(site_ref, x_rows [m, d]) group-wise over sites; results in input order."""
        site_modules = np.asarray(site_modules, dtype=object)
        rows = self.rows(prompt_id, position)
        results: dict[int, object] = {}
        for module in dict.fromkeys(site_modules.tolist()):
            sel = np.nonzero(site_modules == module)[0]
            s = self.sites[module]
            x = s.x[rows[sel]]
            if x.ndim == 3:
                assert head is not None, "per-head site needs a head"
                x = x[np.arange(len(sel)), np.asarray(head)[sel].astype(np.int64)]
            vals = fn(s, x)
            for j, i in enumerate(sel):
                results[int(i)] = vals[j]
        out = [results[i] for i in range(len(site_modules))]
        return np.asarray(out)

    # -- weights --------------------------------------------------------------------------

    @property
    def final(self) -> SiteRef:
        assert self.final_module is not None
        return self.sites[self.final_module]

    def anchors(self, name: str) -> np.ndarray:
        """Unit anchor rows [V, d] (zero rows stay zero)."""
        if name not in self._anchors:
            if name == "embed":
                w = self.W_E.copy()
            else:
                assert self.W_U is not None
                w = self.W_U.copy()
                if name == "unembed_folded":
                    f = self.final
                    w = w * (f.gain if f.gain is not None else 1.0)
                    if f.kind == "layernorm":
                        w = w - w.mean(-1, keepdims=True)
            n = np.linalg.norm(w, axis=-1, keepdims=True)
            self._anchors[name] = w / np.where(n > 0, n, 1.0)
        return self._anchors[name]

    def transform(self, pre: np.ndarray) -> np.ndarray:
        """The model's own logits from W_U . h + b_U (its soft-cap, as transformers applies it)."""
        return self.softcap * np.tanh(pre / self.softcap) if self.softcap else pre

    def lens_logits(self, x: np.ndarray) -> np.ndarray:
        """float64 [n, V]: the logit lens of residual inputs x [n, d] through the final norm."""
        assert self.W_U is not None
        pre = self.final.normed(x) @ self.W_U.T
        return self.transform(pre + (self.b_U if self.b_U is not None else 0.0))

    def logit(self, h: np.ndarray, token_ids) -> np.ndarray:
        """W_U[t] . h + b_U[t] for final-normed rows h [n, d] and a token id per row."""
        assert self.W_U is not None
        t = np.broadcast_to(np.asarray(token_ids, dtype=np.int64), (h.shape[0],))
        b = self.b_U[t] if self.b_U is not None else 0.0
        return (self.W_U[t] * h).sum(-1) + b


# -- maths ---------------------------------------------------------------------------------


def unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


def cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (unit(a) * unit(b)).sum(-1)


def degrees(cos: np.ndarray) -> np.ndarray:
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))


def uniform_angle(x: np.ndarray) -> np.ndarray:
    return degrees(cos_rows(x, np.ones_like(x)))


# -- building the reference -----------------------------------------------------------------


def _kind(module: torch.nn.Module) -> str:
    if isinstance(module, torch.nn.LayerNorm):
        return "layernorm"
    name = type(module).__name__
    if name.startswith("Gemma") and name.endswith("RMSNorm"):
        return "rmsnorm_1p"
    if name.endswith("RMSNorm"):
        return "rmsnorm"
    raise AssertionError(f"unexpected norm class {name}")


def _eps(module: torch.nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(module, attr, None)
        if isinstance(v, int | float):
            return float(v)
    raise AssertionError(f"no eps on {type(module).__name__}")


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(torch.float64).cpu().numpy().copy()


@torch.no_grad()
def build_reference(family: str, model_dir: Path, prompts: list[str]) -> FamilyRef:
    model, tokenizer = load_tiny_model(family, model_dir)
    model = model.to(torch.float64).eval()
    mods = dict(norm_modules(model))
    captured: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {p: [] for p in mods}
    calls: dict[str, int] = {}

    def hook(path):
        def fn(module, args, output):
            calls[path] = calls.get(path, 0) + 1
            if calls[path] > 1:  # only the first call of a forward pass is the site
                return
            y = output[0] if isinstance(output, tuple) else output
            captured[path].append((_np(args[0])[0], _np(y)[0]))  # drop the batch axis

        return fn

    handles = [m.register_forward_hook(hook(p)) for p, m in mods.items()]
    input_ids: list[list[int]] = []
    logits: list[np.ndarray] = []
    try:
        for text in prompts:
            enc = tokenizer(text, return_tensors="pt")
            input_ids.append(enc["input_ids"][0].tolist())
            calls.clear()
            out = model(**enc)
            if family in LM_FAMILIES:
                logits.append(_np(out.logits)[0])
    finally:
        for h in handles:
            h.remove()

    sites: dict[str, SiteRef] = {}
    for path, module in mods.items():
        if not captured[path]:
            continue
        kind = _kind(module)
        weight = _np(getattr(module, "weight", None))
        gain = None if weight is None else (1.0 + weight if kind == "rmsnorm_1p" else weight)
        sites[path] = SiteRef(
            module=path, kind=kind, eps=_eps(module), gain=gain,
            bias=_np(getattr(module, "bias", None)),
            x=np.concatenate([x for x, _ in captured[path]]),
            y=np.concatenate([y for _, y in captured[path]]),
        )
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in input_ids])[:-1]]).tolist()
    ref = FamilyRef(
        family=family, model=model, tokenizer=tokenizer, prompts=list(prompts),
        input_ids=input_ids, offsets=offsets, sites=sites,
        W_E=_np(model.get_input_embeddings().weight),
    )
    if family in LM_FAMILIES:
        head = model.get_output_embeddings()
        ref.W_U = _np(head.weight)
        ref.b_U = _np(getattr(head, "bias", None))
        ref.logits = np.concatenate(logits)
        # The final norm: the last norm module to run, outside the blocks.
        ref.final_module = {"gpt2": "transformer.ln_f"}.get(family, "model.norm")
        ref.softcap = getattr(model.config, "final_logit_softcapping", None)
        assert ref.final_module in sites
        f = sites[ref.final_module]
        b = ref.b_U if ref.b_U is not None else 0.0
        assert np.allclose(ref.transform(f.y @ ref.W_U.T + b), ref.logits, rtol=1e-6,
                           atol=1e-8), (
            f"{family}: the model's logits are not transform(W_U . y_final + b_U)"
        )
    # Self-check of the reference: the formulas reproduce each module's real output.
    for s in sites.values():
        y = s.normed(s.x)
        err = np.linalg.norm(y - s.y, axis=-1) / np.linalg.norm(s.y, axis=-1)
        assert err.max() < 1e-5, f"{family} {s.module}: reference formula off by {err.max()}"
    return ref
