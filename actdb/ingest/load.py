"""Load a model and its tokenizer from a hub name, a local path, or take a model object."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..devices import resolve_device
from ..errors import ModelLoadError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    source: str
    default_name: str
    revision: str | None
    device: torch.device
    dtype: torch.dtype


def resolve_dtype(dtype: str, device: torch.device, config: Any = None) -> torch.dtype:
    """`auto`: float32 on CPU; on CUDA the checkpoint's own dtype, else float16."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        own = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
        if isinstance(own, str):
            own = _DTYPES.get(own)
        return own if isinstance(own, torch.dtype) else torch.float16
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _is_causal(config: Any) -> bool:
    archs = getattr(config, "architectures", None) or []
    if not archs:
        return True
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def load(
    model: str | os.PathLike[str] | nn.Module,
    tokenizer: Any = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    revision: str | None = None,
) -> LoadedModel:
    """Load (or adopt) a model and tokenizer, in eval mode on the chosen device and dtype."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dev = resolve_device(device)
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ModelLoadError("a model object needs its tokenizer: pass tokenizer=...")
        config = getattr(model, "config", None)
        dt = resolve_dtype(dtype, dev, config)
        source = "<object>"
        name = Path(str(getattr(config, "_name_or_path", "") or type(model).__name__)).name
        module = model
    else:
        source = os.fspath(model)
        path = Path(source).expanduser()
        local = path.exists()
        # A hub name is "name" or "org/name"; anything else that is not on disk is a path
        # that does not exist (and asking the hub for it would only fail more slowly).
        looks_like_path = source.startswith((".", "/", "~")) or source.count("/") > 1
        if not local and looks_like_path:
            raise ModelLoadError(f"model path {source!r} does not exist")
        if local and not path.is_dir():
            raise ModelLoadError(f"model path {source!r} is a file, not a model directory")
        where = str(path) if local else source
        try:
            config = transformers.AutoConfig.from_pretrained(where, revision=revision)
        except (OSError, ValueError) as e:
            raise ModelLoadError(
                f"could not load a model config from {source!r}: {_first_line(e)}"
            ) from e
        dt = resolve_dtype(dtype, dev, config)
        auto = (transformers.AutoModelForCausalLM if _is_causal(config)
                else transformers.AutoModel)
        try:
            module = auto.from_pretrained(where, revision=revision, dtype=dt)
            if tokenizer is None:
                tokenizer = transformers.AutoTokenizer.from_pretrained(where, revision=revision)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"could not load model {source!r}: {_first_line(e)}") from e
        name = path.resolve().name if local else source
    module = module.to(device=dev, dtype=dt).eval()
    _prepare_tokenizer(tokenizer)
    return LoadedModel(
        model=module, tokenizer=tokenizer, source=source, default_name=name,
        revision=revision, device=dev, dtype=dt,
    )


def _prepare_tokenizer(tok: Any) -> None:
    # Right padding keeps every real token at its true position in causal models.
    tok.padding_side = "right"
    if tok.pad_token is None:
        fallback = tok.eos_token or tok.unk_token or tok.convert_ids_to_tokens(0)
        tok.pad_token = fallback


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
