"""A model's structure as modules: which modules are norms, where the transformer blocks
are (one ModuleList of blocks, XLM's sibling lists whose i-th entries are block i, or a
hierarchical model's stages' lists one after the other), which lists of norms are one per-head
site each, a block's attention and MLP modules, and a site's token layout (token and head
axes) from its input shapes at two sizes. sites.py places and names the sites in it
(layouts.py reads where an image's positions sit in a site's input)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

ATTN = re.compile(r"(^|_)(self_)?(attn|attention|self_attention)$"
                  r"|^(Local|TransientGlobal)?SelfAttention$")  # T5's, LongT5's
# A decoder block's attention over the encoder's output (BART's, Whisper's, T5's).
CROSS = re.compile(r"^(encoder_attn|EncDecAttention|cross_attn|cross_attention|crossattention)$")
MLP = re.compile(r"^(mlp|feed_forward|ffn|intermediate|feedforward|block_sparse_moe"
                 r"|DenseReluDense)$")


def is_norm_module(module: nn.Module) -> bool:
    """An nn.LayerNorm, or a module named like a norm that holds no layers of a block (Wav2Vec2
    names its encoder and its blocks for their layout: Wav2Vec2EncoderStableLayerNorm,
    Wav2Vec2EncoderLayerStableLayerNorm, which hold attention and projections). The norm's own
    weight is no projection's, even as a matrix (Cohere's per-head q_norm: [heads, d_head])."""
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or (
        name.endswith(("RMSNorm", "LayerNorm"))
        and not any(isinstance(m, nn.ModuleList) or is_projection(m)
                    for m in module.modules() if m is not module))


def is_projection(module: nn.Module) -> bool:
    """A leaf with a matrix weight (nn.Linear, GPT-2's Conv1D, ...)."""
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and not any(module.children())


def list_at(model: nn.Module, path: str) -> nn.ModuleList:
    m = model.get_submodule(path)
    assert isinstance(m, nn.ModuleList), path
    return m


def norm_lists(norms_by_path: dict[str, nn.Module], model: nn.Module) -> list[str]:
    """ModuleLists whose children are all norm modules."""
    return [path for path, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) > 1
            and all(f"{path}.{i}" in norms_by_path for i in range(len(m)))]


def layer_lists(model: nn.Module, path: str) -> list[str]:
    """The ModuleList at `path` and its sibling ModuleLists of the same length, in their
    parent's order, where one of them holds something other than norm modules: XLM keeps a
    block's parts side by side (`attentions[i]`, `layer_norm1[i]`, `ffns[i]`,
    `layer_norm2[i]`), so that index i across them is block i. Empty for a list without such
    siblings."""
    parent_path, _, _ = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    n = len(list_at(model, path))
    prefix = parent_path + "." if parent_path else ""
    lists = [(prefix + name, m) for name, m in parent.named_children()
             if isinstance(m, nn.ModuleList) and len(m) == n]
    if not any(not is_norm_module(c) for _, m in lists for c in m):
        return []
    return [p for p, _ in lists]


def head_lists(norms_by_path: dict[str, nn.Module], model: nn.Module) -> dict[str, list[str]]:
    """ModuleLists of norm modules that are one per-head site each: those that are not one
    norm a block (`layer_lists`)."""
    return {path: [f"{path}.{i}" for i in range(len(list_at(model, path)))]
            for path in norm_lists(norms_by_path, model) if not layer_lists(model, path)}


def batch_dims(sample: Mapping[str, torch.Tensor], tower: str | None = None
               ) -> tuple[int, int | None]:
    """(batch size, token count) of a probe batch (`tower`: the decoder's of an
    encoder-decoder, which reads its own tokens); the count is None for inputs whose
    positions are fixed by their size (images, sounds), which probe at two batch sizes
    instead."""
    ids = sample.get("decoder_input_ids" if tower == "decoder" else "input_ids")
    if ids is not None:
        return int(ids.shape[0]), int(ids.shape[1])
    first = next(v for v in sample.values() if isinstance(v, torch.Tensor))
    return int(first.shape[0]), None


