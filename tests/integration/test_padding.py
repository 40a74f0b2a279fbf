"""A model whose activations depend on the batch's padding (a tiny PaliGemma on text alone:
bidirectional over an unpadded input, causal once a padding mask is given) is batched by
length, so that every stored row is what the prompt gives alone; a causal model (Llama) keeps
its padded batches. The reference: each prompt run alone through plain
transformers, its norm modules' inputs captured with forward hooks, in float64."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support.vision_models import build_multimodal

import actdb
from actdb.ingestion.batches import plan_batches
from actdb.ingestion.prompts import Prompt
from actdb.ingestion.rows import Work

# two lengths, the short ones apart in the input, so that a plan in input order would pad
TEXTS = ["a b c", "a longer prompt with more words", "d e f", "hello"]


def _alone(folder: Path, texts: list[str]) -> tuple[object, list[dict[str, np.ndarray]]]:
    """(tokenizer, each text's norm inputs [T, d], run alone)."""
    import transformers as T

    model = T.AutoModelForImageTextToText.from_pretrained(folder).eval()
    tok = T.AutoProcessor.from_pretrained(folder).tokenizer
    out = []
    for text in texts:
        kept: dict[str, np.ndarray] = {}

        def keep(name: str, kept: dict[str, np.ndarray] = kept) -> object:
            def hook(m: torch.nn.Module, args: tuple[torch.Tensor, ...], o: object) -> None:
                kept.setdefault(name, args[0].detach().double()[0].numpy())
            return hook

        handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules()
                   if n.startswith("model.language_model") and "norm" in n]
        try:
            with torch.no_grad():
                model(**tok([text], return_tensors="pt"))
        finally:
            for h in handles:
                h.remove()
        out.append(kept)
    return tok, out


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    work = tmp_path_factory.mktemp("padding")
    folder = build_multimodal("paligemma", work)
    summary = actdb.ingest(work / "s.actdb", model=str(folder), prompts=TEXTS, batch_size=2,
                           device="cpu")
    return work / "s.actdb", folder, summary


def test_stored_rows_are_each_prompt_alone(paligemma: tuple[Path, Path, object]) -> None:
    store, folder, summary = paligemma
    said = [w for w in summary.warnings  # type: ignore[attr-defined]
            if "depend on the batch's padding" in w]
    assert len(said) == 1 and "\n" not in said[0], summary.warnings  # type: ignore[attr-defined]
    tok, alone = _alone(folder, TEXTS)
    db = actdb.connect(store)
    sites = db.sql("SELECT site, module FROM sites WHERE tower = 'text'").fetchall()
    assert len(sites) == 5
    for p, kept in enumerate(alone):
        for site, module in sites:
            got = np.array([r[0] for r in db.sql(
                "SELECT to_list(vec) FROM acts WHERE prompt_id = $p AND site = $s "
                "ORDER BY position", params={"p": p, "s": site}).fetchall()])
            want = kept[module]
            np.testing.assert_allclose(got, want, rtol=2e-3,
                                       atol=2e-3 * float(np.abs(want).max()), err_msg=site)


def test_a_causal_model_keeps_padded_batches(model_dir: Callable[[str], Path],
                                             tmp_path: Path) -> None:
    """A causal decoder's padded rows are its prompts' own up to rounding (the suite's
    reference checks of padded ingests): no warning, batches as planned."""
    summary = actdb.ingest(tmp_path / "s.actdb", model=str(model_dir("llama")), prompts=TEXTS,
                           batch_size=2, device="cpu", weights="none")
    assert not [w for w in summary.warnings if "padding" in w], summary.warnings


def test_length_batches_keep_input_order_within_a_length() -> None:
    def w(i: int, n: int) -> Work:
        return Work(prompt_id=i, prompt=Prompt(text=str(i)), ids=[1] * n, truncated=False,
                    new_prompt=True)

    work = [w(0, 3), w(1, 5), w(2, 3), w(3, 3), w(4, 5), w(5, 2)]
    ids = [[x.prompt_id for x in b] for b in plan_batches(work, 2, by_length=True)]
    assert ids == [[0, 2], [3], [1, 4], [5]]
    ids = [[x.prompt_id for x in b] for b in plan_batches(work, 2)]
    assert ids == [[0, 1], [2, 3], [4, 5]]
