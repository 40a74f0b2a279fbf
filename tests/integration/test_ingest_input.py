"""Prompts input at ingest: crafted JSONL keys never run SQL; malformed input is one sentence."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import actdb
from actdb.cli import cli
from actdb.ingestion.prompts import read_prompts


def _ingest(store: Path, model_dir: Callable[[str], Path], prompts: Any) -> actdb.IngestSummary:
    return actdb.ingest(store, model=str(model_dir("gpt2")), prompts=prompts, device="cpu",
                        name="gpt2", batch_size=4)


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_crafted_keys_are_column_names_not_sql(tmp_path: Path,
                                               model_dir: Callable[[str], Path]) -> None:
    target = tmp_path / "pwned.csv"
    keys = [
        f"x\" INTEGER); COPY (SELECT 1) TO '{target}'; --",
        f"a\"; COPY (SELECT 1) TO '{target}'; INSERT INTO prompts VALUES (99, 'fake', 1); --",
        "b\") SELECT 1; DELETE FROM prompts; --",
        "semi;colon", "quote'single", "space and \u00e9",
    ]
    records = [{"text": f"prompt number {i}", **{k: i for k in keys}} for i in range(3)]
    store = tmp_path / "s.actdb"
    _ingest(store, model_dir, _jsonl(tmp_path / "p.jsonl", records))
    assert not target.exists()
    with actdb.connect(store) as db:
        cols = db.sql("SELECT * FROM prompts ORDER BY prompt_id").columns
        assert cols[:3] == ["prompt_id", "text", "n_tokens"]
        assert sorted(cols[3:]) == sorted(keys)
        rows = db.sql("SELECT * FROM prompts ORDER BY prompt_id").fetchall()
        assert [r[:2] for r in rows] == [(i, f"prompt number {i}") for i in range(3)]
        assert [list(r[3:]) for r in rows] == [[i] * len(keys) for i in range(3)]
    # a second run with the same keys adds nothing and runs nothing
    again = _ingest(store, model_dir, _jsonl(tmp_path / "p2.jsonl", records))
    assert again.prompts_new == 0 and not target.exists()


def test_a_resume_with_nan_and_wide_integer_fields_says_nothing(
        tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    """Fields the store holds as they came say nothing on a resume (review finding: NaN, a
    DataFrame's missing value, is never equal to itself, and an integer past 2^53 in a DOUBLE
    column came back another number: both were said to differ on every run)."""
    records = [{"text": "prompt number 0", "score": float("nan"), "x": 1.5},
               {"text": "prompt number 1", "score": 2.0, "x": 2**53 + 1}]
    store = tmp_path / "s.actdb"
    first = _ingest(store, model_dir, records)
    assert first.warnings == []
    again = _ingest(store, model_dir, records + [records[0]])  # and a repeat within the input
    assert again.prompts_new == 0 and again.warnings == [], again.warnings
    changed = _ingest(store, model_dir, [{**records[1], "score": 3.0}])
    assert changed.warnings and "score (1 prompt)" in changed.warnings[0]


BAD_RECORDS = [
    # (lines of a .jsonl file, words the sentence must hold)
    ([{"text": "a", "": 1}], "line 1: field name '' is empty"),
    ([{"text": "a", " ": 1}], "field name ' ' is empty"),
    ([{"text": "a", "TEXT": "b"}], "field 'TEXT' is reserved"),
    ([{"text": "a", "Prompt_ID": 3}], "field 'Prompt_ID' is reserved"),
    ([{"text": "a", "n_tokens": 3}], "field 'n_tokens' is reserved"),
    ([{"text": "a", "x\u0000y": 3}], "control characters"),
    ([{"text": "a", "score": 1, "Score": 2}], "line 1: field 'Score' differs only in case "
                                             "from field 'score'"),
    ([{"text": "a", "score": 1}, {"text": "b", "SCORE": 2}], "line 2: field 'SCORE' differs "
                                                            "only in case from field 'score' "
                                                            "(line 1)"),
    ([{"text": "a", "score": 1}, {"text": "b", "score": "high"}],
     "line 2: field 'score' is a string here but an integer at line 1"),
    ([{"text": "a", "ok": True}, {"text": "b", "ok": 1}], "field 'ok' is an integer here but a "
                                                         "boolean"),
    ([{"text": "a", "tags": ["x"]}, {"text": "b", "tags": "x"}], "field 'tags' is a string here "
                                                                 "but a list"),
    ([{"text": "a", "m": {"k": 1}}, {"text": "b", "m": [1]}], "field 'm' is a list here but an "
                                                              "object"),
    ([{"text": "a", "big": 1 << 64}], "does not fit a 64-bit integer"),
    # a lone half of a surrogate pair (JSON's "\ud800"): the tokenizer raised a TypeError
    ([{"text": "ok"}, {"text": "bad \ud800 one"}], "line 2: its text holds a lone surrogate "
                                                  "U+D800 at character 4"),
    ([{"text": "a", "tag": ["x", {"k": "\udfff"}]}], "line 1: field 'tag' holds a lone "
                                                      "surrogate U+DFFF"),
    ([{"text": "a", "k\ud83d": 1}], "line 1: a field name holds a lone surrogate"),
]


@pytest.mark.parametrize(("records", "words"), BAD_RECORDS)
def test_bad_fields_are_one_sentence(records: list[dict[str, Any]], words: str,
                                     tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", records)
    with pytest.raises(actdb.PromptsError) as info:
        read_prompts(path)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_lone_surrogate_in_a_prompts_list_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(actdb.PromptsError, match=r"prompts\[1\]: its text holds a lone "
                                                 "surrogate U\\+D800 at character 1"):
        actdb.ingest(tmp_path / "s.actdb", model="unused", prompts=["fine", "x\ud800y"])
    assert not (tmp_path / "s.actdb").exists()
    # a whole pair is the character it encodes
    assert read_prompts([json.loads('"\\ud83d\\ude00"')])[0].text == "\U0001F600"


@pytest.mark.parametrize("records", [
    [{"text": "a", "score": 1}, {"text": "b", "score": 2.5}, {"text": "c", "score": None}],
    [{"text": "a", "x": None}, {"text": "b", "x": "s"}],
    [{"text": "a"}, {"text": "b", "y": [1, 2]}],
])
def test_compatible_fields_are_accepted(records: list[dict[str, Any]], tmp_path: Path) -> None:
    assert len(read_prompts(_jsonl(tmp_path / "p.jsonl", records))) == len(records)


def test_lines_end_at_line_feeds_only_and_a_byte_order_mark_is_no_text(tmp_path: Path) -> None:
    """A prompt may hold any character but a line feed: U+2028/2029, NEL, form feeds and
    group separators are text (str.splitlines breaks at them all), CRLF ends a line as LF
    does, and a UTF-8 byte-order mark (Notepad's) is not part of the first prompt."""
    odd = ["one\u2028two", "three\u2029four", "five\x85six", "seven\x0ceight",
           "nine\x1cten\x0beleven", "tab\there"]
    txt = tmp_path / "p.txt"
    txt.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(odd).encode() + b"\r\n")
    assert [p.text for p in read_prompts(txt)] == odd
    jsonl = tmp_path / "p.jsonl"  # JSON may hold U+2028 raw inside a string
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\n".join(
        json.dumps({"text": t, "n": i}, ensure_ascii=False) for i, t in enumerate(odd)
    ).encode())
    got = read_prompts(jsonl)
    assert [(p.text, p.extra["n"]) for p in got] == [(t, i) for i, t in enumerate(odd)]
    txt.write_bytes("\r".join(odd).encode())  # an old Mac file's lone CRs end lines too
    assert [p.text for p in read_prompts(txt)] == odd