def token_layout(shape1: tuple[int, ...], shape2: tuple[int, ...], b: int, t1: int, t2: int,
                 b2: int | None = None) -> tuple[str, int | None] | None:
    """(layout, heads) from the input shapes at two sequence lengths (and batch sizes `b`,
    `b2`; the same where `b2` is None): the axis that follows the length is the token axis,
    so a head count equal to B or T cannot mislead."""
    if b2 is not None and b2 != b:  # told apart by the lengths alone: [B, T, d] or [B*T, d]
        if len(shape1) == 3 and shape1[:2] == (b, t1) and shape2[:2] == (b2, t2):
            return "btd", None
        if len(shape1) == 2 and shape1[0] == b * t1 and shape2[0] == b2 * t2:
            return "btd", None
        if len(shape1) == 4 and len(shape2) == 4 and (shape1[0], shape2[0]) == (b, b2):
            # per-head inputs (text and images together: samples of one length, two batch
            # sizes): the token axis is the one of the length, unless the head axis is too
            tok1 = shape1[1] == t1 and shape2[1] == t2
            tok2 = shape1[2] == t1 and shape2[2] == t2
            if tok1 != tok2 and shape1[3] == shape2[3]:
                if tok1 and shape1[2] == shape2[2]:
                    return "bthd", shape1[2]
                if tok2 and shape1[1] == shape2[1]:
                    return "bhtd", shape1[1]
        return None
    if len(shape1) != len(shape2) or shape1[-1] != shape2[-1]:
        return None
    if len(shape1) == 3 and shape1[:2] == (b, t1) and shape2[:2] == (b, t2):
        return "btd", None
    if len(shape1) == 2 and shape1[0] == b * t1 and shape2[0] == b * t2:
        return "btd", None
    if (len(shape1) == 3 and shape1[0] == b * t1 and shape2[0] == b * t2
            and shape1[1] == shape2[1]):
        # per-head [B*T, H, d], tokens flattened (Chameleon's q_norm and k_norm), read as
        # [B, T, H, d]: a token's heads stay together
        return "bthd", shape1[1]
    if len(shape1) == 4 and shape1[0] == b == shape2[0]:
        if shape1[1] == t1 and shape2[1] == t2 and shape1[2] == shape2[2]:
            return "bthd", shape1[2]
        if shape1[2] == t1 and shape2[2] == t2 and shape1[1] == shape2[1]:
            return "bhtd", shape1[1]
    return None


@dataclass(frozen=True)
class Blocks:
    """The transformer blocks: one ModuleList of block modules (`paths` has one entry),
    sibling ModuleLists whose i-th entries together are block i (XLM, `layer_lists`), or, with
    `lengths`, the block lists of a hierarchical model's stages one after the other (Swin's
    `layers.{s}.blocks`, ConvNeXt's `stages.{s}.layers`: block i counts across stages)."""

    paths: tuple[str, ...]
    n: int
    lengths: tuple[int, ...] = ()  # each stage's list's length, where paths are stages'

    @property
    def siblings(self) -> bool:
        return len(self.paths) > 1 and not self.lengths

    def block_paths(self, i: int) -> list[str]:
        """The module paths of block i (one, or its entry of each sibling list)."""
        if self.lengths:
            for p, n in zip(self.paths, self.lengths, strict=True):
                if i < n:
                    return [f"{p}.{i}"]
                i -= n
            raise IndexError(i)
        return [f"{p}.{i}" for p in self.paths]

    def parts(self, model: nn.Module, i: int) -> list[tuple[str, nn.Module]]:
        """Block i's modules: the block itself, or its entry of each sibling list."""
        return [(path, model.get_submodule(path)) for path in self.block_paths(i)]

    def children(self, model: nn.Module, i: int) -> list[tuple[str, str, nn.Module]]:
        """(name, path, module) of block i's children: a block module's own children, or
        the sibling lists' entries, each named by its list in the singular (`attentions` ->
        `attention`, `ffns` -> `ffn`)."""
        if not self.siblings:
            path, block = self.parts(model, i)[0]
            out = []
            for name, c in block.named_children():
                if isinstance(c, nn.ModuleList) and not is_norm_module(c):
                    # T5 keeps a block's sublayers in a list (`layer.0`: a norm and the
                    # SelfAttention, ...): their children are the block's parts
                    out += [(sub, f"{path}.{name}.{j}.{sub}", m) for j, entry in enumerate(c)
                            for sub, m in entry.named_children()]
                else:
                    out.append((name, f"{path}.{name}", c))
            return out
        return [(p.rsplit(".", 1)[-1].removesuffix("s"), path, m)
                for p, (path, m) in zip(self.paths, self.parts(model, i), strict=True)]

    def place(self, path: str) -> tuple[int, str] | None:
        """(i, what follows block i in `path`) where `path` is in block i (or is one of a
        sibling list's entries: then the rest is empty)."""
        before = 0
        for k, p in enumerate(self.paths):
            m = re.match(re.escape(p) + r"\.(\d+)(?:\.(.*))?$", path)
            if m and (self.siblings or m.group(2)):
                return before + int(m.group(1)), m.group(2) or ""
            if self.lengths:
                before += self.lengths[k]
        return None


