"""A classification head as anchors: an image classifier's head rows are the anchor set
'classifier', its label names (`config.id2label`) the vocabulary, so that the logit-lens
functions read the class token as they read a text model's positions.

The head is stored where an LM head is, and accepted only where the model's own logits are
`W . final_norm(x)[position] + b` for one position (the class token), which `prove_classifier`
measures on a sample against the model's outputs, or the mean of that over every position of
the final site (a head that averages its positions: pooling.py); the ingest then checks it
again batch by batch (logits.LogitCheck), as it does an LM head's logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from .capture import output_tensor
from .layouts import FEATURE_MAPS, as_rows
from .logits import model_logits
from .pooling import prove_pooled
from .sites import FoundSite

# Worst relative error of the head's logits recomputed from the final norm's output (float32
# products of the same numbers in another order: about 1e-6).
_PROOF_LIMIT = 1e-4
_HEAD_NAMES = ("classifier", "score", "head", "fc")


@dataclass(frozen=True, kw_only=True)
class ClassifierHead:
    """A classification head: a linear layer from the final norm's output at `position`, or
    (`pool` 'mean') the mean over the final site's rows of each row's product with it (the
    linear layers between the norm and the mean folded into it)."""

    module: nn.Linear
    labels: list[str]
    final: FoundSite  # the site whose output it reads (models.final_site)
    position: int | None = 0  # None: every row (pool)
    pool: str | None = None  # 'mean': the logits are the mean of the rows' logits
    error: float = 0.0  # worst relative error of the proof


def find_classifier(model: nn.Module) -> nn.Linear | None:
    """The model's classification head: a linear layer named like one whose outputs are
    the config's labels (None for a model without one)."""
    config = getattr(model, "config", None)
    labels = getattr(config, "id2label", None) or {}
    for name in _HEAD_NAMES:
        m = getattr(model, name, None)
        if isinstance(m, nn.Linear) and m.out_features == len(labels) > 0:
            return m
        # a head of its own (AST's: a LayerNorm, then a dense layer): its last linear layer,
        # accepted only where the proof finds it reads the final site (prove_classifier)
        last = [c for c in m.modules() if isinstance(c, nn.Linear)] if isinstance(
            m, nn.Module) else []
        if last and last[-1].out_features == len(labels) > 0:
            return last[-1]
    return None


def label_names(model: nn.Module, n: int) -> list[str]:
    """The labels of a head's n outputs, by id (`LABEL_i` where the config names none)."""
    labels = getattr(getattr(model, "config", None), "id2label", None) or {}
    return [str(labels.get(i, labels.get(str(i), f"LABEL_{i}"))) for i in range(n)]


def vocab_of(labels: list[str], *, pieces: list[str] | None = None) -> pa.Table:
    """The vocabulary table of a classifier (its label names) or of a contrastive model's
    labels (`pieces`: each label as the text tower read it, in its template)."""
    return pa.table({
        "token_id": pa.array(range(len(labels)), pa.int32()),
        "token": pa.array(labels, pa.string()),
        "piece": pa.array(labels if pieces is None else pieces, pa.string()),
    })


@torch.no_grad()
def prove_classifier(model: nn.Module, head: nn.Linear, final: FoundSite,
                     sample: Mapping[str, torch.Tensor]) -> tuple[ClassifierHead | None, str]:
    """The head, when the model's logits on `sample` are its product with the final site's
    output at the class token (position 0); else None and the sentence that says why."""
    kept: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        y = output_tensor(output)
        if y is not None and not kept:
            kept.append(y.detach())

    handle = final.module.register_forward_hook(hook)
    try:
        real = model_logits(model(**sample)).double().cpu()
    finally:
        handle.remove()
    labels = label_names(model, head.out_features)
    rows = ("btd", "bktd", "kbtd", *FEATURE_MAPS)
    if not kept or real.dim() != 2 or final.layout not in rows or (
            kept[0].shape[0] % real.shape[0]):
        return None, ("its logits are not one row an input read from the final norm "
                      f"{final.record.module!r}")
    # [B, d]: the class token, or the one vector of a norm of a pooled output
    y = as_rows(kept[0], final.layout, real.shape[0])[:, 0].double().cpu()
    if head.in_features != y.shape[-1]:
        return None, (f"its head reads vectors of width {head.in_features}, not the final "
                      f"norm's {y.shape[-1]} (it pools several positions together)")
    w = head.weight.detach().double().cpu()
    b = head.bias.detach().double().cpu() if head.bias is not None else 0.0
    mine = y @ w.T + b  # [B, L]
    err = float((torch.linalg.vector_norm(mine - real, dim=-1)
                 / torch.linalg.vector_norm(real, dim=-1).clamp_min(1e-30)).max())
    if not err <= _PROOF_LIMIT:
        return None, (f"its logits are not its head's product with the final norm's output at "
                      f"the class token (relative error {err:.3g}: it pools another way)")
    return ClassifierHead(module=head, labels=labels, final=final, position=0,
                          error=err), ""


def prove_head(model: nn.Module, head: nn.Linear, final: FoundSite,
               sample: Mapping[str, torch.Tensor]) -> tuple[ClassifierHead | None, str]:
    """The head as the class token's (`prove_classifier`), else as the mean of every row's
    logits (`pooling.prove_pooled`); else None and the sentence that says why not."""
    found, why = prove_classifier(model, head, final, sample)
    if found is not None:
        return found, ""
    pooled, why_pooled = prove_pooled(model, head, final, sample)
    if pooled is None:
        return None, why_pooled or why
    composed = nn.Linear(pooled.weight.shape[1], pooled.weight.shape[0],
                         device=head.weight.device, dtype=torch.float32)
    composed.requires_grad_(False)
    composed.weight.copy_(pooled.weight.float())
    assert composed.bias is not None
    composed.bias.copy_(pooled.bias.float())
    return ClassifierHead(module=composed, labels=label_names(model, head.out_features),
                          final=final, position=None, pool="mean", error=pooled.error), ""
