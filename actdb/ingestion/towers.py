"""A model's towers: the stacks of blocks it is made of (a multimodal model's vision tower and
text decoder, an encoder-decoder's two stacks), so that roles and layers are assigned within
each, whatever the depth of the others.

Found by structure, not by a table of models: from the model down through wrappers that hold
all its norms (`model.model`), to the first module whose children that hold norms are all named
like towers (`vision_tower`, `visual`, `multi_modal_projector`, `language_model`, `encoder`,
`decoder`, ...). A model without such children is one tower, named for what it reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

TOWERS = ("text", "vision", "audio", "encoder", "decoder", "projector")
# Child names and the tower they are; the first that matches wins.
_NAMES = (
    (re.compile(r"(^|_)(multi_modal_projector|mm_projector|projector|connector|merger|"
                r"adapter|aligner|resampler)$"), "projector"),
    (re.compile(r"(^|_)(vision|visual|image|vit)(_|$)|^(vision|visual)"), "vision"),
    (re.compile(r"(^|_)(audio|speech)(_|$)"), "audio"),
    (re.compile(r"(^|_)(language|text|llm)(_|$)|^language_model$"), "text"),
    (re.compile(r"^encoder$"), "encoder"),
    (re.compile(r"^decoder$"), "decoder"),
)


@dataclass(frozen=True)
class Tower:
    name: str  # one of TOWERS
    root: str  # its module path ("" for a model that is one tower)

    def holds(self, path: str) -> bool:
        return not self.root or path == self.root or path.startswith(self.root + ".")


def tower_name(child: str) -> str | None:
    """The tower a child module's name says it is (None: no tower's name)."""
    return next((tower for pattern, tower in _NAMES if pattern.search(child)), None)


def find_towers(model: nn.Module, norm_paths: list[str], single: str) -> list[Tower]:
    """The model's towers, each holding some of `norm_paths`; one tower named `single` (what
    the model reads: text, vision or audio) where the model is not made of named towers."""
    path = ""
    module = model
    while True:
        prefix = path + "." if path else ""
        holding = [(name, child) for name, child in module.named_children()
                   if any(p == prefix + name or p.startswith(prefix + name + ".")
                          for p in norm_paths)]
        if len(holding) == 1:  # a wrapper: every norm is inside one child
            name, module = holding[0]
            path = prefix + name
            continue
        named = [(name, tower_name(name)) for name, _ in holding]
        kinds = [k for _, k in named]
        if len(holding) > 1 and all(kinds) and len(set(kinds)) == len(kinds):
            out: list[Tower] = []
            for (n, k), (_, child) in zip(named, holding, strict=True):
                split = _stacks(child, prefix + n, norm_paths) if k == "text" else None
                out += split or [Tower(str(k), prefix + n)]
            return out
        return [Tower(single, "")]


def _stacks(module: nn.Module, path: str, norm_paths: list[str]) -> list[Tower] | None:
    """A text tower's encoder and decoder (Florence-2's BART), where its norms are all in
    children named so (through wrappers that hold them all); None for one stack."""
    while True:
        holding = [name for name, _ in module.named_children()
                   if any(p == f"{path}.{name}" or p.startswith(f"{path}.{name}.")
                          for p in norm_paths)]
        if len(holding) != 1:
            break
        module, path = getattr(module, holding[0]), f"{path}.{holding[0]}"
    if sorted(holding) != ["decoder", "encoder"]:
        return None
    return [Tower(name, f"{path}.{name}") for name in ("encoder", "decoder")]


def main_tower(towers: list[Tower]) -> Tower:
    """The tower whose output the model's head reads: the text or decoder stack, else the
    only one."""
    for name in ("text", "decoder"):
        found = next((t for t in towers if t.name == name), None)
        if found is not None:
            return found
    return towers[-1]


def site_prefix(tower: Tower, towers: list[Tower]) -> str:
    """What a site's canonical name starts with: nothing in the main tower (a text model's
    names are unchanged), the tower's name in the others (`vision.blocks.3.ln1`)."""
    return "" if tower == main_tower(towers) else tower.name + "."
