"""`actdb ingest --chat-template`: each prompt wrapped by the tokenizer's own chat template.

The stored prompt is the templated text and its tokens are exactly the tokenizer's tokens of
that text, with no second BOS (the template places special tokens itself); a tokenizer with
no template is one sentence and exit 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
from click.testing import CliRunner
from transformers import AutoTokenizer

from actdb.cli import cli

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPTS = ["The capital of France is", "Two plus two is"]


def test_chat_template_wraps_each_prompt(model_dir, tmp_path: Path) -> None:
    folder = tmp_path / "instruct"
    shutil.copytree(model_dir("llama"), folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.bos_token is not None
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    store = tmp_path / "s.actdb"
    result = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(folder),
                                      "--prompts", str(prompts), "--chat-template", "-q",
                                      "--device", "cpu", "--name", "chat"])
    assert result.exit_code == 0, (result.stdout, result.stderr)

    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    texts = dict(con.execute("SELECT prompt_id, text FROM prompts").fetchall())
    tokens = con.execute("SELECT prompt_id, list(token_id ORDER BY position) FROM tokens "
                         "GROUP BY prompt_id").fetchall()
    con.close()
    want = {f"{tok.bos_token}<|user|>\n{p}\n<|assistant|>\n" for p in PROMPTS}
    assert set(texts.values()) == want
    for pid, ids in tokens:
        assert ids == tok(texts[pid], add_special_tokens=False)["input_ids"]
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # one BOS

    # Without a template: one sentence, exit 1, and the store keeps what it had.
    plain = tmp_path / "plain"
    shutil.copytree(model_dir("llama"), plain)
    bad = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(plain), "--prompts",
                                   str(prompts), "--chat-template", "-q", "--device", "cpu",
                                   "--name", "plain"])
    assert bad.exit_code == 1 and "Traceback" not in bad.stderr
    assert "has no chat template" in bad.stderr and "plain" in bad.stderr
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM prompts").fetchall()[0][0] == 2
    con.close()