def test_a_format_overrides_the_suffix_and_the_sniff(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Standard input starting with '{' is taken for JSON Lines; when it is text the error
    says how to read it as text, and the format option does."""
    import io
    import sys

    text = "{braces} open this prompt\nand a second one\n"

    def stdin(data: str) -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data.encode())))

    stdin(text)
    with pytest.raises(actdb.PromptsError, match="--prompts-format txt"):
        read_prompts("-")
    stdin(text)
    assert [p.text for p in read_prompts("-", format="txt")] == [
        "{braces} open this prompt", "and a second one"]
    data = tmp_path / "p.data"
    data.write_text('{"text": "a", "k": 1}\n', encoding="utf-8")
    assert [(p.text, dict(p.extra)) for p in read_prompts(data, format="jsonl")] == [
        ("a", {"k": 1})]
    assert [p.text for p in read_prompts(data)] == ['{"text": "a", "k": 1}']
    with pytest.raises(actdb.PromptsError, match="format 'csv' is not one of txt, jsonl"):
        read_prompts(data, format="csv")


@pytest.mark.parametrize(("data", "words"), [
    (b"good line\nbad \xff byte\n", "line 2: not valid UTF-8 at byte 14 (column 5"),
    (b"\xc3(\n", "line 1: not valid UTF-8 at byte 0"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "line 2: not valid UTF-8"),
])
def test_invalid_utf8_names_line_and_byte(data: bytes, words: str, tmp_path: Path) -> None:
    path = tmp_path / ("p.jsonl" if data.startswith(b"{") else "p.txt")
    path.write_bytes(data)
    with pytest.raises(actdb.PromptsError, match="save the file as UTF-8") as info:
        read_prompts(path)
    assert words in str(info.value), str(info.value)
    res = CliRunner().invoke(cli, ["ingest", str(tmp_path / "s.actdb"), "--model", "unused",
                                   "--prompts", str(path)])
    assert res.exit_code == 1 and words in res.output and "Traceback" not in res.output


def test_a_field_that_changes_type_between_runs(tmp_path: Path,
                                                model_dir: Callable[[str], Path]) -> None:
    store = tmp_path / "s.actdb"
    _ingest(store, model_dir, [{"text": "first prompt", "score": 1, "Label": "x"}])
    for records, words in (
        ([{"text": "second prompt", "score": "high"}],
         "field 'score' holds VARCHAR values in these prompts but the store's prompts.score "
         "column is BIGINT"),
        ([{"text": "third prompt", "label": "y"}],
         "field 'label' differs only in case from the store's prompts column 'Label'"),
    ):
        with pytest.raises(actdb.PromptsError) as info:
            _ingest(store, model_dir, records)
        assert words in str(info.value), str(info.value)
    # an integer field may take numbers with a point in a later run only if the column is
    # DOUBLE; the other way round (integers into a DOUBLE column) is fine
    _ingest(store, model_dir, [{"text": "fourth prompt", "score": 4}])
    # a field null in every prompt of a run fits any column (here BIGINT and VARCHAR)
    _ingest(store, model_dir, [{"text": "fifth prompt", "score": None, "Label": None,
                                "fresh": None}])
    with actdb.connect(store) as db:
        assert db.sql("SELECT text, score, Label, fresh FROM prompts ORDER BY prompt_id"
                      ).fetchall() == [("first prompt", 1, "x", None),
                                       ("fourth prompt", 4, None, None),
                                       ("fifth prompt", None, None, None)]


def test_set_up_reads_the_catalog_on_one_connection_and_probes_without_the_head(
    model_dir: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its first batch an ingest opens the catalog file for its reads once (each open
    replays DuckDB's log), not once a read; it runs two small forward passes, the LM head in
    only one of them. The stored values are checked elsewhere: this is the cost."""
    import duckdb
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actdb.ingestion import register, run
    from actdb.store import catalog_connection as catalog_module
    from actdb.store import catalog_lock

    path = model_dir("gpt2")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    store = tmp_path / "s.actdb"
    # The heavy set-up work (decoding the vocabulary, comparing a stored model's weights)
    # runs with the catalog closed: readers in other processes wait while it is open.
    locked_during: list[bool] = []

    def watching(f: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            locked_during.append(catalog_lock.held_here(store / "catalog.duckdb"))
            return f(*a, **kw)
        return run

    monkeypatch.setattr(register, "vocab_table", watching(register.vocab_table))
    monkeypatch.setattr(register, "check_same_weights",
                        watching(register.check_same_weights))
    actdb.ingest(store, model=model, tokenizer=tok, prompts=["one prompt first"])

    opened: list[str] = []
    real_connect = duckdb.connect

    def connect(database: Any = ":memory:", *a: Any, **kw: Any) -> Any:
        opened.append(str(database))
        return real_connect(database, *a, **kw)

    head_rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: head_rows.append(int(args[0].shape[:-1].numel())))
    passes: list[int] = []
    base_hook = model.base_model.register_forward_pre_hook(
        lambda m, args: passes.append(1))

    class Stop(Exception):
        pass

    def stop(*a: Any, **kw: Any) -> None:
        raise Stop

    real_attach = catalog_module.CatalogConnection._attach

    def attach(self: Any) -> Any:
        opened.append(f"attached {self.path}")
        return real_attach(self)

    monkeypatch.setattr(catalog_module.duckdb, "connect", connect)
    monkeypatch.setattr(catalog_module.CatalogConnection, "_attach", attach)
    monkeypatch.setattr(run.BatchRunner, "run", stop)
    try:
        with pytest.raises(Stop):
            actdb.ingest(store, model=model, tokenizer=tok,
                         prompts=["a second prompt", "and a third one here"])
    finally:
        hook.remove()
        base_hook.remove()
    catalog_opens = [p for p in opened if p.endswith("catalog.duckdb")]
    # the store's own check at open, its format version, then the model's reads and the
    # prompts' reads (eleven before they were grouped)
    assert len(catalog_opens) <= 4, catalog_opens
    # each an attach of the file to one DuckDB instance, started once (20-30 ms of CPU each
    # time one starts)
    assert all(p.startswith("attached") for p in catalog_opens), opened
    assert len(opened) - len(catalog_opens) == 1, opened
    assert locked_during == [False, False], locked_during
    # five forward passes before the first batch: find_sites' first runs the base model alone
    # (no LM head), its second the whole model with the logit fit hooked on the final norm,
    # the LM head over its 3 x 7 positions; then the padding probe's three of the base model
    # (the shortest and the longest prompt alone, then together), none through the head
    assert len(passes) == 5 and head_rows == [21], (passes, head_rows)


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_probe_passes_keep_every_position_where_a_norm_follows_the_cut(family: str) -> None:
    """A causal LM whose LM head holds a norm (RoBERTa's lm_head.layer_norm, BERT's
    cls.predictions.transform.LayerNorm) runs it after `logits_to_keep` cuts the sequence: its
    probe passes keep every position, and its sites are found as without the cut (review
    finding: with the cut, site finding failed on that norm's [3, 1, d] input)."""
    import torch
    from transformers import BertConfig, BertLMHeadModel, RobertaConfig, RobertaForCausalLM

    from actdb.ingestion import sites

    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=64, is_decoder=True, max_position_embeddings=64)
    model = (RobertaForCausalLM(RobertaConfig(**kw, pad_token_id=1)) if family == "roberta"
             else BertLMHeadModel(BertConfig(**kw))).eval()
    sample = {"input_ids": torch.randint(3, 60, (3, 11)),
              "attention_mask": torch.ones(3, 11, dtype=torch.long)}
    alt = {"input_ids": torch.randint(3, 60, (3, 7)),
           "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    found, n_layers = sites.find_sites(model, sample, alt)
    head_norm = [f.record for f in found if not f.record.module.startswith(
        model.base_model_prefix + ".")]
    assert n_layers == 2 and head_norm, [f.record.module for f in found]


def test_a_site_filter_without_the_norm_the_lm_head_reads_is_refused(tmp_path: Path) -> None:
    """RoBERTa-PreLayerNorm has two norms after its blocks: the base model's last LayerNorm
    ("final_1") and one inside the LM head, after a dense layer ("final"), whose output the
    unembedding reads. A site filter that keeps the first and not the second takes the logit
    fit's fallback (a pass of its own, hooked on the site kept); the logits are no scale of
    W_U . final(x) there, so the ingest is refused in one sentence naming the module to add,
    before anything is written; with the head's norm kept, the logits come from it."""
    from support.real_families import build
    from support.tiny_models import build_family_tokenizer

    tok = build_family_tokenizer("llama")
    model = build("roberta-prelayernorm", len(tok))
    kw: dict[str, Any] = {"model": model, "tokenizer": tok, "prompts": ["one prompt here"],
                          "device": "cpu", "name": "m"}
    with pytest.raises(actdb.IngestError) as e:
        actdb.ingest(tmp_path / "a.actdb", sites="embed,blocks.*,final_1", **kw)
    assert "leaves out 'lm_head.layer_norm', the norm whose output the LM head reads" in str(
        e.value)
    assert not (tmp_path / "a.actdb").exists()
    actdb.ingest(tmp_path / "b.actdb", sites="embed,final", **kw)
    with actdb.connect(tmp_path / "b.actdb") as db:
        assert db.sql("SELECT final_site, logit_max_rel_error < 1e-2 FROM models").fetchall() == [
            ("final", True)]


def test_a_norm_module_that_runs_twice_in_a_pass_is_refused_unless_left_out(
        tmp_path: Path) -> None:
    """A site is one vector a token; a norm module that runs more than once in a forward pass
    (weights shared between blocks, or a recurrent model such as HRM, whose modules run 2-6
    times) would store its first run's input while the model goes on from its last. The
    ingest is refused in one sentence naming the module, before anything is written; leaving
    the shared module out with --sites ingests the rest, faithfully."""
    import torch
    from support.real_families import COMMON
    from support.tiny_models import build_family_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from actdb.errors import ModelLoadError

    tok = build_family_tokenizer("llama")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                       vocab_size=len(tok), bos_token_id=0,
                                       eos_token_id=0)).eval()
    model.transformer.h[1].ln_1 = model.transformer.h[0].ln_1  # one LayerNorm in both blocks
    kw: dict[str, Any] = {"model": model, "tokenizer": tok, "prompts": ["one prompt here"],
                          "device": "cpu", "name": "m"}
    with pytest.raises(ModelLoadError) as e:
        actdb.ingest(tmp_path / "a.actdb", **kw)
    assert str(e.value).startswith("norm module 'transformer.h.0.ln_1' (site 'blocks.0.ln1') "
                                   "runs 2 times in one forward pass")
    assert "--sites" in str(e.value)
    assert not (tmp_path / "a.actdb").exists()
    summary = actdb.ingest(tmp_path / "b.actdb", sites="blocks.*.ln2,final", **kw)
    assert summary.sites == 3 and max(summary.max_rel_error.values()) < 1e-2

    config = AutoConfig.for_model("hrm_text", **COMMON, vocab_size=len(tok))
    hrm = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ModelLoadError, match=r"runs 6 times in one forward pass, as 10 of "
                       r"the 10 sites' modules do \(a recurrent or weight-shared model\)"):
        actdb.ingest(tmp_path / "c.actdb", **{**kw, "model": hrm})