def block_list(model: nn.Module, norm_paths: list[str]) -> Blocks:
    """The transformer blocks: the ModuleList holding the most norm modules, or where that
    is a list of norms kept beside its block's other parts, those sibling lists together."""
    best, best_count = "", 0
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            count = sum(1 for n in norm_paths if n.startswith(path + "."))
            if count > best_count:
                best, best_count = path, count
    if not best_count:
        return Blocks((), 0)
    found = list_at(model, best)
    if all(is_norm_module(m) for m in found):  # a block's norm, kept beside its other parts
        return Blocks(tuple(layer_lists(model, best) or [best]), len(found))
    stages = stage_lists(model, best, norm_paths)
    if stages:
        lengths = tuple(len(list_at(model, p)) for p in stages)
        return Blocks(tuple(stages), sum(lengths), lengths)
    return Blocks((best,), len(found))


def stage_lists(model: nn.Module, path: str, norm_paths: list[str]) -> list[str]:
    """Where the entries of the list at `path` are stages, each holding a list of blocks (a
    ModuleList of modules of one class that are no norms, holding norms of their own): those
    lists, one a stage in order; empty where any entry holds none. (T5 keeps a block's
    sublayers in a list too, of different classes: its blocks are no stages.)"""
    found = []
    for i in range(len(list_at(model, path))):
        prefix = f"{path}.{i}."
        best, count = "", 0
        for sub, m in model.get_submodule(f"{path}.{i}").named_modules():
            if not sub or not isinstance(m, nn.ModuleList) or not len(m) or any(
                    is_norm_module(c) for c in m) or len({type(c) for c in m}) > 1:
                continue
            held = sum(1 for n in norm_paths if n.startswith(prefix + sub + "."))
            if held > count:
                best, count = prefix + sub, held
        if not count:
            return []
        found.append(best)
    return found


@dataclass
class Stack:
    """A tower's blocks, their attention and MLP modules (path -> ("attn" / "cross" / "mlp",
    block)),
    the bare projections standing for an MLP that is no module of its own (OPT's fc1 and fc2
    are the block's own layers), and when its first block ran."""

    blocks: Blocks
    sublayers: dict[str, tuple[str, int]]
    bare: dict[int, list[str]]
    first_block: int = 0


def stack_of(model: nn.Module, norm_paths: list[str], watched: dict[str, nn.Module]) -> Stack:
    """The stack of blocks holding `norm_paths`; what sites.py's `_place` needs of it is added to
    `watched`."""
    blocks = block_list(model, norm_paths)
    sublayers: dict[str, tuple[str, int]] = {}
    for i in range(blocks.n):
        watched.update(blocks.parts(model, i))
        for kind, pattern in (("cross", CROSS), ("attn", ATTN), ("mlp", MLP)):
            for name, child_path, child in blocks.children(model, i):
                if not pattern.search(name) or is_norm_module(child) or child_path in sublayers:
                    continue
                sublayers[child_path] = (kind, i)
                watched[child_path] = child
                for sub, m in child.named_modules():
                    if sub and is_projection(m):
                        watched[f"{child_path}.{sub}"] = m
    bare: dict[int, list[str]] = {}
    for i in range(blocks.n):
        if any(v == ("mlp", i) for v in sublayers.values()):
            continue
        for _, child_path, child in blocks.children(model, i):
            if is_projection(child):
                bare.setdefault(i, []).append(child_path)
                watched[child_path] = child
    return Stack(blocks=blocks, sublayers=sublayers, bare=bare)


def block_sublayers(model: nn.Module, norm_paths: list[str]
                    ) -> tuple[Blocks, dict[str, tuple[str, int]]]:
    """The stack of blocks holding `norm_paths`, and its attention and MLP modules (path ->
    ("attn" / "mlp", block)), as find_sites places sites in it (weights.py reads them)."""
    st = stack_of(model, norm_paths, {})
    return st.blocks, st.sublayers


