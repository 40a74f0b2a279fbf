"""A contrastive model's labels as anchors: a zero-shot lens.

A contrastive model (CLIP, SigLIP) scores an image against texts: its logits are
`scale * cos(image_embed, text_embed) + bias`. Given labels (`--labels FILE`, `labels=[...]`)
and a prompt template ("a photo of a {}"), each label's text embedding, made by the model's
own text tower, is one anchor; read back through the image projection `P` it is a row
`W[t] = P^T t_hat` in the vision tower's width, so the anchor set 'labels' lives where the
vision tower's sites do. The lens at a site's vector `v` is then
`logit_t = scale * (W[t] . y) / ||P y|| + bias` with `y = final_norm(v)`: at the final site's
class token it is the model's own `logits_per_image` (CLIP reads its class token through
`post_layernorm` and `visual_projection`).

`prove_labels` measures that on a sample against the model's own forward pass. A model whose
image embedding is no one position's (SigLIP pools every position with an attention head)
keeps its anchors, proven against its own image embeddings, but no lens: `head_position` is
then None and the query layer refuses the logit functions in one sentence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import IngestError, PromptsError
from .capture import output_tensor
from .sites import FoundSite

DEFAULT_TEMPLATE = "a photo of a {}"
# Worst relative error of the logits recomputed from the final norm's output (float32 products
# of the same numbers in another order, and one normalization: about 1e-6).
_PROOF_LIMIT = 1e-4


@dataclass(frozen=True, kw_only=True)
class Contrastive:
    """The parts of a contrastive model an image ingest runs and the lens reads."""

    vision: nn.Module  # the vision tower, which alone runs on the images
    vision_path: str  # its path in the model (`vision_model`)
    projection: nn.Module | None  # image projection after the final norm (None: identity)


@dataclass(frozen=True, kw_only=True)
class LabelsHead:
    """The 'labels' anchors, proven: what register stores and the ingest checks against."""

    labels: list[str]
    texts: list[str]  # each label in the template, as the text tower read it
    weight: torch.Tensor  # [L, d] float64: unit text embeddings read back through P
    projection: torch.Tensor  # [p, d] float64 (the identity where the model has none)
    scale: float  # exp(logit_scale)
    bias: float | None  # SigLIP's logit_bias
    position: int | None  # the position the lens reads (0: class token); None: no lens
    text_inputs: dict[str, torch.Tensor]  # the labels' token ids, for the model's own logits
    error: float  # worst relative error of the proof

    def head(self) -> nn.Linear:
        """The anchors as a linear layer `W y + bias / scale` (float32, on the CPU): the
        logits before the scale, given `y / ||P y||`."""
        lin = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(self.weight.float())
            if lin.bias is not None and self.bias is not None:
                lin.bias.fill_(self.bias / self.scale)
        return lin


def find_contrastive(model: nn.Module) -> Contrastive | None:
    """The model's vision tower and projection where it is a contrastive model (text and image
    features, a learnt logit scale); None otherwise."""
    if not all(callable(getattr(model, f, None))
               for f in ("get_text_features", "get_image_features")):
        return None
    if not isinstance(getattr(model, "logit_scale", None), torch.Tensor):
        return None
    vision_path = next((n for n in ("vision_model", "vision_tower", "visual")
                        if isinstance(getattr(model, n, None), nn.Module)), None)
    if vision_path is None:
        return None
    vision = getattr(model, vision_path)
    projection = getattr(model, "visual_projection", None)
    return Contrastive(vision=vision, vision_path=vision_path,
                       projection=projection if isinstance(projection, nn.Module) else None)


def read_labels(labels: str | Sequence[str] | Any) -> list[str]:
    """Labels from a file (one a line, blank lines skipped) or a list of strings."""
    import os
    from pathlib import Path

    if isinstance(labels, str | os.PathLike):
        path = Path(labels)
        if not path.is_file():
            raise PromptsError(f"labels file {os.fspath(labels)!r} does not exist")
        try:
            lines = path.read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError as e:
            raise PromptsError(f"labels file {os.fspath(labels)!r} is not UTF-8 text "
                               f"(byte {e.start})") from None
        out = [line.strip() for line in lines if line.strip()]
        where = f"labels file {os.fspath(labels)!r}"
    else:
        out = list(labels)
        where = "labels"
        bad = next((x for x in out if not isinstance(x, str) or not x.strip()), None)
        if bad is not None or any(not isinstance(x, str) for x in out):
            raise PromptsError(f"labels must be non-empty strings; got {bad!r}")
    if not out:
        raise PromptsError(f"{where} holds no labels")
    seen: set[str] = set()
    for x in out:
        if x in seen:
            raise PromptsError(f"{where} gives the label {x!r} twice")
        seen.add(x)
    return out


def check_template(template: str) -> str:
    """A prompt template with exactly one `{}` for the label."""
    if template.count("{}") != 1 or template.replace("{}", "").count("{") or (
            template.replace("{}", "").count("}")):
        raise PromptsError(f"label template {template!r} must hold one {{}} where the label "
                           "goes (and no other braces), e.g. 'a photo of a {}'")
    return template


def _text_inputs(model: nn.Module, tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    """The labels' token ids as the model was trained to read them: SigLIP's text tower was
    trained on texts padded to its full length (its model card's `padding="max_length"`)."""
    config = getattr(model, "config", None)
    kind = str(getattr(config, "model_type", "") or "")
    text_config = getattr(config, "text_config", None)
    longest = getattr(text_config, "max_position_embeddings", None)
    if kind.startswith("siglip"):
        out = tokenizer(texts, padding="max_length", max_length=int(longest or 64),
                        truncation=True, return_tensors="pt")
    else:
        out = tokenizer(texts, padding=True, truncation=longest is not None,
                        max_length=longest, return_tensors="pt")
    return {k: v for k, v in out.items() if k in ("input_ids", "attention_mask")}


def _relative(mine: torch.Tensor, real: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm(mine - real, dim=-1)
    return float((diff / torch.linalg.vector_norm(real, dim=-1).clamp_min(1e-30)).max())


def _output_of(model: nn.Module, output: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_per_image [B, L], text_embeds [L, p]) of a contrastive model's output."""
    logits = getattr(output, "logits_per_image", None)
    text = getattr(output, "text_embeds", None)
    if not isinstance(logits, torch.Tensor) or not isinstance(text, torch.Tensor):
        raise IngestError(f"model {name!r} ({type(model).__name__}) returned no "
                          "logits_per_image and text_embeds: its labels cannot be proven")
    return logits, text


@torch.no_grad()
def prove_labels(model: nn.Module, parts: Contrastive, final: FoundSite | None,
                 sample: Mapping[str, torch.Tensor], tokenizer: Any, labels: list[str],
                 template: str, name: str) -> LabelsHead:
    """The labels' anchors, scale and bias, proven against the model's own logits_per_image
    on `sample`: from the final site's output at the class token where the model reads it
    there (the lens), else from the model's own image embeddings (anchors, no lens).

    Raises IngestError when neither reproduces the model's logits."""
    if tokenizer is None:
        raise IngestError(f"model {name!r} has no tokenizer to read its labels with: pass "
                          "a processor that holds one (--processor, processor=...)")
    texts = [template.format(label) for label in labels]
    text_inputs = _text_inputs(model, tokenizer, texts)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    text_inputs = {k: v.to(device) for k, v in text_inputs.items()}
    kept: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        y = output_tensor(output)
        if y is not None and not kept:
            kept.append(y.detach())

    handle = final.module.register_forward_hook(hook) if final is not None else None
    try:
        out = model(**sample, **text_inputs)
    finally:
        if handle is not None:
            handle.remove()
    logits, text = _output_of(model, out, name)
    real = logits.double().cpu()  # [B, L]
    t_hat = text.double().cpu()
    t_hat = t_hat / torch.linalg.vector_norm(t_hat, dim=-1, keepdim=True).clamp_min(1e-30)
    logit_scale = model.logit_scale
    assert isinstance(logit_scale, torch.Tensor)
    scale = float(torch.exp(logit_scale.detach().double()).reshape(-1)[0])
    raw_bias = getattr(model, "logit_bias", None)
    bias = (float(raw_bias.detach().double().reshape(-1)[0])
            if isinstance(raw_bias, torch.Tensor) else None)
    pw = getattr(parts.projection, "weight", None)
    p = pw.detach().double().cpu() if isinstance(pw, torch.Tensor) else None
    width = p.shape[1] if p is not None else t_hat.shape[1]
    projection = p if p is not None else torch.eye(width, dtype=torch.float64)
    if projection.shape[0] != t_hat.shape[1]:
        raise IngestError(f"model {name!r}: its image projection gives width "
                          f"{projection.shape[0]}, its text embeddings {t_hat.shape[1]}")
    weight = t_hat @ projection  # [L, d]

    def logits_of(image: torch.Tensor) -> torch.Tensor:
        u = image / torch.linalg.vector_norm(image, dim=-1, keepdim=True).clamp_min(1e-30)
        return scale * (u @ t_hat.T) + (bias or 0.0)

    position: int | None = None
    error = math.inf
    if kept and kept[0].shape[-1] == width:
        y = kept[0].double().cpu()
        y = y[:, 0] if y.dim() == 3 else y  # the class token
        if y.dim() == 2 and y.shape[0] == real.shape[0]:
            error = _relative(logits_of(y @ projection.T), real)
            position = 0 if error <= _PROOF_LIMIT else None
    if position is None:  # no one position's vector: the model's own image embeddings
        image = getattr(out, "image_embeds", None)
        if not isinstance(image, torch.Tensor):
            raise IngestError(f"model {name!r}: its logits_per_image come from no stored "
                              "site and it returns no image_embeds: its labels cannot be "
                              "proven")
        error = _relative(logits_of(image.double().cpu()), real)
    if not error <= _PROOF_LIMIT:
        raise IngestError(
            f"model {name!r}: its logits_per_image are not scale * cos(image, text) + bias "
            f"of its own embeddings (relative error {error:.3g}); actdb cannot reproduce them")
    return LabelsHead(labels=list(labels), texts=texts, weight=weight, projection=projection,
                      scale=scale, bias=bias, position=position,
                      text_inputs={k: v.detach() for k, v in text_inputs.items()}, error=error)


def labels_logits(output: Any) -> torch.Tensor:
    """A contrastive model's logits_per_image, [B, L]."""
    got = getattr(output, "logits_per_image", None)
    if not isinstance(got, torch.Tensor):
        raise IngestError("the model's forward pass returned no logits_per_image")
    return got
