"""Find a model's normalization sites by behaviour, and give each a role and a canonical name.

No per-model table: a site is any `nn.LayerNorm` or module whose class name ends in `RMSNorm`
or `LayerNorm`; its kind is decided by calling it on a probe input and seeing which formula
reproduces the output; its role by where it runs in one forward pass relative to its block's
attention and MLP, and whether its input is the attention output (a post-norm) or the residual.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import torch
from torch import nn

from .. import norms
from ..errors import ModelLoadError
from ..store.records import SiteRecord
from .capture import Call, record_calls

_ATTN = re.compile(r"(^|_)(self_)?(attn|attention|self_attention)$")
_MLP = re.compile(r"^(mlp|feed_forward|ffn|intermediate|feedforward|block_sparse_moe)$")
_Q = re.compile(r"(^|_)(q|query)_?(norm|layernorm|ln)$")
_K = re.compile(r"(^|_)(k|key)_?(norm|layernorm|ln)$")
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "rms_norm_eps")
_SHORT = {"pre_attn": "ln1", "pre_mlp": "ln2", "post_attn": "ln1_post", "post_mlp": "ln2_post",
          "q_norm": "attn.q_norm", "k_norm": "attn.k_norm"}
_KIND_TOLERANCE = 1e-3


@dataclass(frozen=True, kw_only=True)
class FoundSite:
    """A site with the live module it hooks and its parameters."""

    record: SiteRecord
    module: nn.Module
    gain: torch.Tensor | None
    bias: torch.Tensor | None


def is_norm_module(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or name.endswith(("RMSNorm", "LayerNorm"))


def _param(module: nn.Module, name: str) -> torch.Tensor | None:
    p = getattr(module, name, None)
    return p.detach() if isinstance(p, torch.Tensor) else None


def _eps(module: nn.Module) -> float:
    for attr in _EPS_ATTRS:
        v = getattr(module, attr, None)
        if isinstance(v, int | float):
            return float(v)
    return 1e-6


@torch.no_grad()
def probe_kind(module: nn.Module, width: int, eps: float) -> tuple[str, float]:
    """Call the module on a shifted random input; the kind whose formula reproduces it wins."""
    p = next(module.parameters(), None)
    dtype = p.dtype if p is not None else torch.float32
    device = p.device if p is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(3, 5, width, generator=gen) * 2.0 + 0.75  # off-centre tells LN from RMS
    y = module(x.to(device=device, dtype=dtype))
    y = (y[0] if isinstance(y, tuple) else y).float().cpu()
    gain, bias = _param(module, "weight"), _param(module, "bias")
    g = gain.float().cpu() if gain is not None else None
    b = bias.float().cpu() if bias is not None else None
    best, best_err = "", float("inf")
    for kind in norms.KINDS:
        ref = norms.apply(kind, x, gain=g, bias=b, eps=eps)
        err = float((ref - y).norm() / y.norm().clamp_min(1e-12))
        if err < best_err:
            best, best_err = kind, err
    return best, best_err


def _block_list(model: nn.Module, norm_paths: list[str]) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of transformer blocks: the one holding the most norm modules."""
    best: tuple[str, nn.ModuleList] | None = None
    best_count = 0
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            count = sum(1 for n in norm_paths if n.startswith(path + "."))
            if count > best_count:
                best, best_count = (path, m), count
    return best


def _children_matching(block: nn.Module, pattern: re.Pattern[str]) -> list[str]:
    return [n for n, c in block.named_children() if pattern.search(n) and not is_norm_module(c)]


