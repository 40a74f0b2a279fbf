"""Load a model and its tokenizer from a hub name, a local path, or take a model object."""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..devices import resolve_device
from ..errors import ModelLoadError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # None for a model that reads no text (an image classifier)
    source: str
    default_name: str
    revision: str | None
    device: torch.device
    dtype: torch.dtype
    processor: Any = None  # what makes its inputs from images, videos or sounds


def resolve_dtype(dtype: str, device: torch.device, config: Any = None,
                  weights: torch.dtype | None = None) -> torch.dtype:
    """`auto`: float32 on CPU; on CUDA the weights' own dtype: that of the model object in hand
    (`weights`: a caller's float32 model is not cast), else the checkpoint's, else float16."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        if weights is not None:
            return weights
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


def _model_class(transformers: Any, config: Any) -> Any:
    """The class a folder is loaded with: a causal LM's, else the class its config names
    (keeping its head: BertForMaskedLM's LM head, an image classifier's classifier), else
    the bare model. The same model a caller's `from_pretrained` of that class gives."""
    if _is_causal(config):
        return transformers.AutoModelForCausalLM
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    return transformers.AutoModel


# Files that say a folder has a processor for images, videos or sounds.
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                    "video_preprocessor_config.json")


# Model folders and hub repositories may ship Python (`auto_map`) that transformers runs only
# when told to, after asking on standard input when not told: actdb always says no.
_REMOTE_CODE = (
    "model {source!r} needs Python code of its own to load (auto_map in its config or "
    "tokenizer config), and actdb runs no code from a model folder or the hub: if you trust "
    "it, load it yourself (from_pretrained(..., trust_remote_code=True)) and pass the model "
    "and tokenizer objects to actdb.ingest")


