"""The weight finder's probe passes (ingestion/attention_probes.py): every block's attention is
read from two passes over the whole model, however deep it is, and a block whose rows are
reached by another block's perturbation (here a hook that carries block 0's heads' output
into block 1's input) is read in passes of its own. The stored matrices are compared with the
model's own parameters, sliced as Llama's documented layout says (grouped-query attention)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.tiny_models import CORPUS, build_family_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import actdb
from actdb.store.layer_weights import array_name, read_manifest
from actdb.store.store import Store

LAYERS, HEADS, KV_HEADS, D = 5, 4, 2, 64


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any]:
    tok = build_family_tokenizer("llama")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=D, intermediate_size=96,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return model, tok


@contextmanager
def _counted(module: torch.nn.Module) -> Iterator[list[int]]:
    n = [0]

    def pre(*_: Any) -> None:
        n[0] += 1

    handle = module.register_forward_pre_hook(pre)
    try:
        yield n
    finally:
        handle.remove()


def _ingest(path: Path, model: Any, tok: Any, weights: str) -> Path:
    actdb.ingest(path, model=model, tokenizer=tok, prompts=list(CORPUS[:2]), device="cpu",
                 weights=weights)
    return path


def _check_own(store: Path, model: Any) -> None:
    """Every layer's W_Q, W_K, W_V, W_O are the model's parameters, as Llama lays them out."""
    st = Store(store)
    manifest = read_manifest(st.arrays, 0)
    assert manifest is not None and not manifest["refused"]
    assert [e["layer"] for e in manifest["layers"]] == list(range(LAYERS))
    for i in range(LAYERS):
        a = model.model.layers[i].self_attn
        want = {"W_Q": a.q_proj.weight, "W_K": a.k_proj.weight, "W_V": a.v_proj.weight,
                "W_O": a.o_proj.weight.t()}
        for name, ref in want.items():
            got = st.arrays.weight(0, array_name(i, "attn", name))
            assert got is not None
            assert np.array_equal(got, ref.detach().float().numpy()), (i, name)
        kv = manifest["layers"][i]["attn"]["kv_of_head"]
        assert kv == [h // (HEADS // KV_HEADS) for h in range(HEADS)]


def test_probe_passes_do_not_grow_with_depth(tmp_path: Path, llama: tuple[Any, Any]) -> None:
    model, tok = llama
    with _counted(model.model) as without:
        _ingest(tmp_path / "none.actdb", model, tok, "none")
    with _counted(model.model) as with_weights:
        store = _ingest(tmp_path / "all.actdb", model, tok, "all")
    # the log pass, the one-token pass and the two-token pass; a pass a block was 1 + 2 * 5
    assert with_weights[0] - without[0] == 3
    _check_own(store, model)


def test_a_block_reached_by_another_blocks_perturbation_is_probed_alone(
        tmp_path: Path, llama: tuple[Any, Any]) -> None:
    model, tok = llama
    seen: dict[str, torch.Tensor] = {}

    def keep(module: Any, args: Any) -> None:
        seen["q"] = args[0]  # the heads' output, which the perturbed queries and keys move

    def leak(module: Any, args: Any) -> Any:
        q = seen.pop("q", None)
        if q is None or q.shape != args[0].shape:
            return None
        # what differs between rows of block 0's heads reaches block 1's input
        return (args[0] + (q - q[:1]), *args[1:])

    handles = [model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(keep),
               model.model.layers[1].register_forward_pre_hook(leak)]
    try:
        with _counted(model.model) as without:
            _ingest(tmp_path / "none.actdb", model, tok, "none")
        with _counted(model.model) as with_weights:
            store = _ingest(tmp_path / "all.actdb", model, tok, "all")
    finally:
        for h in handles:
            h.remove()
    # the shared passes, then two of their own for blocks 1 to 4, whose input the residual
    # stream carries the leak to
    _check_own(store, model)
    assert with_weights[0] - without[0] == 3 + 2 * (LAYERS - 1)
