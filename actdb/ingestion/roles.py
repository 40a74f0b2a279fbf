"""A norm's role in its block, from where it ran relative to the block's sublayers (one
forward pass's calls) and where its input and output went: pre- or post-norm, around
attention, an encoder-decoder's cross-attention and the MLP, or inside a sublayer."""

from __future__ import annotations

import re

import torch

from .capture import Call

Q_NORM = re.compile(r"(^|_)(q|query)_?(norm|layernorm|ln)s?$")
K_NORM = re.compile(r"(^|_)(k|key)_?(norm|layernorm|ln)s?$")


def place_role(leaf: str, call: Call, attn: Call | None, mlp: Call | None, sublayer: str | None,
          feeds_inside: bool) -> str:
    parts = leaf.split(".")
    if any(Q_NORM.search(p) for p in parts):
        return "q_norm"
    if any(K_NORM.search(p) for p in parts):
        return "k_norm"
    if feeds_inside:
        return "inner"  # its output feeds a projection of its own sublayer: never the residual
    if sublayer == "attn":
        return "post_attn"  # e.g. BERT's attention.output.LayerNorm(residual + attn)
    if sublayer == "mlp":
        return "post_mlp"
    if attn is None:
        return "other"
    if call.start < attn.start:
        # Parallel blocks (Falcon's new architecture) norm the MLP's input before attention.
        if (mlp is not None and same(call.output, mlp.input)
                and not same(call.output, attn.input)):
            return "pre_mlp"
        return "pre_attn"
    if mlp is None or call.start < mlp.start:
        # Between the sublayers: a norm whose output feeds the MLP is its pre-norm (whatever
        # its name, e.g. Llama's post_attention_layernorm); one that does not, normalizes
        # the attention output (Gemma 2, OLMo 2).
        if mlp is not None and same(call.output, mlp.input):
            return "pre_mlp"
        if mlp is None or mlp.input is None:
            return "post_attn" if same(call.input, attn.output) else "pre_mlp"
        return "post_attn"
    return "post_mlp"


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def feeds(out: torch.Tensor | None, into: torch.Tensor | None) -> bool:
    """`out` is what `into` received, up to a reshape (heads merged, tokens flattened)."""
    return (out is not None and into is not None and out.numel() == into.numel()
            and out.dtype == into.dtype and torch.equal(out.reshape(-1), into.reshape(-1)))


def decoder_role(call: Call, attn: Call, cross: Call, mlp: Call | None, block: Call | None,
                  norm_calls: list[Call] | None) -> str:
    """The role of a norm in a decoder block of an encoder-decoder (self-attention, then
    attention over the encoder's output, then the MLP): by the sublayers it runs between, as
    a pre-norm block's (one whose first norm runs before its self-attention: T5, Whisper,
    mBART) or a post-norm block's (BART, Marian: each norm after its sublayer's sum)."""
    start = block.start if block is not None else -1
    pre_norm = any(start < c.start < attn.start for c in norm_calls or [])
    if call.start < attn.start:
        return "pre_attn"
    if call.start < cross.start:
        return "pre_cross" if pre_norm else "post_attn"
    if mlp is None or call.start < mlp.start:
        return "pre_mlp" if pre_norm else "post_cross"
    return "post_mlp"


def carried(call: Call, mlp: Call, norm_calls: list[Call]) -> bool:
    """Whether the residual the MLP's output is added to is this norm's output, not its
    input: a post-norm block (DistilBERT's `sa_layer_norm(attn + x)`, whose output feeds the
    MLP and is carried on) rather than a pre-MLP norm, whose output feeds the MLP while its
    input is carried on. Read from the next norm's input, `residual + mlp(...)`; undecided
    (False) unless the output explains it to its dtype's rounding, and far better than the
    input does."""
    nxt = min((c for c in norm_calls if c.start > mlp.end and c.input is not None),
              key=lambda c: c.start, default=None)
    x, y, m = call.input, call.output, mlp.output
    if nxt is None or x is None or y is None or m is None or nxt.input is None:
        return False
    if not (x.shape == y.shape == m.shape == nxt.input.shape):
        return False
    rest = nxt.input.double() - m.double()
    # Relative to the sum the next norm received, which was rounded to its dtype: in bfloat16
    # the output explains it only to about 2^-8, in float32 to about 2^-24.
    scale = float(torch.linalg.vector_norm(nxt.input.double())) or 1.0
    off_out = float(torch.linalg.vector_norm(rest - y.double())) / scale
    off_in = float(torch.linalg.vector_norm(rest - x.double())) / scale
    eps = torch.finfo(nxt.input.dtype).eps if nxt.input.is_floating_point() else 1e-7
    return off_out < max(1e-3, 8.0 * eps) and off_out * 4.0 < off_in
