"""Find the weights that read from and write to the residual stream, by what they do.

No per-model table of parameter names. In each block, the attention module and the MLP are the
sublayers sites.py finds; their projections are the leaf modules with a matrix weight
(nn.Linear, GPT-2's Conv1D, ...), and what each one is is read from forward passes:

- A projection's orientation (`[out, in]` or Conv1D's `[in, out]`) is the one that reproduces
  its recorded output from its recorded input.
- The attention's readers are the projections whose input is the attention's input; its
  writer is the last projection to run that writes the model width (its input is the heads,
  merged).
- Values: with one token, softmax gives its only key the weight 1, so the writer's input is
  each head's value itself: the reader columns equal to the writer's input columns are the
  values, and which head slots each feeds gives the grouped-query map.
- Queries and keys: the other reader columns, in blocks of d_head. Over two tokens, a key
  block changed at the first token changes what the second token's heads read; a query block
  does not (the first token's query meets one key). Changed at the second token, a query
  block changes its one head, a key block every head of its group.
- The MLP: its readers are the projections reading its input; its activation module's input
  is the gate (or the one reader, ungated), and the writer's input must equal
  act(gate) * up (or act(in)): checked on the probe, or the MLP is refused with the reason.
- Mixtures of experts keep each expert's matrices in 3-D parameters ([experts, 2n, d] and
  [experts, d, n]); which half is the gate is read from the experts' activation input.

What cannot be mapped (latent attention, linear attention, gated attention outputs) is
refused per layer with the reason, never guessed. Matrices are the model's own values
(sliced and transposed, never computed), so storing them as float32 is exact.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .attention_probes import MODEL_ERRORS, Probed, failed, find_attentions
from .attention_weights import AttentionPlan, plan_attention
from .capture import record_calls
from .mlp_weights import find_mlp
from .rotary import find_rotary
from .seq2seq import is_encoder_decoder
from .sites import FoundSite, block_sublayers, forward_module, is_norm_module
from .weight_probes import (
    Unmapped,
    first_line,
    functions,
    projections_of,
    same,
)
from .weight_records import ModelWeights, Refusal


def extract(model: nn.Module, found: list[FoundSite], tokens: list[int], *,
            device: torch.device) -> ModelWeights:
    """Every block's attention and MLP weights, or the reason one cannot be mapped.

    `tokens`: token ids to run probe passes on (the prompts' own)."""
    if is_encoder_decoder(model):
        # its blocks read two sequences (the decoder's tokens, the encoder's output): the
        # probes here run one
        return ModelWeights(attention=[], mlps=[], refused=[Refusal(
            layer=-1, part="model", module="", reason="an encoder-decoder's layer weights are "
            "not extracted: its decoder blocks read the encoder's output as well")])
    # The blocks of the tower the model's head reads (a multimodal model's text stack).
    # (the last site's, in a model without a final norm: BERT's encoder is post-norm)
    final = next((f for f in reversed(found) if f.record.role == "final"), found[-1])
    tower = final.record.tower
    norm_paths = [p for f in found if f.record.tower == tower for p, _ in f.hooks]
    blocks, sublayers = block_sublayers(model, norm_paths)
    config = getattr(model, "config", None)
    pretrained: Any = model  # a transformers model: get_input_embeddings is its method
    embed = pretrained.get_input_embeddings()
    d_model = int(embed.weight.shape[1])
    paths = [p for f in found for p, _ in f.hooks]
    target = forward_module(model, paths)
    pool = tokens or [0]
    ids1 = torch.tensor([[pool[(7 * r) % len(pool)]] for r in range(6)], device=device)
    ids2 = torch.tensor([[pool[(5 * r) % len(pool)], pool[(5 * r + 3) % len(pool)]]
                         for r in range(3)], device=device)

    watched: dict[str, nn.Module] = {p: model.get_submodule(p) for p in sublayers}
    for i in range(blocks.n):
        for _, child_path, child in blocks.children(model, i):
            if is_norm_module(child):
                continue
            watched.update(projections_of(model, child_path))
            watched.update(functions(child, child_path))
    site_of = {f.hooks[0][0]: f.record.site for f in found if len(f.hooks) == 1
               and f.record.n_heads is None}
    watched.update({p: model.get_submodule(p) for p in site_of})
    try:
        with torch.no_grad(), record_calls(watched, copies=True) as log:
            target(input_ids=ids2, attention_mask=torch.ones_like(ids2))
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        return ModelWeights(attention=[], mlps=[], refused=[Refusal(
            layer=-1, part="model", module="", reason=f"its probe pass failed ({first_line(e)})")])
    calls = {k: v[0] for k, v in log.calls.items() if v}
    every = {k: list(v) for k, v in log.calls.items()}

    def reads(x: torch.Tensor | None) -> str | None:
        """The site whose output `x` is (None: no stored site's)."""
        return next((site for p, site in site_of.items() for c in every.get(p, ())
                     if same(c.output, x)), None)

    out = ModelWeights(attention=[], mlps=[], refused=[], rotary=find_rotary(model))
    # Every block's attention first: their probe passes run over all blocks at once
    # (attention_probes.py).
    attn_paths: dict[int, str] = {}
    probed: dict[int, Probed] = {}
    plans: list[AttentionPlan] = []
    for i in range(blocks.n):
        path = next((p for p, (k, j) in sublayers.items() if j == i and k == "attn"
                     and p in calls), None)
        if path is None:
            continue
        attn_paths[i] = path
        try:
            plans.append(plan_attention(model, i, path, calls, config, d_model))
        except Unmapped as e:
            probed[i] = str(e)
        except MODEL_ERRORS as e:  # the model's own
            probed[i] = failed(e)
    probed.update(find_attentions(plans, target, ids1, ids2))
    for i in range(blocks.n):
        mine = {p: k for p, (k, j) in sublayers.items() if j == i}
        attn_path = attn_paths.get(i)
        if attn_path is not None:
            got = probed[i]
            if isinstance(got, str):
                out.refused.append(Refusal(layer=i, part="attn", module=attn_path, reason=got))
            else:
                a, x = got
                out.attention.append(replace(a, reads=reads(x)))
        mlp_path = next((p for p, k in mine.items() if k == "mlp" and p in calls), None)
        block_leaves = [p for _, cp, _ in blocks.children(model, i) if cp not in sublayers
                        for p in projections_of(model, cp) if p in calls]
        if mlp_path is None and not block_leaves:
            continue
        try:
            mlps, x = find_mlp(model, i, mlp_path, attn_path, block_leaves, calls, every, d_model)
            out.mlps.extend(replace(m, reads=reads(x)) for m in mlps)
        except Unmapped as e:
            out.refused.append(Refusal(layer=i, part="mlp", module=mlp_path or "?",
                                       reason=str(e)))
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            out.refused.append(Refusal(layer=i, part="mlp", module=mlp_path or "?",
                                       reason=f"its probe pass failed ({first_line(e)})"))
    return out