def load(
    model: str | os.PathLike[str] | nn.Module,
    tokenizer: Any = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    revision: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    processor: Any = None,
) -> LoadedModel:
    """Load (or adopt) a model and tokenizer, in eval mode on the chosen device and dtype.

    `model` may be a hub name, a model folder, a `.gguf` file or a folder holding one (loaded
    through transformers' GGUF support, dequantized). `device_map` (e.g. "auto") lets
    accelerate spread a model larger than one device over several; hooks capture wherever
    each module lives. `processor` (an object or a folder) makes the inputs of images,
    videos and sounds; by default the one saved with the model, if any.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dev = resolve_device(device)
    if isinstance(processor, str | os.PathLike):
        processor = _load_processor(transformers, os.fspath(processor), os.fspath(processor),
                                    None, required=True)
    if isinstance(model, nn.Module):
        if tokenizer is None:
            tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None and processor is None:
            raise ModelLoadError("a model object needs its tokenizer (or, for a model that "
                                 "reads images, its processor): pass tokenizer=... or "
                                 "processor=...")
        config = getattr(model, "config", None)
        own = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        dt = resolve_dtype(dtype, dev, config, weights=own)
        source = "<object>"
        name = Path(str(getattr(config, "_name_or_path", "") or type(model).__name__)).name
        module = model
    else:
        source = os.fspath(model)
        where, gguf = _locate(source)
        try:
            config = transformers.AutoConfig.from_pretrained(
                where, revision=revision, trust_remote_code=False, **_gguf_kw(gguf))
        except (OSError, ValueError) as e:
            if "trust_remote_code" in str(e):
                raise ModelLoadError(_REMOTE_CODE.format(source=source)) from None
            # A name that is no path here was looked up on the hub: say both, so that a
            # mistyped folder is not read as a network problem.
            local = "" if Path(source).expanduser().exists() else (
                "there is no folder or file of that name here, and as a hub model name: ")
            raise ModelLoadError(
                f"could not load a model config from {source!r}: {local}{_first_line(e)}"
            ) from e
        dt = resolve_dtype(dtype, dev, config)
        auto = _model_class(transformers, config)
        if processor is None and gguf is None:
            processor = _load_processor(transformers, source, where, revision)
        if tokenizer is None:
            tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None and not (processor is not None and not _has_tokenizer(where)):
            tokenizer = _load_tokenizer(transformers, source, where, gguf, revision)
        placement = {"device_map": device_map} if device_map else {}
        try:
            # GGUF dequantization draws its own tqdm bar on stderr, not ours to show.
            with contextlib.redirect_stderr(io.StringIO()) if gguf else contextlib.nullcontext():
                # The config read above, passed on: parsing a GGUF's metadata takes seconds.
                module = auto.from_pretrained(where, revision=revision, dtype=dt,
                                              trust_remote_code=False,
                                              **_gguf_kw(gguf), **placement,
                                              **({"config": config} if gguf else {}))
        except ImportError as e:
            raise ModelLoadError(f"could not load model {source!r}: {_first_line(e)}") from e
        except Exception as e:  # noqa: BLE001 - safetensors, torch and gguf raise their own types
            raise ModelLoadError(
                f"could not load the weights of {source!r} ({type(e).__name__}: "
                f"{_first_line(e)}); is the weights file complete?"
            ) from e
        name = _default_name(source, where, gguf)
    if device_map:
        offloaded = sorted({n.rsplit(".", 1)[0] for n, p in module.named_parameters()
                            if p.device.type == "meta"})
        if offloaded:
            # Offloaded weights exist only inside accelerate's hooks, but actdb reads each
            # norm's weights and LM head directly.
            raise ModelLoadError(
                f"the device_map offloads {len(offloaded)} modules to disk or meta "
                f"(first {offloaded[0]!r}); actdb needs every weight on a device: give the "
                "model more devices or memory")
        # accelerate placed each module; inputs go where the embeddings live.
        embeddings = cast(Any, module).get_input_embeddings()
        dev = embeddings.weight.device
        module = module.eval()
    else:
        module = module.to(device=dev, dtype=dt).eval()
    if tokenizer is not None:
        _prepare_tokenizer(tokenizer)
    return LoadedModel(
        model=module, tokenizer=tokenizer, source=source, default_name=name,
        revision=revision, device=dev, dtype=dt, processor=processor,
    )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


def _locate(source: str) -> tuple[str, str | None]:
    """(where from_pretrained looks, the GGUF file name in it or None) for a name or path."""
    path = Path(source).expanduser()
    # A hub name is "name" or "org/name"; anything else that is not on disk is a path
    # that does not exist (and asking the hub for it would only fail more slowly).
    looks_like_path = source.startswith((".", "/", "~")) or source.count("/") > 1
    if not path.exists():
        if looks_like_path or source.endswith(".gguf"):
            raise ModelLoadError(f"model path {source!r} does not exist")
        return source, None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"model path {source!r} is a file, not a model folder or a .gguf file")
        return str(path.parent), path.name
    if (path / "config.json").exists():
        return str(path), None
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ModelLoadError(
            f"model folder {source!r} holds several GGUF files ({', '.join(ggufs)}); "
            "pass one of them as --model")
    if ggufs:
        return str(path), ggufs[0]
    raise ModelLoadError(f"model folder {source!r} has no config.json and no .gguf file")


def _gguf_kw(gguf: str | None) -> dict[str, str]:
    return {"gguf_file": gguf} if gguf else {}


def _default_name(source: str, where: str, gguf: str | None) -> str:
    if gguf:
        return gguf.removesuffix(".gguf")
    path = Path(where)
    return path.resolve().name if path.exists() else source


def _has_tokenizer(where: str) -> bool:
    return any((Path(where) / f).exists() for f in _TOKENIZER_FILES)


def _load_processor(transformers: Any, source: str, where: str, revision: str | None, *,
                    required: bool = False) -> Any:
    """The processor saved in a model folder (AutoProcessor: images, videos, sounds, with the
    tokenizer where it has one), None where there is none."""
    local = Path(where).is_dir()
    if local and not any((Path(where) / f).exists() for f in _PROCESSOR_FILES):
        if required:
            raise ModelLoadError(f"processor folder {source!r} has none of "
                                 f"{', '.join(_PROCESSOR_FILES)}")
        return None
    if not local and not required:
        return None  # a hub model's processor is loaded when asked for (--processor)
    # Without torchvision, transformers says at each load that it falls back to its PIL
    # image processors, which compute the same inputs.
    try:
        was = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()
        try:
            return transformers.AutoProcessor.from_pretrained(
                where, revision=revision, trust_remote_code=False)
        finally:
            transformers.utils.logging.set_verbosity(was)
    except Exception as e:  # noqa: BLE001 - processors raise many types for a broken file
        if "trust_remote_code" in str(e):
            raise ModelLoadError(_REMOTE_CODE.format(source=source)) from None
        raise ModelLoadError(
            f"could not load the processor of {source!r}: {_first_line(e)}") from e


def _load_tokenizer(transformers: Any, source: str, where: str, gguf: str | None,
                    revision: str | None) -> Any:
    local = Path(where).is_dir()
    if local and gguf is None and not any((Path(where) / f).exists() for f in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"model folder {source!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            "save the tokenizer beside the weights, or pass tokenizer=... from Python")
    try:
        return transformers.AutoTokenizer.from_pretrained(where, revision=revision,
                                                          trust_remote_code=False,
                                                          **_gguf_kw(gguf))
    except Exception as e:  # noqa: BLE001 - tokenizers raise many types for a broken file
        if "trust_remote_code" in str(e):
            raise ModelLoadError(_REMOTE_CODE.format(source=source)) from None
        raise ModelLoadError(
            f"could not load the tokenizer of {source!r}: {_first_line(e)}") from e


def _prepare_tokenizer(tok: Any) -> None:
    # Right padding keeps every real token at its true position in causal models.
    tok.padding_side = "right"
    if tok.pad_token is None:
        fallback = tok.eos_token or tok.unk_token or tok.convert_ids_to_tokens(0)
        tok.pad_token = fallback


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
