"""Forward hooks, added only inside a context manager that removes them in `finally`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def first_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The tensor a module was called on: its first positional tensor, else the first kwarg."""
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def output_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


@dataclass
class Call:
    """One call of a hooked module: when it started and ended, what went in and came out."""

    start: int
    end: int = -1
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None


@dataclass
class CallLog:
    """Calls of each hooked module, numbered by one counter shared by all of them."""

    calls: dict[str, list[Call]] = field(default_factory=dict)
    _clock: Iterator[int] = field(default_factory=itertools.count)

    def tick(self) -> int:
        return next(self._clock)


@contextmanager
def record_calls(modules: Mapping[str, nn.Module], *, copies: bool = False
                 ) -> Iterator[CallLog]:
    """Record the order of calls of `modules`, with their input and output; `copies` keeps
    copies of them, for a model that changes an output in place after the call (Falcon adds
    the attention's output to the MLP's)."""

    def kept(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.detach().clone() if copies and t is not None else t

    log = CallLog()
    handles = []

    def make(name: str) -> tuple[Callable[..., None], Callable[..., None]]:
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = first_tensor(args, kwargs)
            log.calls.setdefault(name, []).append(Call(start=log.tick(), input=kept(x)))

        def post(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            call = log.calls[name][-1]
            call.end = log.tick()
            call.output = kept(output_tensor(output))

        return pre, post

    try:
        for name, module in modules.items():
            pre, post = make(name)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        yield log
    finally:
        for h in handles:
            h.remove()


@contextmanager
def on_norm_io(
    modules: Mapping[str, nn.Module], fn: Callable[[str, torch.Tensor, torch.Tensor], None]
) -> Iterator[None]:
    """Call `fn(name, input, output)` after each call of each module; nothing is kept."""
    handles = []

    def make(name: str) -> Callable[..., None]:
        def post(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            x = first_tensor(args, kwargs)
            y = output_tensor(output)
            if x is not None and y is not None:
                fn(name, x, y)

        return post

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(make(name), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
