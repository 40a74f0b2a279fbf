"""Encoder-decoders (T5, BART): both stacks stored, each row in its own tower. The encoder's
rows are the input's tokens; the decoder's are the tokens it read, the target shifted right
by the model's own function. References are the models' own: their forward with `labels=`
(which shifts the labels itself), hooks on every norm module, and their logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as T
from click.testing import CliRunner
from support.tiny_models import build_family_tokenizer, randomize_norms

import actdb
from actdb.cli import cli
from actdb.errors import IngestError

INPUTS = [{"text": "the cat sat on the mat", "target": "a dog ran far away"},
          {"text": "hello world", "target": "there"},
          {"text": "one more input without a target"}]


def _build(kind: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "t5":  # tied: its logits are lm_head(h * d_model ** -0.5)
        model = T.T5ForConditionalGeneration(T.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            vocab_size=vocab, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0))
    else:  # post-norm: the LM head reads the last block's last norm
        model = T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=2))
    randomize_norms(model, seed=1)
    return model.eval()


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_family_tokenizer("llama")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tok: Any
          ) -> tuple[Path, dict[str, torch.nn.Module]]:
    store = tmp_path_factory.mktemp("encdec") / "s.actdb"
    models = {k: _build(k, len(tok)) for k in ("t5", "bart")}
    for name, model in models.items():
        actdb.ingest(store, model=model, tokenizer=tok, inputs=INPUTS, device="cpu",
                     name=name, weights="none")
    return store, models


def _own_pass(model: torch.nn.Module, tok: Any, item: dict[str, str]
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The model's own forward on one input: every norm module's input (by module path), the
    ids its decoder read, and its logits. With a target it is given as `labels=`, and the model
    shifts it itself; without, the decoder reads its start token."""
    enc = tok(item["text"], return_tensors="pt")
    norms = {p: m for p, m in model.named_modules()
             if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith("LayerNorm")}
    seen: dict[str, torch.Tensor] = {}
    decoder_ids: list[torch.Tensor] = []

    def keep(path: str) -> Any:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            seen.setdefault(path, args[0][0].detach().double())
        return hook

    handles = [m.register_forward_hook(keep(p)) for p, m in norms.items()]
    decoder = model.get_decoder()
    handles.append(decoder.register_forward_pre_hook(
        lambda mod, args, kw: decoder_ids.append(kw["input_ids"][0].clone()), with_kwargs=True))
    try:
        with torch.no_grad():
            if "target" in item:
                labels = tok(text_target=item["target"], return_tensors="pt")["input_ids"]
                out = model(**enc, labels=labels)
            else:
                start = torch.tensor([[model.config.decoder_start_token_id]])
                out = model(**enc, decoder_input_ids=start)
    finally:
        for h in handles:
            h.remove()
    return seen, decoder_ids[0], out.logits[0].double()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_both_stacks_are_the_models_own(built: tuple[Path, dict[str, torch.nn.Module]],
                                        tok: Any, name: str) -> None:
    """Every site's stored vector is its norm module's input in the model's own pass; encoder
    rows carry the input's tokens, decoder rows the ids the decoder read (the model's own shift
    of its labels); `logit()` at the final site is the model's own logit."""
    store, models = built
    model = models[name]
    db = actdb.connect(store)
    sites = db.sql("SELECT site, module, tower, role FROM sites WHERE model = $m",
                   params={"m": name}).fetchall()
    assert {s[2] for s in sites} == {"encoder", "decoder"}
    roles = {(s[2], s[3]) for s in sites}
    pre = name == "t5"
    assert (("decoder", "pre_cross") if pre else ("decoder", "post_cross")) in roles
    assert ("decoder", "final") in roles
    for pid, item in enumerate(INPUTS):
        seen, dec_ids, logits = _own_pass(model, tok, item)
        enc_ids = tok(item["text"])["input_ids"]
        for tower, want in (("encoder", enc_ids), ("decoder", dec_ids.tolist())):
            got = db.sql("SELECT token_id FROM tokens WHERE model = $m AND prompt_id = $p "
                         "AND tower = $t ORDER BY position",
                         params={"m": name, "p": pid, "t": tower}).fetchall()
            assert [g[0] for g in got] == want, (tower, item)
        for site, module, _, _ in sites:
            vec = db.vectors("SELECT vec FROM acts WHERE model = $m AND prompt_id = $p AND "
                             "site = $s ORDER BY position",
                             params={"m": name, "p": pid, "s": site}).double()
            ref = seen[module]
            assert vec.shape == ref.shape, (site, vec.shape, ref.shape)
            err = (vec - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(err.max()) < 2e-3, (site, float(err.max()))
        # the logit lens at the final site reads the model's own logits (T5's scale included)
        top = int(logits[-1].argmax())
        got = db.sql("SELECT position, logit(vec, $t) FROM acts WHERE model = $m AND "
                     "prompt_id = $p AND site = 'final' ORDER BY position",
                     params={"m": name, "p": pid, "t": top}).fetchall()
        assert len(got) == logits.shape[0]
        np.testing.assert_allclose([g[1] for g in got], logits[:, top].numpy(), rtol=2e-3,
                                   atol=2e-3 * float(logits.abs().max()))
    record = db.sql("SELECT logit_scale, logit_max_rel_error FROM models WHERE model = $m",
                    params={"m": name}).fetchall()[0]
    if name == "t5":
        assert record[0] == pytest.approx(32 ** -0.5)
    assert record[1] is not None and record[1] < 1e-3


def test_rows_meet_their_own_tower(built: tuple[Path, dict[str, torch.nn.Module]]) -> None:
    """A row is seen by its tower's sites only: acts has (encoder tokens x encoder sites) +
    (decoder tokens x decoder sites) rows; n_tokens is the row's tower's count; delta stays in
    its tower (the decoder's pre_attn reaches pre_cross, not an encoder site)."""
    store, _ = built
    db = actdb.connect(store)
    for name in ("t5", "bart"):
        want = db.sql(
            "SELECT sum(n) FROM (SELECT count(*) * (SELECT count(*) FROM sites s WHERE "
            "s.model = t.model AND s.tower = t.tower) AS n FROM tokens t WHERE t.model = $m "
            "GROUP BY t.model, t.tower)", params={"m": name}).fetchall()[0][0]
        assert db.sql("SELECT count(*) FROM acts WHERE model = $m",
                      params={"m": name}).fetchall()[0][0] == want
    bad = db.sql("SELECT count(*) FROM acts a JOIN tokens t USING (model, prompt_id, position) "
                 "JOIN sites s USING (model, site) WHERE t.tower = s.tower AND "
                 "a.n_tokens <> (SELECT n_tokens FROM prompt_runs r WHERE r.model = a.model "
                 "AND r.prompt_id = a.prompt_id AND r.tower = t.tower)").fetchall()[0][0]
    assert bad == 0
    got = db.sql("SELECT delta(a.vec) FROM acts a WHERE model = 't5' AND "
                 "site = 'blocks.0.ln1' AND prompt_id = 0 ORDER BY position").fetchall()
    ref = db.vectors("SELECT vec FROM acts WHERE model = 't5' AND prompt_id = 0 AND "
                     "site = 'blocks.0.ln_cross' ORDER BY position").double() - db.vectors(
        "SELECT vec FROM acts WHERE model = 't5' AND prompt_id = 0 AND site = 'blocks.0.ln1' "
        "ORDER BY position").double()
    np.testing.assert_allclose(np.array([g[0] for g in got]), ref.numpy(), rtol=1e-2,
                               atol=1e-2 * float(ref.abs().max()))
    info = db.sql("SELECT value FROM meta WHERE key = 'format_version'").fetchall()
    assert info == [("6",)]
    assert CliRunner().invoke(cli, ["verify", str(store), "--full"]).exit_code == 0


def test_a_rerun_resumes_and_another_target_is_another_prompt(
        built: tuple[Path, dict[str, torch.nn.Module]], tok: Any) -> None:
    """Inputs are keyed by text and target: the same inputs again are all done; the same text
    with another target is a new prompt, whose decoder reads that target."""
    store, models = built
    again = actdb.ingest(store, model=models["t5"], tokenizer=tok, inputs=INPUTS,
                         device="cpu", name="t5", weights="none")
    assert again.prompts_new == 0 and again.prompts_skipped == len(INPUTS)
    other = {"text": INPUTS[0]["text"], "target": "a bird"}
    more = actdb.ingest(store, model=models["t5"], tokenizer=tok, inputs=[other],
                        device="cpu", name="t5", weights="none")
    assert more.prompts_new == 1
    db = actdb.connect(store)
    pid = db.sql("SELECT prompt_id FROM prompts WHERE target = 'a bird'").fetchall()[0][0]
    assert pid == len(INPUTS)
    _, read, _ = _own_pass(models["t5"], tok, other)
    assert [r[0] for r in db.sql("SELECT token_id FROM tokens WHERE model = 't5' AND "
                                  "prompt_id = $p AND tower = 'decoder' ORDER BY position",
                                  params={"p": pid}).fetchall()] == read.tolist()


def test_a_missing_logit_scale_fails_the_proof(tok: Any, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The logit proof compares logits recomputed from the stored decoder's final site with
    T5's own: a transform without T5's d_model ** -0.5 (tied embeddings) is refused before
    anything is stored."""
    from actdb.ingestion import logits as logits_module

    fit = logits_module.LogitFit.transform

    def unscaled(self: Any, final: Any, name: str) -> Any:
        got = fit(self, final, name)
        assert got.scale is not None  # T5's own scale, measured
        return logits_module.LogitTransform(scale=None, softcap=got.softcap, error=0.0)

    monkeypatch.setattr(logits_module.LogitFit, "transform", unscaled)
    with pytest.raises(IngestError, match="logits recomputed from the stored final-site"):
        actdb.ingest(tmp_path / "s.actdb", model=_build("t5", len(tok)), tokenizer=tok,
                     inputs=INPUTS[:1], device="cpu", name="t5", weights="none")
    assert not actdb.connect(tmp_path / "s.actdb").sql(
        "SELECT * FROM tokens").fetchall()


def test_unshifted_decoder_tokens_are_not_the_models_own(
        tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoder rows labelled with the target as given (not shifted, as the model's forward
    shifts its labels) differ from the ids the model's decoder reads: the reference above
    tells them apart."""
    from actdb.ingestion import seq2seq

    monkeypatch.setattr(seq2seq, "shift_labels", lambda model, labels, name: labels)
    model = _build("t5", len(tok))
    actdb.ingest(tmp_path / "s.actdb", model=model, tokenizer=tok, inputs=INPUTS[:1],
                 device="cpu", name="t5", weights="none")
    got = actdb.connect(tmp_path / "s.actdb").sql(
        "SELECT token_id FROM tokens WHERE tower = 'decoder' ORDER BY position").fetchall()
    _, own, _ = _own_pass(model, tok, INPUTS[0])
    assert [g[0] for g in got] != own.tolist()


def test_cli_reads_targets_and_says_bad_input_in_one_sentence(
        built: tuple[Path, dict[str, torch.nn.Module]], tok: Any, tmp_path: Path) -> None:
    """`--inputs FILE.jsonl` with `target` per line from a saved folder; a sound file for T5 is
    one sentence, exit 1, nothing stored."""
    _, models = built
    folder = tmp_path / "t5"
    models["t5"].save_pretrained(folder)
    tok.save_pretrained(folder)
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps(i) + "\n" for i in INPUTS[:2]))
    store = tmp_path / "c.actdb"
    res = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(folder), "--inputs",
                                   str(lines), "--device", "cpu", "--weights", "none"])
    assert res.exit_code == 0, res.output
    db = actdb.connect(store)
    assert db.sql("SELECT count(DISTINCT prompt_id), count(*) FILTER (tower = 'decoder') "
                  "FROM tokens").fetchall()[0][0] == 2
    assert db.sql("SELECT target FROM prompts ORDER BY prompt_id").fetchall() == [
        (INPUTS[0]["target"],), (INPUTS[1]["target"],)]
    before = db.sql("SELECT count(*) FROM tokens").fetchall()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x", "audio": "sound.wav"}) + "\n")
    (tmp_path / "sound.wav").write_bytes(b"RIFF")
    res = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(folder), "--inputs",
                                   str(bad), "--device", "cpu", "--weights", "none"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "gives an audio" in res.output and len(res.output.strip().splitlines()) == 1
    assert actdb.connect(store).sql("SELECT count(*) FROM tokens").fetchall() == before