def test_the_collector_skips_what_existed_before_the_ingest_and_is_given_back(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """During an ingest the objects that existed when it started (torch, transformers, the
    model) are frozen out of the cyclic collector's walks; after it, success or failure, the
    collector is as it was, and a process that froze objects itself keeps them frozen."""
    import gc

    inside: list[int] = []
    kw: dict[str, Any] = {"model": str(model_dir("gpt2")), "device": "cpu", "name": "m",
                          "on_plan": lambda plan: inside.append(gc.get_freeze_count())}
    # A process may start with objects frozen (375 under Ubuntu 24.04's Python 3.12 with its
    # torch); the test starts from none and freezes again at the end if there were some.
    before = gc.get_freeze_count()
    gc.unfreeze()
    try:
        actdb.ingest(tmp_path / "a.actdb", prompts=["one prompt"], **kw)
        assert inside[-1] > 10_000 and gc.get_freeze_count() == 0, inside
        with pytest.raises(actdb.IngestError, match="other sites"):  # failed after the freeze
            actdb.ingest(tmp_path / "a.actdb", prompts=["two"], sites="final", **kw)
        assert gc.get_freeze_count() == 0
        gc.freeze()  # the caller's own arrangement
        mine = gc.get_freeze_count()
        actdb.ingest(tmp_path / "a.actdb", prompts=["three prompts"], **kw)
        # (frozen objects freed meanwhile leave the count; none were thawed or added)
        assert mine - 1000 < inside[-1] <= mine, (mine, inside)
        assert mine - 1000 < gc.get_freeze_count() <= mine, (mine, gc.get_freeze_count())
    finally:
        gc.unfreeze()
        if before:
            gc.freeze()


def test_the_last_batch_is_committed_alone(model_dir: Callable[[str], Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches are committed in groups, but the last batch is a group of its own: its commit
    is the one no forward pass overlaps, so the batches before it are written meanwhile."""
    from actdb.store.store import Store

    sizes: list[int] = []
    real = Store.commit_batch

    def commit_batch(self: Store, *a: Any, **kw: Any) -> int:
        sizes.append(kw["tokens"].num_rows)
        return real(self, *a, **kw)

    monkeypatch.setattr(Store, "commit_batch", commit_batch)
    prompts = [f"prompt number {i} is here" for i in range(5)]
    summary = actdb.ingest(tmp_path / "s.actdb", model=str(model_dir("gpt2")), prompts=prompts,
                           batch_size=2, device="cpu", name="m")
    with actdb.connect(tmp_path / "s.actdb") as db:
        last = db.sql("SELECT n_tokens FROM prompts ORDER BY prompt_id DESC LIMIT 1").fetchall()
    # batches of 2, 2 and 1 prompts, far below a group's 2,048 rows: the first two together
    assert len(sizes) == 2 and sizes[1] == last[0][0], sizes
    assert sum(sizes) == summary.tokens_written



# Prompts of 8, 15, 8 and 26 tokens for the tiny GPT-2: in batches of two, the last batch's
# rows (23 to 57) share a chunk of 4 rows with the first batch's, fill some whole and end in a
# partial one.
_AHEAD_PROMPTS = ["one two three", "four five six seven eight", "nine ten eleven",
                  "a last prompt of a few more words than the others!"]


def _rows_are_the_models(store: Path, model: Any, tok: Any) -> None:
    """Every stored direction and norm row of every site is the norm input the model computes
    for its prompt (a float64 reference from the model's own forward, one prompt at a time)."""
    import numpy as np
    import torch

    from actdb.store.store import Store

    norms = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    with actdb.connect(store) as db:
        runs = db.sql("SELECT p.text, r.row_start, r.n_tokens FROM prompt_runs r "
                      "JOIN prompts p USING (prompt_id) ORDER BY r.row_start").fetchall()
        sites = dict(db.sql("SELECT module, site FROM sites").fetchall())
    assert sorted(sites) == sorted(norms) and [r[0] for r in runs] == _AHEAD_PROMPTS

    def keep(seen: dict[str, np.ndarray], name: str) -> Callable[..., None]:
        def hook(mod: Any, args: tuple[Any, ...]) -> None:
            seen.setdefault(name, args[0][0].double().numpy())
        return hook

    expected: dict[str, list[np.ndarray]] = {s: [] for s in sites.values()}
    for text, _, n in runs:
        seen: dict[str, np.ndarray] = {}
        hooks = [m.register_forward_pre_hook(keep(seen, name)) for name, m in norms.items()]
        try:
            with torch.no_grad():
                model(**tok(text, return_tensors="pt"))
        finally:
            for h in hooks:
                h.remove()
        for module, site in sites.items():
            assert len(seen[module]) == n
            expected[site].append(seen[module])
    total = runs[-1][1] + runs[-1][2]
    with Store(store) as st:
        for site, parts in expected.items():
            x = np.concatenate(parts)  # [rows, d], float64
            ref_norm = np.linalg.norm(x, axis=-1)
            got = st.arrays.read_chunks(0, site, "direction", 0, -(-total // 4))[:total]
            norm = st.arrays.read_chunks(0, site, "norm", 0, 1)[:total]
            np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
            # float16 directions: within float16's rounding of the reference
            np.testing.assert_allclose(got.astype(np.float64), x / ref_norm[:, None],
                                       rtol=1e-3, atol=1e-4)


def test_the_last_batch_is_written_during_its_forward_pass_and_every_row_is_the_models(
        model_dir: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last batch's whole direction chunks are written while its forward pass runs (each
    site's once its hook has checked it), and only the chunks it shares with other rows at its
    commit; every stored row is then the model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actdb.store.act_arrays import ActArrays
    from actdb.store.arrays import Arrays
    from actdb.store.store import Store

    path = model_dir("gpt2")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    inside = [False]  # in a forward pass of the model (the one the ingest runs)
    model.base_model.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
    model.base_model.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))
    events: list[tuple[str, int, int]] = []
    ahead: list[tuple[str, bool, tuple[int, int]]] = []
    writes: list[tuple[str, int, int]] = []
    real_ahead, real_whole = Store.write_ahead, Arrays.write_whole_chunks
    real_commit, real_write = Store.commit_batch, ActArrays._write_raw

    def write_ahead(self: Store, model: Any, site: str, start: int, direction: Any) -> Any:
        events.append(("ahead", start, len(direction)))
        during = inside[0]
        future = real_ahead(self, model, site, start, direction)
        ahead.append((site, during, future.result()))
        return future

    def commit_batch(self: Store, *a: Any, **kw: Any) -> int:
        events.append(("commit", kw["start"], kw["tokens"].num_rows))
        return real_commit(self, *a, **kw)

    def write_raw(self: ActArrays, raw: Any, start: int, value: Any) -> None:
        writes.append((raw.label, start, start + len(value)))
        real_write(self, raw, start, value)

    monkeypatch.setattr(Store, "write_ahead", write_ahead)
    monkeypatch.setattr(Store, "commit_batch", commit_batch)
    monkeypatch.setattr(ActArrays, "_write_raw", write_raw)
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, tokenizer=tok, prompts=_AHEAD_PROMPTS, batch_size=2,
                 device="cpu", name="m", chunk_tokens=4)
    assert real_whole is Arrays.write_whole_chunks
    commits = [e for e in events if e[0] == "commit"]
    # two batches of two prompts: the last is committed alone, its rows of every site handed
    # to the writers during its forward pass, before that commit began
    assert len(commits) == 2 and len(ahead) == 5, events
    last_start, last_n = commits[-1][1:]
    assert last_start % 4 and (last_start + last_n) % 4 and last_n >= 8, events
    assert all(e[1:] == (last_start, last_n) for e in events if e[0] == "ahead"), events
    assert events.index(commits[-1]) > max(i for i, e in enumerate(events) if e[0] == "ahead")
    a, b = -(-last_start // 4) * 4, (last_start + last_n) // 4 * 4
    for site, during, done in ahead:
        assert during and done == (a, b), (site, during, done)
        # each of those rows written once (ahead), the rest of the batch's rows once more
        direction = [w for w in writes if w[0].endswith(f"/{site}/direction")]
        covered = sorted(r for lo, hi in (w[1:] for w in direction) for r in range(lo, hi))
        assert covered == list(range(last_start + last_n)), (site, direction)
    _rows_are_the_models(store, model, tok)


def test_a_last_batch_that_fails_its_check_leaves_rows_a_rerun_replaces(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """A site that fails its faithfulness check in the last batch, after earlier sites' rows
    were written ahead: nothing of the batch is committed, and the rerun (resuming) stores the
    model's rows over what was written ahead."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir("gpt2")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    broken = [True]
    # the last batch, which starts with the third prompt: the padding probe's batch of the
    # shortest prompt and the longest has the last batch's shape, and must pass
    last_first = tok(_AHEAD_PROMPTS[2])["input_ids"]
    starts: list[list[int]] = []

    def note(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        starts.append(ids[0, : len(last_first)].tolist() if ids is not None else [])

    def shift(module: Any, args: Any, output: Any) -> Any:
        if not (broken[0] and starts and starts[-1] == last_first):
            return None
        return (output[0] + 0.5, *output[1:]) if isinstance(output, tuple) else output + 0.5

    # the first attention's output shifted (what the next norms see differs from the model
    # fixed below, but each norm's output still follows from its input), then the second
    # block's second norm made unfaithful: the rows of three sites are written ahead first
    handles = [model.transformer.register_forward_pre_hook(note, with_kwargs=True),
               model.transformer.h[0].attn.register_forward_hook(shift),
               model.transformer.h[1].ln_2.register_forward_hook(shift)]
    store = tmp_path / "s.actdb"
    kw: dict[str, Any] = {"model": model, "tokenizer": tok, "prompts": _AHEAD_PROMPTS,
                          "batch_size": 2, "device": "cpu", "name": "m", "chunk_tokens": 4}
    with pytest.raises(actdb.IngestError, match=r"blocks.1.ln2.*differs from the module"):
        actdb.ingest(store, **kw)
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompt_runs").fetchall() == [(2,)]
    broken[0] = False
    for h in handles:
        h.remove()
    # one prompt a batch: the last prompt's batch is written ahead again, over chunks the
    # failed run wrote ahead with other values
    summary = actdb.ingest(store, **{**kw, "batch_size": 1})
    assert summary.prompts_new == 2 and summary.prompts_skipped == 2
    _rows_are_the_models(store, model, tok)


def test_a_norm_over_no_tokens_is_no_site_and_the_filter_leaves_out_unknown_layouts(
        tmp_path: Path) -> None:
    """DeBERTa-v3 (`norm_rel_ebd="layer_norm"`) normalizes its table of relative-position
    embeddings, whose shape follows no batch or length: that is no site, and the model is
    ingested (it was refused with a layout message, which --sites could not get around: review
    finding). A norm that does see tokens, in a layout actdb does not know ([T, B, d]), is
    still refused in one sentence, unless the site filter leaves it out by its module path."""
    import torch
    from support.tiny_models import build_family_tokenizer
    from torch import nn
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM, GPT2Config, GPT2LMHeadModel

    from actdb.errors import ModelLoadError

    tok = build_family_tokenizer("bert")
    torch.manual_seed(0)
    deberta = DebertaV2ForMaskedLM(DebertaV2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, relative_attention=True, position_buckets=16,
        pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", vocab_size=len(tok),
        pad_token_id=0)).eval()
    actdb.ingest(tmp_path / "d.actdb", model=deberta, tokenizer=tok, prompts=["a b c d"],
                 device="cpu", name="deberta")
    with actdb.connect(tmp_path / "d.actdb") as db:
        modules = [r[0] for r in db.sql("SELECT module FROM sites").fetchall()]
        assert db.sql("SELECT count(*) FROM acts WHERE site = 'final'").fetchall()[0][0] > 0
    assert "deberta.encoder.LayerNorm" not in modules and len(modules) == 4, modules

    class SeqFirst(nn.Module):  # a LayerNorm that sees [T, B, d]
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x.transpose(0, 1)).transpose(0, 1).contiguous()

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      vocab_size=len(tok), bos_token_id=0,
                                      eos_token_id=0)).eval()
    gpt2.transformer.h[0].ln_1 = SeqFirst(32)
    kw: dict[str, Any] = {"model": gpt2, "tokenizer": tok, "prompts": ["a b c d"],
                          "device": "cpu", "name": "m"}
    with pytest.raises(ModelLoadError, match=r"^norm module 'transformer\.h\.0\.ln_1\.norm' "
                                             r"sees inputs of shape \(11, 3, 32\)"):
        actdb.ingest(tmp_path / "g.actdb", **kw)
    assert not (tmp_path / "g.actdb").exists()
    with pytest.raises(ModelLoadError, match=r"^norm module 'transformer\.h\.0\.ln_1\.norm' "):
        actdb.ingest(tmp_path / "g.actdb", sites="blocks.*,final", **kw)  # its name is kept
    actdb.ingest(tmp_path / "g.actdb", sites="blocks.1.*,final", **kw)
    with actdb.connect(tmp_path / "g.actdb") as db:
        assert [r[0] for r in db.sql("SELECT site FROM sites ORDER BY site_id").fetchall()] == [
            "blocks.1.ln1", "blocks.1.ln2", "final"]

    class FixedLength(nn.Module):  # a LayerNorm over every input padded to 16 tokens
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            return self.norm(torch.nn.functional.pad(x, (0, 0, 0, 16 - t)))[:, :t].contiguous()

    # the same shape at both lengths, but a batch axis: tokens, not a table; refused, not
    # left out silently
    gpt2.transformer.h[0].ln_1 = FixedLength(32)
    with pytest.raises(ModelLoadError, match=r"^norm module 'transformer\.h\.0\.ln_1\.norm' "
                                             r"sees inputs of shape \(3, 16, 32\)"):
        actdb.ingest(tmp_path / "f.actdb", **kw)


def _modernbert(tok: Any) -> Any:
    import torch
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(0)
    return ModernBertForMaskedLM(ModernBertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
        cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)).eval()


def _final_logits_match(db: Any, model: Any, tok: Any, site: str, text: str) -> int:
    import torch

    rows = db.sql(f"SELECT a.position, logit(vec, 5) FROM acts a JOIN prompts p "
                  f"USING (prompt_id) WHERE a.site = '{site}' AND p.text = $t "
                  "ORDER BY a.position", params={"t": text}).fetchall()
    with torch.no_grad():
        real = model(**tok(text, return_tensors="pt")).logits[0, :, 5].double()
    for position, value in rows:
        assert abs(value - float(real[position])) <= 1e-3 * max(1.0, abs(float(real[position])))
    return len(rows)


def test_the_site_named_final_is_the_one_the_lm_head_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ModernBERT runs its base model's final norm, then its MLM head's own norm (after a
    dense layer): both have the role `final`. The one the LM head reads is named `final`, so
    that `site = 'final'` gives the model's own logits (the earlier one was `final`, the head's
    `final_2`: review finding); the other is `final_1`. A store written with the old names
    keeps them when an ingest adds prompts to it, and its `final_2` gives the logits."""
    from support.tiny_models import build_family_tokenizer

    from actdb.ingestion import process

    tok = build_family_tokenizer("bert")
    model = _modernbert(tok)
    kw: dict[str, Any] = {"model": model, "tokenizer": tok, "device": "cpu", "name": "mb"}
    actdb.ingest(tmp_path / "new.actdb", prompts=["the cat sat on the mat"], **kw)
    with actdb.connect(tmp_path / "new.actdb") as db:
        assert db.sql("SELECT site, module FROM sites WHERE role = 'final' "
                      "ORDER BY site_id").fetchall() == [("final_1", "model.final_norm"),
                                                         ("final", "head.norm")]
        assert db.sql("SELECT final_site FROM models").fetchall() == [("final",)]
        assert _final_logits_match(db, model, tok, "final", "the cat sat on the mat") > 3

    real_find = process.find_sites
    old_names = {"final_1": "final", "final": "final_2"}

    def find_with_old_names(*a: Any, **k: Any) -> Any:  # the naming of earlier versions
        found, n = real_find(*a, **k)
        return [dataclasses.replace(f, record=dataclasses.replace(
            f.record, site=old_names.get(f.record.site, f.record.site))) for f in found], n

    monkeypatch.setattr(process, "find_sites", find_with_old_names)
    actdb.ingest(tmp_path / "old.actdb", prompts=["the cat sat on the mat"], **kw)
    actdb.ingest(tmp_path / "old-head.actdb", prompts=["the cat sat on the mat"],
                 sites="embed,final", **kw)  # the head's norm, then called final_2
    monkeypatch.setattr(process, "find_sites", real_find)
    actdb.ingest(tmp_path / "old.actdb", prompts=["a dog of the house ran"], **kw)
    with actdb.connect(tmp_path / "old.actdb") as db:
        assert db.sql("SELECT final_site FROM models").fetchall() == [("final_2",)]
        assert [r[0] for r in db.sql("SELECT site FROM sites WHERE role = 'final' "
                                     "ORDER BY site_id").fetchall()] == ["final", "final_2"]
        assert _final_logits_match(db, model, tok, "final_2", "a dog of the house ran") > 3
    # The old run's filter names a site by its old name: refused, saying what was renamed;
    # today's name for it resumes the store, which keeps its names.
    with pytest.raises(actdb.IngestError, match=r"the store names the norm its LM head reads "
                                                r"'final_2'.*--sites now names it 'final'"):
        actdb.ingest(tmp_path / "old-head.actdb", prompts=["a dog of the house ran"],
                     sites="embed,final_2", **kw)
    actdb.ingest(tmp_path / "old-head.actdb", prompts=["a dog of the house ran"],
                 sites="embed,final", **kw)
    with actdb.connect(tmp_path / "old-head.actdb") as db:
        assert [r[0] for r in db.sql("SELECT site FROM sites ORDER BY site_id").fetchall()] == [
            "embed", "final_2"]
        assert _final_logits_match(db, model, tok, "final_2", "a dog of the house ran") > 3


def test_a_projection_between_the_final_norm_and_the_lm_head_is_said(tmp_path: Path) -> None:
    """OPT with word_embed_proj_dim below its width projects the final norm's output
    (project_out) before its LM head: the logits are no function actdb computes from the
    final site. The refusal says so, with both widths, before anything is written (it said
    "its logits do not come from its final norm": review finding)."""
    import torch
    from support.tiny_models import build_family_tokenizer
    from transformers import OPTConfig, OPTForCausalLM

    tok = build_family_tokenizer("llama")
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
        max_position_embeddings=64, do_layer_norm_before=True, word_embed_proj_dim=16,
        vocab_size=len(tok), pad_token_id=tok.pad_token_id)).eval()
    with pytest.raises(actdb.IngestError) as e:
        actdb.ingest(tmp_path / "o.actdb", model=model, tokenizer=tok, prompts=["a b c"],
                     device="cpu", name="opt")
    assert str(e.value) == (
        "model 'opt': its LM head reads vectors of width 16, and its final norm "
        "'model.decoder.final_layer_norm' gives width 32: a layer between them (a projection, "
        "as OPT's project_out) makes the logits, which actdb computes as W_U . final_norm(x) "
        "+ b_U")
    assert not (tmp_path / "o.actdb").exists()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_post_norm_roles_do_not_depend_on_the_dtype(dtype: str) -> None:
    """A post-norm block's mid-block norm (DistilBERT's `sa_layer_norm(attn + x)`, whose
    output the MLP reads and the block carries on) is post_attn, told from a pre-norm block's
    pre_mlp norm (GPT-2's ln_2, whose input is carried on) by the next norm's input; in each
    dtype the model may run in, whose rounding the comparison allows for (it asked float32's
    of bfloat16: review finding)."""
    import torch
    from support.tiny_models import randomize_norms
    from transformers import DistilBertConfig, DistilBertForMaskedLM, GPT2Config, GPT2LMHeadModel

    from actdb.ingestion.sites import find_sites

    ids = torch.randint(5, 100, (3, 11), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    alt = {k: v[:, :7] for k, v in sample.items()}
    torch.manual_seed(0)
    distil = DistilBertForMaskedLM(DistilBertConfig(
        vocab_size=100, dim=32, hidden_dim=128, n_layers=2, n_heads=2,
        max_position_embeddings=64)).eval()
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      vocab_size=100)).eval()
    roles = {}
    for model in (distil, gpt2):
        randomize_norms(model, seed=2)
        found, _ = find_sites(model.to(getattr(torch, dtype)), sample, alt)
        roles.update({f.record.module: f.record.role for f in found})
    assert [roles[f"distilbert.transformer.layer.{i}.sa_layer_norm"] for i in (0, 1)] == [
        "post_attn", "post_attn"]
    assert [roles[f"distilbert.transformer.layer.{i}.output_layer_norm"] for i in (0, 1)] == [
        "post_mlp", "post_mlp"]
    assert [roles[f"transformer.h.{i}.ln_2"] for i in (0, 1)] == ["pre_mlp", "pre_mlp"]


def test_a_block_whose_mlp_is_its_own_layers_gets_its_roles(tmp_path: Path) -> None:
    """OPT's MLP is no module: fc1 and fc2 are the block's own layers. They stand for it, so
    OPT-350m's post-norm blocks (do_layer_norm_before=False) have post_attn and post_mlp norms
    and `delta` is NULL there (both were pre_mlp, and `delta` a difference across the next
    norm: review finding), while the pre-norm OPT keeps pre_attn and pre_mlp and its `delta`
    is what the sublayer wrote: the next site's input minus this one's."""
    import numpy as np
    import torch
    from support.tiny_models import build_family_tokenizer
    from transformers import OPTConfig, OPTForCausalLM

    tok = build_family_tokenizer("llama")
    roles = {}
    for before in (False, True):
        torch.manual_seed(0)
        model = OPTForCausalLM(OPTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
            max_position_embeddings=64, do_layer_norm_before=before, vocab_size=len(tok),
            pad_token_id=tok.pad_token_id)).eval()
        store = tmp_path / f"opt-{before}.actdb"
        actdb.ingest(store, model=model, tokenizer=tok, prompts=["the cat sat on the mat"],
                     device="cpu", name="opt")
        with actdb.connect(store) as db:
            roles[before] = db.sql("SELECT module, role FROM sites WHERE layer = 0 "
                                   "ORDER BY site_id").fetchall()
            rows = db.sql("SELECT site, position, delta(vec), to_list(vec) FROM acts "
                          "WHERE layer = 0 ORDER BY site, position").fetchall()
            nxt = dict(((s, p), x) for s, p, _, x in db.sql(
                "SELECT site, position, NULL, to_list(vec) FROM acts WHERE layer IN (0, 1) "
                "ORDER BY site, position").fetchall())
        for site, position, dv, x in rows:
            if not before:
                assert dv is None, site
                continue
            after = {"blocks.0.ln1": "blocks.0.ln2", "blocks.0.ln2": "blocks.1.ln1"}[site]
            want = np.asarray(nxt[(after, position)]) - np.asarray(x)
            assert np.allclose(dv, want, atol=1e-5), site
    layer0 = "model.decoder.layers.0."
    assert roles[False] == [(layer0 + "self_attn_layer_norm", "post_attn"),
                            (layer0 + "final_layer_norm", "post_mlp")]
    assert roles[True] == [(layer0 + "self_attn_layer_norm", "pre_attn"),
                           (layer0 + "final_layer_norm", "pre_mlp")]