def _role(
    leaf: str, call: Call, attn: Call | None, mlp: Call | None, in_attn: bool, in_mlp: bool
) -> str:
    if _Q.search(leaf):
        return "q_norm"
    if _K.search(leaf):
        return "k_norm"
    if in_attn:
        return "post_attn"  # e.g. BERT's attention.output.LayerNorm(residual + attn)
    if in_mlp:
        return "post_mlp"
    if attn is None:
        return "other"
    if call.start < attn.start:
        return "pre_attn"
    if mlp is None or call.start < mlp.start:
        # Between the sublayers: a norm whose output feeds the MLP is its pre-norm (whatever
        # its name, e.g. Llama's post_attention_layernorm); one that does not, normalizes
        # the attention output (Gemma 2, OLMo 2).
        if mlp is not None and _same(call.output, mlp.input):
            return "pre_mlp"
        if mlp is None or mlp.input is None:
            return "post_attn" if _same(call.input, attn.output) else "pre_mlp"
        return "post_attn"
    return "post_mlp"


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def find_sites(
    model: nn.Module, sample: dict[str, torch.Tensor], *, sites_glob: str | None = None
) -> tuple[list[FoundSite], int]:
    """All norm sites of `model` in call order, and the number of blocks.

    `sample` is a tokenized batch to run once; `sites_glob` (comma-separated globs matched
    against canonical names and module paths) keeps a subset.
    """
    norm_modules = {p: m for p, m in model.named_modules() if p and is_norm_module(m)}
    # A norm nested inside another norm module is part of it, not a site of its own.
    norm_modules = {
        p: m for p, m in norm_modules.items()
        if not any(p.startswith(q + ".") for q in norm_modules if q != p)
    }
    if not norm_modules:
        raise ModelLoadError(
            f"model {type(model).__name__!r} has no normalization modules (no nn.LayerNorm, "
            "and no module whose class name ends in 'RMSNorm' or 'LayerNorm')"
        )
    blocks = _block_list(model, list(norm_modules))
    block_path, block_list = blocks if blocks else ("", nn.ModuleList())
    watched: dict[str, nn.Module] = dict(norm_modules)
    for i, block in enumerate(block_list):
        prefix = f"{block_path}.{i}"
        watched[prefix] = block
        for child in _children_matching(block, _ATTN) + _children_matching(block, _MLP):
            watched[f"{prefix}.{child}"] = getattr(block, child)

    with torch.no_grad(), record_calls(watched) as log:
        model(**sample)

    block_calls = [log.calls.get(f"{block_path}.{i}", [None])[0] for i in range(len(block_list))]
    first_block = min((c.start for c in block_calls if c), default=0)
    n_layers = len(block_list)
    found: list[tuple[int, SiteRecord, nn.Module]] = []
    used: set[str] = set()
    for path, module in norm_modules.items():
        calls = log.calls.get(path)
        if not calls or calls[0].input is None:
            continue  # never runs in a forward pass: nothing to capture
        call = calls[0]
        assert call.input is not None
        leaf = path.rsplit(".", 1)[-1]
        layer, role = _place(path, call, log.calls, block_path, n_layers, first_block, leaf)
        short = _SHORT.get(role, leaf)
        name = role if role in ("embed", "final") else (
            f"blocks.{layer}.{short}" if 0 <= layer < n_layers else leaf
        )
        base, k = name, 2
        while name in used:
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        eps = _eps(module)
        width = call.input.shape[-1]
        kind, err = probe_kind(module, width, eps)
        if err > _KIND_TOLERANCE:
            raise ModelLoadError(
                f"norm module {path!r} ({type(module).__name__}) matches none of the kinds "
                f"{norms.KINDS} (best {kind!r}, relative error {err:.2g})"
            )
        heads = call.input.shape[-2] if call.input.dim() == 4 else None
        gain, bias = _param(module, "weight"), _param(module, "bias")
        rec = SiteRecord(
            site=name, site_id=0, layer=layer, role=role, kind=kind, d=int(width),
            n_heads=int(heads) if heads else None, eps=eps, module=path,
            has_gain=gain is not None, has_bias=bias is not None,
        )
        found.append((call.start, rec, module))

    found.sort(key=lambda t: t[0])
    globs = [g.strip() for g in sites_glob.split(",")] if sites_glob else None
    out: list[FoundSite] = []
    for _, rec, module in found:
        if globs and not any(
            fnmatch.fnmatchcase(rec.site, g) or fnmatch.fnmatchcase(rec.module, g) for g in globs
        ):
            continue
        rec = SiteRecord(**{**rec.__dict__, "site_id": len(out)})
        out.append(FoundSite(
            record=rec, module=module, gain=_param(module, "weight"), bias=_param(module, "bias")
        ))
    if not out:
        raise ModelLoadError(f"no norm site matches --sites {sites_glob!r}")
    return out, n_layers


def _place(
    path: str,
    call: Call,
    calls: dict[str, list[Call]],
    block_path: str,
    n_layers: int,
    first_block: int,
    leaf: str,
) -> tuple[int, str]:
    """(layer, role) of a norm from where it ran."""
    m = re.match(re.escape(block_path) + r"\.(\d+)\.(.*)$", path) if block_path else None
    if m is None:
        if call.start < first_block:
            return -1, "embed"
        return n_layers, "final"
    layer, rest = int(m.group(1)), m.group(2)
    prefix = f"{block_path}.{layer}"
    attn_name = next((k for k in calls if k.startswith(prefix + ".") and _ATTN.search(
        k[len(prefix) + 1:])), None)
    mlp_name = next((k for k in calls if k.startswith(prefix + ".") and _MLP.search(
        k[len(prefix) + 1:])), None)
    attn = calls[attn_name][0] if attn_name else None
    mlp = calls[mlp_name][0] if mlp_name else None
    in_attn = attn_name is not None and rest.startswith(attn_name[len(prefix) + 1:] + ".")
    in_mlp = mlp_name is not None and rest.startswith(mlp_name[len(prefix) + 1:] + ".")
    return layer, _role(leaf, call, attn, mlp, in_attn, in_mlp)
