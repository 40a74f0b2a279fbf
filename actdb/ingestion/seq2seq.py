"""Encoder-decoders (T5, BART, Whisper, ...): what the decoder reads, and a batch's inputs for
both stacks.

The encoder reads the input (text, or a sound's features); the decoder reads, by teacher
forcing, the input's `target` tokenized as the model's labels are (the tokenizer in its target
mode) and shifted right by the model's own function (`prepare_decoder_input_ids_from_labels`,
else its module's `shift_tokens_right` with the config's pad and decoder start tokens):
exactly what the model's forward makes of `labels=`. Without a target the decoder reads its
start token alone. The decoder's rows are the tokens it read, the shifted sequence.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import IngestError
from .prompts import Prompt


def is_encoder_decoder(model: nn.Module) -> bool:
    """A model with a decoder of its own that reads decoder inputs (WhisperForAudioClassification
    keeps its config's `is_encoder_decoder` but only the encoder)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)) and (
        "decoder_input_ids" in inspect.signature(model.forward).parameters)


def _text_config(config: Any) -> Any:
    """A multimodal config's text decoder's config (itself for a text model), or None."""
    get = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if callable(get) else None
    except (TypeError, ValueError):
        return None


def decoder_start(model: nn.Module, name: str) -> int:
    """The token the model's decoder starts from; one sentence where it names none."""
    config = getattr(model, "config", None)
    generation = getattr(model, "generation_config", None)
    for source in (config, generation, _text_config(config)):
        start = getattr(source, "decoder_start_token_id", None)
        if isinstance(start, int):
            return start
    raise IngestError(f"model {name!r} is an encoder-decoder whose config names no "
                      "decoder_start_token_id: actdb cannot tell what its decoder reads first")


def shift_labels(model: nn.Module, labels: torch.Tensor, name: str) -> torch.Tensor:
    """`labels` [B, L] shifted right as the model's forward shifts them for its decoder."""
    own = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(own):
        return own(labels=labels)
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    config = getattr(model, "config", None)
    if callable(shift) and config is not None:
        pad = getattr(config, "pad_token_id", None)
        if pad is None:  # a multimodal model's text encoder-decoder holds it (Florence-2)
            pad = getattr(_text_config(config), "pad_token_id", None)
        return shift(labels, pad, decoder_start(model, name))
    raise IngestError(f"model {name!r} ({type(model).__name__}) is an encoder-decoder with no "
                      "function of its own that shifts labels into decoder inputs: actdb "
                      "cannot tell which tokens its decoder reads for a target")


def decoder_ids(model: nn.Module, tokenizer: Any, prompts: Sequence[Prompt],
                limit: int | None, name: str) -> tuple[list[list[int]], list[bool]]:
    """Each prompt's decoder tokens (its target as labels, shifted; or the start token),
    cut to `limit`, and whether they were cut."""
    out: list[list[int]] = []
    cut: list[bool] = []
    for i, p in enumerate(prompts):  # read as no target, it would silently be the start
        value = p.extra.get("target")
        if value is not None and not isinstance(value, str):
            raise IngestError(f"input {i}'s 'target' is a {type(value).__name__}, not text: "
                              f"model {name!r} is an encoder-decoder, whose decoder reads "
                              "the target's tokens; give it as a string")
    targets = [p.target for p in prompts]
    given = [t for t in targets if t is not None]
    labels: list[list[int]] = []
    if given:
        if tokenizer is None:
            raise IngestError(f"model {name!r} has no tokenizer to read the inputs' targets "
                              "with")
        labels = [list(map(int, ids)) for ids in
                  tokenizer(text_target=given, verbose=False)["input_ids"]]
    at = iter(labels)
    for target in targets:
        if target is None:
            out.append([decoder_start(model, name)])
            cut.append(False)
            continue
        row = next(at)
        if not row:
            raise IngestError(f"model {name!r}: the target {target[:40]!r} is no tokens")
        shifted = shift_labels(model, torch.tensor([row], dtype=torch.long), name)
        ids = [int(t) for t in shifted[0]]
        cut.append(limit is not None and len(ids) > limit)
        out.append(ids[:limit] if limit is not None else ids)
    return out, cut


def target_limit(model: nn.Module) -> int | None:
    """The most tokens the decoder reads: its position table's size where it has one."""
    config = getattr(model, "config", None)
    for key in ("max_target_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and 0 < value < 1_000_000:
            return value
    return None


def decoder_batch(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device
                  ) -> dict[str, torch.Tensor]:
    """A batch's decoder inputs, right-padded (its decoder is causal: padding after a token
    changes nothing of it) with a mask of the real ones."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[b, : len(row)] = 1
    return {"decoder_input_ids": ids.to(device), "decoder_attention_mask": mask.to(device)}


def probe_decoder(sample: dict[str, torch.Tensor], decoders: Sequence[Sequence[int]],
                  length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """`sample` with unpadded decoder inputs of `length` tokens a row (the first token the
    decoder reads, then the tokens it reads cycled): a probe batch of both stacks."""
    first = next(v for v in sample.values() if isinstance(v, torch.Tensor))
    start = decoders[0][0]
    pool = [t for row in decoders for t in row]
    rows = [[start] + [pool[(r * length + j) % len(pool)] for j in range(length - 1)]
            for r in range(int(first.shape[0]))]
    return {**sample, **decoder_batch(rows, 0, device)}
