"""Find a model's normalization sites by behaviour, and give each a role and a canonical name.

No per-model table: a site is any `nn.LayerNorm` or module whose class name ends in `RMSNorm`
or `LayerNorm`; what it computes is measured by probing it (probe.py); its layout (token and
head axes) from its input shapes at two sequence lengths; its role by where it runs in one
forward pass relative to its block's attention and MLP, whether its input is the attention
output (a post-norm) or the residual, and whether its output feeds a projection of its own
sublayer (`inner`: a latent's norm, a sub-norm before an output projection).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..errors import ActdbError, ModelLoadError
from ..store.records import SiteRecord
from .blocks import Blocks, batch_dims, head_lists, is_norm_module, stack_of, token_layout
from .blocks import block_sublayers as block_sublayers  # weights.py imports it from here
from .blocks import is_projection as is_projection  # weights.py imports it from here
from .capture import Call, record_calls
from .inputs import takes
from .layouts import check_repeatable, check_same_again, image_layout, width_of
from .probe import measure_norm
from .roles import K_NORM, Q_NORM, carried, decoder_role, feeds, place_role
from .towers import Tower, find_towers, main_tower, site_prefix

_SHORT = {"pre_attn": "ln1", "pre_mlp": "ln2", "post_attn": "ln1_post", "post_mlp": "ln2_post",
          "pre_cross": "ln_cross", "post_cross": "ln_cross_post",
          "q_norm": "attn.q_norm", "k_norm": "attn.k_norm"}


@dataclass(frozen=True, kw_only=True)
class FoundSite:
    """A site with the live modules it hooks (one, or one per head) and its measured affine.

    `layout` says where tokens and heads sit in the hooked input: `btd` ([B, T, d] or its
    [B*T, d] flattening), `bthd`, `bhtd`, `list` (one module per head, each laid out as
    `member_layout`, e.g. [B, T, d], or [B, 1, T, d] for StableLM's per-head LayerNorms), or
    a feature map of an image's positions, `bhwc` or `bchw` (grids.py).
    """

    record: SiteRecord
    hooks: tuple[tuple[str, nn.Module], ...]
    layout: str
    member_layout: str = "btd"
    gain: torch.Tensor | None  # float64 [d], or [heads, d] for a list of per-head modules
    bias: torch.Tensor | None
    # positions an input gives it where that is fixed by the input's size (an image's
    # patches and class token), not by a token count; None for token sequences
    positions: int | None = None
    shape: tuple[int, int] | None = None  # a feature map's (H, W): layouts bhwc and bchw

    @property
    def module(self) -> nn.Module:
        return self.hooks[0][1]


def outside_base(model: nn.Module, paths: list[str]) -> bool:
    """Whether a norm module at one of `paths` lies outside the model's base model (BERT- and
    RoBERTa-style causal LMs hold a LayerNorm in their LM head, which runs after it)."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    base = getattr(model, "base_model", None)
    return (bool(prefix) and isinstance(base, nn.Module) and base is not model
            and not all(p.startswith(prefix + ".") for p in paths))


def forward_module(model: nn.Module, paths: list[str]) -> nn.Module:
    """The module a pass that must reach the norm modules at `paths` runs: the base model where
    every one is inside it (the LM head's product at every position is a tenth of a second for
    a 50k vocabulary on a CPU), else the whole model."""
    base = getattr(model, "base_model", None)
    if outside_base(model, paths) or not isinstance(base, nn.Module):
        return model
    return base


class FinalProbe(Protocol):
    """What may ride on find_sites' second pass (logits.py's LogitFit): that pass is then the
    probe's own forward pass of the whole model, hooked on the final norm, so the logit fit
    costs no forward pass of its own."""

    def run(self, model: nn.Module, module: nn.Module, path: str,
            sample: Mapping[str, torch.Tensor]) -> None: ...