def test_a_cluster_partition_holds_each_row_once(
        built: tuple[Path, dict[str, torch.nn.Module]]) -> None:
    """A distributed query's partitions (row ranges) of an encoder-decoder give each acts row
    once: a prompt's position is in both towers, its two rows in different ranges."""
    from actdb.query.distributed import partitions

    store, _ = built
    db = actdb.connect(store)
    models = [(m, n, 4) for m, n in db.sql("SELECT model, n_rows FROM models").fetchall()]
    parts = partitions(models, 8, towers=frozenset({"t5", "bart"}))
    assert len({p.model for p in parts}) == 2 and len(parts) > 4
    seen: list[tuple[Any, ...]] = []
    for p in parts:
        seen += db.sql(p.table().select("site", "prompt_id", "position", "model", append=False)
                       .sql(dialect="duckdb")).fetchall()
    every = db.sql("SELECT site, prompt_id, position, model FROM acts").fetchall()
    assert sorted(seen) == sorted(every)


def test_the_lens_picture_reads_the_decoders_rows(
        built: tuple[Path, dict[str, torch.nn.Module]]) -> None:
    """The lens of an encoder-decoder's input: its decoder's sites, over the tokens its decoder
    read (the encoder's rows never meet the LM head)."""
    from actdb.plot.lensmap import lens_data

    store, _ = built
    data = lens_data(store, 0, model="t5")
    db = actdb.connect(store)
    decoder = {r[0] for r in db.sql("SELECT site FROM sites WHERE model = 't5' AND "
                                    "tower = 'decoder'").fetchall()}
    read = db.sql("SELECT position, token FROM tokens WHERE model = 't5' AND prompt_id = 0 AND "
                  "tower = 'decoder' ORDER BY position").fetchall()
    assert set(data.df["site"]) <= decoder and "final" in set(data.df["site"])
    for _, rows in data.df.groupby("site"):
        assert list(zip(rows["position"], rows["token"], strict=True)) == read


