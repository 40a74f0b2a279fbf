"""Loading: a folder with no tokenizer, a corrupt weights file, GGUF paths, and accelerate's
device_map with hooks still capturing every site (against a plain ingest of the same model)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import actdb
from actdb.ingestion.load import load

PROMPTS = ["The capital of France is Paris.", "the the the the"]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_folder_without_tokenizer_is_one_sentence(model_dir: Callable[[str], Path],
                                                  tmp_path: Path) -> None:
    folder = copy_model(model_dir("llama"), tmp_path / "m")
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    with pytest.raises(actdb.ModelLoadError, match=r"has no tokenizer \(none of tokenizer.json"):
        load(str(folder), device="cpu")


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_code_in_a_model_folder_never_runs(where: str, model_dir: Callable[[str], Path],
                                          tmp_path: Path) -> None:
    """A folder whose config, tokenizer config or model class names Python of its own
    (`auto_map`): transformers asked on standard input whether to run it, so anything that
    answered `y` (a pipe, `yes |`) ran the folder's code (review finding). actdb says no
    whatever stdin holds, in one sentence naming the way to load such a model (where the
    model type is one of transformers' own, its class loads it and nothing asks)."""
    import json
    import subprocess
    import sys

    folder = copy_model(model_dir("llama"), tmp_path / "m")
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    (folder / "evil_config.py").write_text(
        code + "from transformers import LlamaConfig\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")
    (folder / "evil_model.py").write_text(
        code + "from transformers import LlamaForCausalLM\n"
        "class EvilModel(LlamaForCausalLM):\n    pass\n")
    (folder / "evil_tok.py").write_text(
        code + "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTok(PreTrainedTokenizerFast):\n    pass\n")
    name, entry = {"config": ("config.json", {"AutoConfig": "evil_config.EvilConfig",
                                              "AutoModelForCausalLM": "evil_model.EvilModel"}),
                   "tokenizer": ("tokenizer_config.json",
                                 {"AutoTokenizer": [None, "evil_tok.EvilTok"]})}[where]
    data = json.loads((folder / name).read_text())
    data["auto_map"] = entry
    if where == "config":
        data["model_type"] = "evil"
    if where == "tokenizer":  # with a class of transformers' own named, that one is used
        data["tokenizer_class"] = "EvilTok"
    (folder / name).write_text(json.dumps(data))
    (tmp_path / "p.txt").write_text("one prompt\n")
    run = subprocess.run(
        [sys.executable, "-m", "actdb", "ingest", str(tmp_path / "s.actdb"), "--model",
         str(folder), "--prompts", str(tmp_path / "p.txt"), "--device", "cpu"],
        input="y\n" * 8, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert not marker.exists()
    assert run.returncode == 1, run.stderr
    assert "needs Python code of its own to load" in run.stderr and "Traceback" not in run.stderr
    assert "trust_remote_code=True" in run.stderr, run.stderr


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_weights_are_one_sentence(model_dir: Callable[[str], Path], tmp_path: Path,
                                          damage: str) -> None:
    folder = copy_model(model_dir("llama"), tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a model" * 9)
    with pytest.raises(actdb.ModelLoadError) as e:
        load(str(folder), device="cpu")
    text = str(e.value)
    assert "could not load the weights of" in text and "is the weights file complete?" in text
    assert "\n" not in text
    store = tmp_path / "s.actdb"
    with pytest.raises(actdb.ModelLoadError):
        actdb.ingest(store, model=folder, prompts=PROMPTS, device="cpu")


def test_gguf_paths_that_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(actdb.ModelLoadError, match=r"model path '.*missing.gguf' does not exist"):
        load(str(tmp_path / "missing.gguf"))
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(actdb.ModelLoadError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        load(str(tmp_path))
    with pytest.raises(actdb.ModelLoadError, match="could not load a model config from"):
        load(str(tmp_path / "a.gguf"))  # not a GGUF file at all: one sentence
    (tmp_path / "empty").mkdir()
    with pytest.raises(actdb.ModelLoadError, match="has no config.json and no .gguf file"):
        load(str(tmp_path / "empty"))


def test_a_mistyped_model_folder_is_said_to_be_missing(tmp_path: Path, monkeypatch) -> None:
    """A name that is no path here goes to the hub (offline in tests): the sentence says there
    is no such folder before the hub's complaint, which alone read as a network problem."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(actdb.ModelLoadError, match="could not load a model config from "
                       "'nosuch_model_dir': there is no folder or file of that name here, "
                       "and as a hub model name: "):
        load("nosuch_model_dir")


@pytest.mark.cpu_only  # its map places every module on the CPU, bit for bit as a plain load
def test_device_map_keeps_hooks_capturing(model_dir: Callable[[str], Path],
                                          tmp_path: Path) -> None:
    """accelerate places each module by an explicit map (all on CPU here: a machine with
    several devices spreads them); every site must still be captured, equal to a plain load."""
    pytest.importorskip("accelerate")
    folder = model_dir("llama")
    plain, mapped = tmp_path / "plain.actdb", tmp_path / "mapped.actdb"
    actdb.ingest(plain, model=folder, prompts=PROMPTS, device="cpu", name="m")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offload = {**device_map, "model.layers.1": "disk"}
    with pytest.raises(actdb.ModelLoadError, match=r"offloads \d+ modules to disk or meta \(first "
                       r"'model.layers.1.*'\); actdb needs every weight on a device"):
        load(str(folder), device_map=offload)
    summary = actdb.ingest(mapped, model=folder, prompts=PROMPTS, device_map=device_map,
                           name="m")
    assert summary.sites > 0 and summary.prompts_new == len(PROMPTS)
    auto = actdb.ingest(tmp_path / "auto.actdb", model=folder, prompts=PROMPTS,
                        device_map="auto", name="m")
    assert auto.sites == summary.sites
    q = "SELECT vec FROM acts ORDER BY site, prompt_id, position"
    with actdb.connect(plain) as a, actdb.connect(mapped) as b, \
            actdb.connect(tmp_path / "auto.actdb") as c:
        want = a.vectors(q).cpu().numpy()
        np.testing.assert_array_equal(b.vectors(q).cpu().numpy(), want)
        np.testing.assert_array_equal(c.vectors(q).cpu().numpy(), want)
        assert len(want) == a.sql("SELECT count(*) FROM acts").fetchone()[0]  # type: ignore[index]


def test_auto_dtype_on_cuda_keeps_the_weights_in_hand() -> None:
    """On CUDA, `auto` is the dtype of the weights: a model object's own (a caller's float32
    model is not cast to float16 under it), else the checkpoint's, else float16. No GPU is
    needed to resolve the choice; the GPU run below checks `load` with a model object."""
    import torch
    from transformers import GPT2Config

    from actdb.ingestion.load import resolve_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    config = GPT2Config()
    assert resolve_dtype("auto", cuda, config, weights=torch.float32) == torch.float32
    assert resolve_dtype("auto", cuda, config, weights=torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", cuda, GPT2Config(dtype="bfloat16")) == torch.bfloat16
    assert resolve_dtype("auto", cpu, config, weights=torch.bfloat16) == torch.float32
    assert resolve_dtype("float16", cuda, config, weights=torch.float32) == torch.float16


def test_a_model_object_keeps_its_dtype_on_the_gpu(model_dir: Callable[[str], Path]) -> None:
    import torch
    import transformers

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    folder = model_dir("gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    loaded = load(model, tok, device="cuda")
    assert loaded.dtype == torch.float32
    assert next(loaded.model.parameters()).dtype == torch.float32


def test_a_model_object_goes_back_where_it_was_after_a_gpu_ingest(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    import torch
    import transformers

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    folder = model_dir("gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    actdb.ingest(tmp_path / "s.actdb", model=model, tokenizer=tok, prompts=PROMPTS,
                 device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    model(**tok(PROMPTS[0], return_tensors="pt"))  # still runs on CPU inputs