@contextmanager
def _probing(model: nn.Module, sample: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """A probe pass: a model that fails on token ids alone (or on its processor's inputs)
    is refused in one sentence, not with its own traceback."""
    try:
        yield
    except (ActdbError, torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - the model's own failure, said in one sentence
        first = (str(e).strip().splitlines() or [""])[0]
        # an encoder-decoder actdb knows reads decoder tokens in the sample too (seq2seq.py):
        # its failure is over inputs beside those (UDOP's boxes of words on a page)
        why = ("; encoder-decoder models, which need decoder inputs too, are not supported"
               if getattr(getattr(model, "config", None), "is_encoder_decoder", False)
               and "decoder_input_ids" not in sample else "")
        if "input_ids" not in sample:
            raise ModelLoadError(
                f"model {type(model).__name__!r} fails on a forward pass over the inputs its "
                f"processor made ({', '.join(sample)}: {type(e).__name__}: {first}); are "
                "they what it was built for (image size, number of frames)?") from e
        raise ModelLoadError(
            f"model {type(model).__name__!r} fails on a forward pass over token ids "
            f"({type(e).__name__}: {first}); actdb runs it on {_listed(list(sample))} "
            f"alone{why}"
        ) from e


def _listed(names: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _final_path(log: dict[str, list[Call]], norm_paths: list[str], blocks: Blocks,
                first_block: int, *, last_block: bool = False) -> str | None:
    """The norm module whose output the LM head reads: the last to run outside the blocks,
    after the first block. `_place` calls every such norm a final site; where there are
    several (RoBERTa-PreLayerNorm: the base model's last LayerNorm, then one inside its LM
    head, after a dense layer), the logits come from the last, named `final` (the others
    `final_1`, `final_2`, ... in call order). A model whose blocks are sibling lists (XLM,
    post-norm) runs no norm after them: its head reads the last norm to run, when that is in
    the last block; so does a post-norm encoder-decoder's decoder (BART, Marian:
    `last_block`)."""
    ran = [(log[p][0].start, p) for p in norm_paths
           if log.get(p) and log[p][0].input is not None]
    outside = [(t, p) for t, p in ran if t >= first_block and blocks.place(p) is None]
    if outside:
        return max(outside)[1]
    if (blocks.siblings or last_block) and ran:
        last = max(ran)[1]
        at = blocks.place(last)
        if at is not None and at[0] == blocks.n - 1:
            return last
    return None


def _reads(model: nn.Module) -> str:
    """What a model that is one tower reads, which names the tower."""
    kinds = takes(model)
    return next((k for k in ("text", "vision", "audio") if k in kinds or (
        k == "vision" and ("image" in kinds or "video" in kinds))), "text")


def norm_modules_of(model: nn.Module) -> dict[str, nn.Module]:
    """The model's norm modules by path; one sentence where it has none."""
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
    return norm_modules


def find_sites(
    model: nn.Module,
    sample: dict[str, torch.Tensor],
    sample_alt: dict[str, torch.Tensor],
    *,
    sites_glob: str | None = None,
    final_probe: FinalProbe | None = None,
    depths: dict[str, int] | None = None,
    fixed_towers: tuple[str, ...] = (),
) -> tuple[list[FoundSite], int]:
    """All norm sites of `model` in call order, and the number of blocks.

    `sample` and `sample_alt` are unpadded batches of the same batch size and different
    lengths (the layouts of per-head inputs are read from how their shapes follow the
    length); `sites_glob` (comma-separated globs matched against canonical names and module
    paths) keeps a subset. With `final_probe`, the second pass is the probe's own pass of the
    whole model, hooked on the final norm. `depths`, where given, gets each tower's depth
    (towers.py); the number of blocks returned is the main tower's. `fixed_towers`: towers
    whose positions an input's size fixes though the samples hold text (the vision tower of a
    multimodal decoder over text and images together).
    """
    norm_modules = norm_modules_of(model)
    lists = head_lists(norm_modules, model)
    # Roles and layers are assigned within each tower (a multimodal model's vision tower and
    # text decoder), whatever the depth of the others.
    towers = find_towers(model, list(norm_modules), single=_reads(model))
    tower_of = {p: next(t for t in towers if t.holds(p)) for p in norm_modules}
    watched: dict[str, nn.Module] = dict(norm_modules)
    stacks = {t: stack_of(model, [p for p in norm_modules if tower_of[p] == t], watched)
              for t in towers}

    target = forward_module(model, list(norm_modules))
    with torch.no_grad(), record_calls(watched) as log, _probing(model, sample):
        target(**sample)
    finals: dict[Tower, str | None] = {}
    for t, st in stacks.items():
        block_calls = [log.calls.get(path, [None])[0]
                       for i in range(st.blocks.n) for path, _ in st.blocks.parts(model, i)]
        st.first_block = min((c.start for c in block_calls if c), default=0)
        finals[t] = _final_path(log.calls, [p for p in norm_modules if tower_of[p] == t],
                                st.blocks, st.first_block, last_block=t.name == "decoder")
    main = main_tower(towers)
    final_path = finals[main]
    if depths is not None:
        depths.update({t.name: st.blocks.n for t, st in stacks.items()})
    with torch.no_grad(), record_calls(norm_modules) as log_alt, _probing(model, sample_alt):
        if final_probe is not None and final_path is not None:
            # its inputs' shapes are recorded before the probe replaces its output
            final_probe.run(model, norm_modules[final_path], final_path, sample_alt)
        else:
            target(**sample_alt)

    n_layers = stacks[main].blocks.n
    norm_calls = [c[0] for p, c in log.calls.items() if p in norm_modules and c]
    globs = [g.strip() for g in sites_glob.split(",")] if sites_glob else None
    found: list[tuple[int, SiteRecord, FoundSite]] = []
    used: set[str] = set()
    in_list = {c: lp for lp, children in lists.items() for c in children}
    for path in norm_modules:
        calls = log.calls.get(path)
        if not calls or calls[0].input is None:
            continue  # never runs in a forward pass: nothing to capture
        shape_in, given = tuple(calls[0].input.shape), calls[0].output
        if given is not None and shape_in[-1] > 1 and tuple(given.shape) == (*shape_in[:-1], 1):
            # not a vector normalized but a factor a row: a helper named like a norm (HY-V4's
            # unweighted RMSNorm returns each row's 1 / rms for its caller to multiply by)
            continue
        if path in in_list and not path.endswith(".0"):
            continue  # a per-head list is one site, found at its first head
        call = calls[0]
        assert call.input is not None
        alt = log_alt.calls.get(path)
        shape2 = tuple(alt[0].input.shape) if alt and alt[0].input is not None else ()
        site_path = in_list.get(path, path)
        fixed = None
        shape: tuple[int, int] | None = None
        layout: tuple[str, int | None] | None
        b, t1 = batch_dims(sample, tower_of[path].name)
        b2, t2 = batch_dims(sample_alt, tower_of[path].name)
        by_size = t1 is None or t2 is None or tower_of[path].name in fixed_towers
        if by_size:
            # a feature map is measured, where it is not a per-head norm's [B, heads, T, d]
            fixed, shape = image_layout(
                norm_modules[path], call.input, shape2, b, b2,
                maps=not any(p.search(site_path.rsplit(".", 1)[-1]) for p in (Q_NORM, K_NORM)))
            if fixed is not None:
                order = check_repeatable(model, path, call.input,
                                         alt[0].input if alt else None, fixed[0], b, b2)
                fixed = (order, fixed[1])
            layout = None if fixed is None else (fixed[0], None)
        else:
            assert t1 is not None and t2 is not None
            layout = token_layout(tuple(call.input.shape), shape2, b, t1, t2, b2)
        if layout is None and alt and alt[0].input is not None and shape2 == shape_in and (
                torch.equal(call.input, alt[0].input)):
            # the same input for both probe batches, whose tokens differ: no token in it
            # (DeBERTa-v3 normalizes its table of relative-position embeddings), so no site.
            # Tokens in a layout actdb does not know (a model padding every input to one
            # length) differ between the batches: refused below.
            continue
        # A per-head list's own name may be generic (StableLM's q_layernorm.norms).
        leaf = ".".join(site_path.rsplit(".", 2)[-2:]) if site_path != path else (
            site_path.rsplit(".", 1)[-1])
        if leaf.isdigit():  # an entry of a list of one norm a block: named by its list
            leaf = site_path.rsplit(".", 2)[-2]
        tower = tower_of[path]
        st = stacks[tower]
        layer, role = _place(site_path, call, log.calls, st.blocks, st.first_block, leaf,
                             st.sublayers, final=site_path == finals[tower],
                             norm_calls=norm_calls, bare=st.bare)
        short = _SHORT.get(role, leaf)
        name = site_prefix(tower, towers) + (role if role in ("embed", "final") else (
            f"blocks.{layer}.{short}" if 0 <= layer < st.blocks.n else leaf
        ))
        if layout is None and globs and not any(
                fnmatch.fnmatchcase(site_path, g) or fnmatch.fnmatchcase(name, g)
                for g in globs):
            continue  # left out by the site filter (by its name or its module path)
        if layout is None:
            with _probing(model, sample):
                check_same_again(model, target, sample, path, norm_modules[path], call.input)
        if layout is None and by_size:
            raise ModelLoadError(
                f"norm module {path!r} sees inputs of shape {tuple(call.input.shape)} for a "
                f"batch of {b} inputs (and {shape2} for {b2}); for images actdb knows the "
                "layouts [B, T, d], [B*T, d] and feature maps [B, H, W, C] and [B, C, H, W] "
                "normalized over C: leave it out with --sites")
        if layout is None:
            raise ModelLoadError(
                f"norm module {path!r} sees inputs of shape {tuple(call.input.shape)} for a "
                f"batch of {b} x {t1} tokens (and {shape2} for {b2} x {t2}); actdb knows the "
                "layouts [B, T, d], [B*T, d], [B, T, H, d], [B*T, H, d], [B, H, T, d] and "
                "per-head lists"
            )
        kind_layout, heads = layout
        member_layout = kind_layout
        members = [site_path] if site_path == path else lists[site_path]
        if site_path != path:
            if heads not in (None, 1):
                raise ModelLoadError(f"per-head norm module {path!r} sees {heads} heads")
            kind_layout, heads = "list", len(members)
        base, k = name, 2
        while name in used:
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        width = width_of(call.input, kind_layout)
        fits = [measure_norm(norm_modules[m], width, dtype=call.input.dtype,
                             device=call.input.device, name=m,
                             heads=heads if kind_layout != "list" else None,
                             layout=member_layout if kind_layout == "list" else kind_layout)
                for m in members]
        fit = fits[0]
        if any(f.centered != fit.centered or f.eps != fit.eps for f in fits):
            raise ModelLoadError(
                f"per-head norm modules {site_path!r} differ in centring or eps; actdb stores "
                "one formula per site"
            )
        gain, bias = fit.gain, fit.bias
        if len(fits) > 1:
            ones, zeros = torch.ones(width, dtype=torch.float64), torch.zeros(width,
                                                                              dtype=torch.float64)
            gains = [f.gain for f in fits]
            biases = [f.bias for f in fits]
            gain = None if all(g is None for g in gains) else torch.stack(
                [ones if g is None else g for g in gains])
            bias = None if all(v is None for v in biases) else torch.stack(
                [zeros if v is None else v for v in biases])
        rec = SiteRecord(
            site=name, site_id=0, layer=layer, role=role, kind=fit.kind, d=width,
            n_heads=int(heads) if heads else None, eps=fit.eps, module=site_path,
            has_gain=gain is not None, has_bias=bias is not None, centered=fit.centered,
            layout=kind_layout, tower=tower.name,
        )
        hooks = tuple((m, norm_modules[m]) for m in members)
        found.append((call.start, rec, FoundSite(record=rec, hooks=hooks, layout=kind_layout,
                                                 member_layout=member_layout, gain=gain,
                                                 bias=bias,
                                                 positions=fixed[1] if fixed else None,
                                                 shape=shape)))

    found.sort(key=lambda t: t[0])
    # The norm the LM head reads, the last final site in call order, is `final`; norms before
    # it outside the blocks (ModernBERT's and RoBERTa-PreLayerNorm's base-model final norm,
    # before the LM head's own) are final_1, final_2, ...: a query of site = 'final' meets
    # the model's logits. Named before the site filter, so that names do not depend on it.
    # So in each tower: its own name first where it is not the main one (`vision.final`).
    for t in towers:
        prefix = site_prefix(t, towers)
        last = [i for i, (_, rec, _) in enumerate(found)
                if rec.role == "final" and rec.tower == t.name]
        for n, i in enumerate(last):
            start, rec, f = found[i]
            rec = dataclasses.replace(
                rec, site=prefix + ("final" if i == last[-1] else f"final_{n + 1}"))
            found[i] = (start, rec, dataclasses.replace(f, record=rec))
    out: list[FoundSite] = []
    for _, rec, f in found:
        if globs and not any(
            fnmatch.fnmatchcase(rec.site, g) or fnmatch.fnmatchcase(rec.module, g) for g in globs
        ):
            continue
        rec = SiteRecord(**{**rec.__dict__, "site_id": len(out)})
        out.append(FoundSite(record=rec, hooks=f.hooks, layout=f.layout,
                             member_layout=f.member_layout, gain=f.gain, bias=f.bias,
                             positions=f.positions, shape=f.shape))
    if not out:
        raise ModelLoadError(f"no norm site matches --sites {sites_glob!r}")
    runs = {f.record.site: max(len(log.calls.get(p, ())) for p, _ in f.hooks) for f in out}
    again = [f.record for f in out if runs[f.record.site] > 1]
    if again:
        # A site is one vector a token: which run's would be stored (the hook keeps the first)
        # is not the one the model goes on with (HRM's recurrent modules run 2-6 times).
        first = again[0]
        raise ModelLoadError(
            f"norm module {first.module!r} (site {first.site!r}) runs {runs[first.site]} times "
            f"in one forward pass, as {len(again)} of the {len(out)} sites' modules do (a "
            "recurrent or weight-shared model): actdb stores one vector a token and site, and "
            "cannot store which run the model reads on; leave such sites out with --sites")
    return out, n_layers


def _place(
    path: str,
    call: Call,
    calls: dict[str, list[Call]],
    blocks: Blocks,
    first_block: int,
    leaf: str,
    sublayers: dict[str, tuple[str, int]],
    *,
    final: bool = False,
    norm_calls: list[Call] | None = None,
    bare: Mapping[int, list[str]] | None = None,
) -> tuple[int, str]:
    """(layer, role) of a norm from where it ran and where its output went; `final`: the
    norm the LM head reads (`_final_path`), a final site wherever it is; `norm_calls`: every
    norm module's first call, to tell a post-norm block's mid-block norm from a pre-MLP norm;
    `bare`:
    each block's own projections, where its MLP is no module (they stand for it when called
    after its attention)."""
    at = blocks.place(path)
    if at is None and not final and blocks.lengths and call.start > first_block:
        # between a hierarchical model's stages (Swin's patch merging, ConvNeXt's
        # downsampling): no block's and no final norm, at the layer of the block after it
        following = next((i for i in range(blocks.n) if any(
            calls.get(p) and calls[p][0].start > call.start for p in blocks.block_paths(i))),
            None)
        if following is not None:
            return following, "other"
    if at is None or final:
        if at is None and call.start < first_block:
            return -1, "embed"
        return blocks.n, "final"
    layer = at[0]
    attn_name = next((k for k, (v, i) in sublayers.items() if v == "attn" and i == layer
                      and k in calls), None)
    mlp_name = next((k for k, (v, i) in sublayers.items() if v == "mlp" and i == layer
                     and k in calls), None)
    attn = calls[attn_name][0] if attn_name else None
    mlp = calls[mlp_name][0] if mlp_name else None
    if mlp is None and bare and layer in bare:
        after = sorted((c[0] for k in bare[layer] if (c := calls.get(k))
                        and (attn is None or c[0].start > attn.end)), key=lambda c: c.start)
        if after:  # from the first projection's input to the last one's output
            mlp = Call(start=after[0].start, end=after[-1].end, input=after[0].input,
                       output=after[-1].output)
    cross_name = next((k for k, (v, i) in sublayers.items() if v == "cross" and i == layer
                       and k in calls), None)
    inside = next((k for k in (attn_name, cross_name, mlp_name)
                   if k and path.startswith(k + ".")), None)
    if cross_name is not None and attn is not None and inside is None:
        ran = calls.get(f"{blocks.paths[0]}.{layer}") if len(blocks.paths) == 1 else None
        block = ran[0] if ran else None
        return layer, decoder_role(call, attn, calls[cross_name][0], mlp, block, norm_calls)
    sublayer = sublayers[inside][0] if inside else None
    if sublayer == "cross":
        sublayer = "attn"  # a norm inside the cross-attention: its own output feeds it
    feeds_inside = inside is not None and any(
        feeds(call.output, c[0].input) for k, c in calls.items()
        if k.startswith(inside + ".") and k not in sublayers and c
    )
    role = place_role(leaf, call, attn, mlp, sublayer, feeds_inside)
    if role == "pre_mlp" and mlp is not None and norm_calls and carried(
            call, mlp, norm_calls):
        role = "post_attn"
    return layer, role