@pytest.mark.parametrize("target", [5, ["a", "dog"]])
def test_a_target_that_is_no_text_is_one_sentence(
        built: tuple[Path, dict[str, torch.nn.Module]], tok: Any, target: Any,
        tmp_path: Path) -> None:
    """An encoder-decoder's `target` that is no string is refused in one sentence, nothing
    stored: read as no target, its decoder would silently read the start token alone."""
    _, models = built
    store = tmp_path / "s.actdb"
    with pytest.raises(IngestError, match=r"input 0's 'target' is a \w+, not text") as e:
        actdb.ingest(store, model=models["t5"], tokenizer=tok, device="cpu", name="t5",
                     inputs=[{"text": "a new text", "target": target}],
                     weights="none")
    assert "\n" not in str(e.value)
    assert not store.exists() or actdb.connect(store).sql(
        "SELECT count(*) FROM tokens").fetchall() == [(0,)]


def test_a_target_field_keys_prompts_of_any_model(tmp_path: Path, model_dir: Any) -> None:
    """For a decoder-only model `target` is a plain field, but a text one still keys the prompt
    (the same text with two targets is two prompts); a numeric one does not (a label a user
    named so). Either way the same input again is all done."""
    gpt2 = str(model_dir("gpt2"))
    texts = [{"text": "a b c", "target": "x"}, {"text": "a b c", "target": "y"}]
    numbers = [{"text": "d e f", "target": 1}, {"text": "d e f", "target": 2}]
    for k, (inputs, new) in enumerate(((texts, 2), (numbers, 1))):
        store = tmp_path / f"{k}.actdb"
        first = actdb.ingest(store, model=gpt2, prompts=inputs, device="cpu", weights="none")
        again = actdb.ingest(store, model=gpt2, prompts=inputs, device="cpu", weights="none")
        assert (first.prompts_new, again.prompts_new) == (new, 0), inputs
        assert actdb.connect(store).sql("SELECT count(*) FROM prompts").fetchall() == [(new,)]


