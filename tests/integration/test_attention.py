"""Attention weights (`ingest --attention`, store/attention.py, query/attention_view.py): the
view holds the model's own `output_attentions` of an eager forward pass over each prompt
alone, bit for bit, though the ingest ran padded batches with SDPA attention for the vectors;
the vectors are the bytes an ingest without attention stores; the chunks are checked and bound
to their place; a store without attention says so in one sentence."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.tiny_models import CORPUS, make_tiny_model

import actdb
from actdb.errors import StoreCorruptError

PROMPTS = list(CORPUS[:3])


@pytest.fixture(scope="module")
def stores(tmp_path_factory: Any) -> tuple[Any, Path, Path]:
    """The tiny GPT-2 with SDPA attention, ingested in padded batches with and without
    --attention (no layer weights: they play no part here)."""
    model, tok = make_tiny_model("gpt2")
    model.set_attn_implementation("sdpa")
    root = tmp_path_factory.mktemp("attention")
    kw: dict[str, Any] = {"tokenizer": tok, "prompts": PROMPTS, "device": "cpu",
                          "batch_size": 2, "weights": "none"}
    actdb.ingest(root / "with.actdb", model=model, attention=True, **kw)
    assert model.config._attn_implementation == "sdpa"  # switched back after each pass
    actdb.ingest(root / "without.actdb", model=model, **kw)
    return model, root / "with.actdb", root / "without.actdb"


def _reference(model: Any, ids: list[int]) -> np.ndarray:
    """[layers, heads, n, n]: the model's own attention weights, eager, the prompt alone."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return torch.stack(out.attentions, dim=1)[0].numpy()


def _stored(db: actdb.Database, pid: int, shape: tuple[int, ...]) -> np.ndarray:
    rows = db.sql("SELECT layer, head, query_position, key_position, weight FROM attention "
                  "WHERE prompt_id = $p", params={"p": pid}).fetchnumpy()
    out = np.full(shape, np.nan)
    out[rows["layer"], rows["head"], rows["query_position"], rows["key_position"]] = (
        rows["weight"])
    return out


def test_attention_is_the_models_own(stores: tuple[Any, Path, Path]) -> None:
    model, with_attention, _ = stores
    with actdb.connect(with_attention) as db:
        for pid in range(len(PROMPTS)):
            ids = [r[0] for r in db.sql("SELECT token_id FROM tokens WHERE prompt_id = $p "
                                        "ORDER BY position", params={"p": pid}).fetchall()]
            ref = _reference(model, ids)
            got = _stored(db, pid, ref.shape)
            assert np.array_equal(got, ref.astype(np.float64)), pid  # every row, exactly
        one = db.sql("SELECT sum(weight) AS s FROM attention WHERE prompt_id = 1 AND "
                     "layer = 1 AND head = 2 GROUP BY query_position").fetchnumpy()["s"]
        assert np.allclose(one, 1.0, atol=1e-5)  # each query's weights sum to 1
        assert db.verify(full=True) == []


def test_vectors_are_unchanged_by_the_attention_pass(stores: tuple[Any, Path, Path]) -> None:
    _, with_attention, without = stores
    sql = "SELECT vec FROM acts ORDER BY prompt_id, site, position"
    with actdb.connect(with_attention) as a, actdb.connect(without) as b:
        assert torch.equal(a.vectors(sql), b.vectors(sql))


def test_a_store_without_attention_says_so(stores: tuple[Any, Path, Path]) -> None:
    with actdb.connect(stores[2]) as db, pytest.raises(actdb.QueryError,
                                                        match="holds no attention weights"):
        db.sql("SELECT * FROM attention").fetchall()


def test_attention_chunks_are_checked_and_bound_to_their_place(
        stores: tuple[Any, Path, Path], tmp_path: Path) -> None:
    copy = tmp_path / "s.actdb"
    shutil.copytree(stores[1], copy)
    folder = copy / "tensors.zarr" / "models" / "0" / "attention" / "0" / "c"
    a, b = folder / "0" / "0" / "0" / "0", folder / "1" / "0" / "0" / "0"
    first, second = a.read_bytes(), b.read_bytes()
    a.write_bytes(second)  # valid chunks swapped: each passes its own checksum
    b.write_bytes(first)
    with actdb.connect(copy) as db:
        with pytest.raises(StoreCorruptError, match="chunk 1 of array"):
            db.sql("SELECT weight FROM attention WHERE prompt_id = 0 AND layer = 0").fetchall()
        problems = db.verify(full=True)
    assert any("attention/0" in p for p in problems), problems