LENS_CALLS = ["top_logits(vec, 1)", "logit(vec, 5)", "logit_contribution(vec, 0, 5)",
              "logprob(vec, 5)", "prob(vec, 5)", "token_rank(vec, 5)", "entropy(vec)",
              "logit_diff(vec, 5, 6)", "kl_to(vec, vec)"]


@pytest.mark.parametrize("call", LENS_CALLS, ids=[c.split("(")[0] for c in LENS_CALLS])
def test_the_lens_refuses_encoder_rows(built: tuple[Path, dict[str, torch.nn.Module]],
                                       call: str) -> None:
    """The LM head reads the decoder's final norm; no logits are proven for an encoder row
    (its stack's output meets the decoder only through cross-attention), so each function
    that reads a row through the head refuses encoder rows in one sentence and reads decoder
    rows (the lens of the decoder's final site is the model's own logits, checked above)."""
    from actdb.errors import QueryError

    store, _ = built
    db = actdb.connect(store)
    with pytest.raises(QueryError, match=r"^[^\n]*site 'encoder\.blocks\.1\.ln1' is its "
                       r"encoder's[^\n]*WHERE site NOT LIKE 'encoder\.%'\)$"):
        db.sql(f"SELECT {call} FROM acts WHERE model = 't5' AND prompt_id = 0 "
               "AND site = 'encoder.blocks.1.ln1'").fetchall()
    got = db.sql(f"SELECT {call} FROM acts WHERE model = 't5' AND prompt_id = 0 AND "
                 "site NOT LIKE 'encoder.%'").fetchall()
    assert got and all(g[0] is not None for g in got)
    # a geometric comparison with the unembedding's rows is no lens: encoder rows keep it
    cos = db.sql("SELECT cosine_to_anchor(vec, 5) FROM acts WHERE model = 't5' AND "
                 "prompt_id = 0 AND site = 'encoder.blocks.1.ln1'").fetchall()
    assert cos and all(c[0] is not None for c in cos)


def test_the_report_reads_the_lens_on_decoder_rows_only(
        built: tuple[Path, dict[str, torch.nn.Module]]) -> None:
    """The report's lens section (the answer's rank, site by site) joins rows on (prompt,
    position): an encoder row at the answer's position is no row the lens reads (refused
    above), so the section keeps to the decoder's sites, where the final site's answer is
    its own top token."""
    from actdb.plot.report import _emergence

    store, _ = built
    with actdb.connect(store, device="cpu") as db:
        df = _emergence(db, "t5").df
        # every prompt of t5 (other tests may add some to this module's store)
        n = db.sql("SELECT count(*) FROM prompt_runs WHERE model = 't5' AND tower = 'decoder'"
                   ).fetchall()[0][0]
    assert list(df["site"]) == ["blocks.0.ln1", "blocks.1.ln1", "final"]
    assert df.loc[df["site"] == "final", "top1_share"].tolist() == [1.0]
    assert n >= len(INPUTS) and (df["prompts"] == n).all()
