"""The `actdb` command line: errors (exit 1, one sentence, no traceback), and the success paths.

Every error test runs the real click command through `CliRunner` and checks three things: exit
code 1 (2 for usage errors), exactly one line on stderr that names the offending value, and no
traceback. Ingest errors also check that nothing already stored was lost. One test runs the
installed `actdb` program in a real subprocess.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

import actdb
from actdb.cli import cli
from actdb.query.functions import REGISTRY

REPO = Path(__file__).resolve().parents[2]
D_MODEL = 64  # tiny_models.HIDDEN_SIZE

# A few short prompts for the stores these tests write themselves (kept tiny for speed).
SMALL_PROMPTS = ["The capital of France is Paris.", "the the the the"]


# -- helpers -----------------------------------------------------------------------------------


def run(*args: object, input: str | None = None) -> Result:
    """Invoke `actdb ARGS` in-process; stderr is kept apart from stdout (click >= 8.2)."""
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def error_line(result: Result, *needles: str) -> str:
    """Assert exit 1 with one line on stderr, no traceback, holding every needle; return it."""
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr,
                                   result.exception)
    # A handled error ends in SystemExit; anything else escaped the CLI's error handling.
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    line = lines[0]
    assert line.startswith("Error:"), line
    for needle in needles:
        assert needle.lower() in line.lower(), f"{needle!r} not in {line!r}"
    return line


def ingest_cli(store: Path, model: Path, prompts: object, *extra: object,
               input: str | None = None) -> Result:
    return run("ingest", store, "--model", model, "--prompts", prompts, "--device", "cpu",
               "--batch-size", 4, *extra, input=input)


def counts(store: Path) -> dict[str, int]:
    """Row counts of the catalog tables (opening the store proves it still opens)."""
    with actdb.connect(store, device="cpu") as db:
        return {t: db.sql(f"SELECT count(*) FROM {t}").fetchall()[0][0]
                for t in ("models", "prompts", "tokens", "sites", "vocab")}


def assert_intact(store: Path, before: dict[str, int]) -> None:
    """The store still opens, verifies clean and holds exactly what it held before."""
    assert counts(store) == before
    result = run("verify", store)
    assert result.exit_code == 0, result.stderr
    assert "ok" in result.stdout.lower()


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def gpt2_store(family_store: Callable[[str], Path]) -> Path:
    return family_store("gpt2")


@pytest.fixture(scope="module")
def bert_store(family_store: Callable[[str], Path]) -> Path:
    return family_store("bert")


@pytest.fixture(scope="module")
def gpt2_dir(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("gpt2")


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    """A store that failing ingests aim at; each test checks it is intact afterwards."""
    path = tmp_path_factory.mktemp("victim") / "s.actdb"
    actdb.ingest(path, model=str(gpt2_dir), prompts=SMALL_PROMPTS, device="cpu",
                 name="gpt2", chunk_tokens=8)
    return path


@pytest.fixture
def fresh_store(tmp_path: Path, gpt2_dir: Path) -> Path:
    """A store of this test's own (it may be changed or broken)."""
    path = tmp_path / "own.actdb"
    actdb.ingest(path, model=str(gpt2_dir), prompts=SMALL_PROMPTS, device="cpu",
                 name="gpt2", chunk_tokens=8)
    return path


@pytest.fixture(scope="module")
def no_norm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved Hugging Face model with no LayerNorm/RMSNorm at all (a tiny ResNet: BatchNorm
    only), with a tokenizer next to it so that only the missing norm sites can fail."""
    import transformers
    from support.tiny_models import build_tokenizer

    path = tmp_path_factory.mktemp("no-norm-model")
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1])
    transformers.ResNetModel(config).save_pretrained(path)
    build_tokenizer(path)
    return path


# -- query errors ------------------------------------------------------------------------------


def _caret_column(stderr: str, query_line: str) -> int:
    """1-based column of the `^` under `query_line` as printed on stderr."""
    lines = stderr.splitlines()
    for i, ln in enumerate(lines[:-1]):
        if ln.endswith(query_line) and lines[i + 1].strip().startswith("^"):
            indent = len(ln) - len(query_line)
            return lines[i + 1].index("^") - indent + 1
    raise AssertionError(f"no line {query_line!r} with a caret under it in:\n{stderr}")


@pytest.mark.parametrize(
    ("query", "line_no", "token"),
    [
        pytest.param("SELECT layer FROM acts WHER prompt_id = 0", 1, "prompt_id", id="one-line"),
        pytest.param("SELECT layer,\n       token\nFROM acts\nWHER prompt_id = 0", 4, "prompt_id",
                     id="multi-line"),
        pytest.param("SELECT layer,\n  token site x\nFROM acts", 2, "x", id="multi-line-1-char"),
        pytest.param("SELEC layer FROM acts", 1, "SELEC", id="first-word"),
    ],
)
def test_syntax_error_shows_line_and_caret(
    gpt2_store: Path, query: str, line_no: int, token: str
) -> None:
    result = run("query", gpt2_store, query)
    assert result.exit_code == 1, result.stderr
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("Error:") and "syntax error" in first.lower()
    assert token in first  # DuckDB's words: at or near "<token>"
    assert f"line {line_no}" in first
    # The offending line is printed, with the caret under the token DuckDB names (its first
    # character, as DuckDB's and PostgreSQL's own carets do).
    offending = query.splitlines()[line_no - 1]
    want = re.search(rf"\b{re.escape(token)}\b", offending)
    assert want is not None
    assert _caret_column(result.stderr, offending) == want.start() + 1, result.stderr


def test_unknown_function_suggests_close_names(gpt2_store: Path) -> None:
    line = error_line(run("query", gpt2_store, "SELECT cosin(vec) FROM acts"),
                      "unknown function", "cosin")
    assert re.search(r"\bcosine\b", line)


def test_explain_prints_its_plan_as_drawn(gpt2_store: Path) -> None:
    """EXPLAIN's plan is text drawn over many lines: printed as it is, not as one table cell
    with its spaces and newlines shown as marks."""
    result = run("query", gpt2_store, "EXPLAIN SELECT count(*) FROM acts WHERE layer = 1")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "physical_plan:" and len(lines) > 5
    assert any("Aggregate" in ln for ln in lines) and "␣" not in result.stdout


@pytest.mark.parametrize(("query", "name", "hint"), [
    ("SELECT layr FROM acts", "layr", 'candidate bindings: "layer"'),
    ("SELECT * FROM act", "act", 'did you mean "acts"?'),
])
def test_a_misspelt_column_or_table_keeps_duckdbs_suggestion(gpt2_store: Path, query: str,
                                                             name: str, hint: str) -> None:
    """DuckDB says what it would have taken on a second line; that line was dropped."""
    error_line(run("query", gpt2_store, query), name, hint)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        ("dim_contribution(vec)", "dim_contribution"),
        ("cosine_to_anchor(vec, ' the', 'embed', 4)", "cosine_to_anchor"),
        ("uniform_angle(vec, vec)", "uniform_angle"),
    ],
)
def test_wrong_number_of_arguments_names_signature(gpt2_store: Path, call: str,
                                                   name: str) -> None:
    error_line(run("query", gpt2_store, f"SELECT {call} FROM acts"),
               name, REGISTRY[name].signature)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        pytest.param("dim_contribution(vec, 'x')", "dim_contribution", id="string-literal-dim"),
        pytest.param("top_dims(vec, 'x')", "top_dims", id="string-literal-k"),
        pytest.param("dim_contribution(vec, token)", "dim_contribution", id="varchar-column-dim"),
        pytest.param("cosine(vec, 'x')", "cosine", id="string-literal-vec"),
    ],
)
def test_wrong_argument_type_names_signature(gpt2_store: Path, call: str, name: str) -> None:
    line = error_line(run("query", gpt2_store, f"SELECT {call} FROM acts"),
                      name, REGISTRY[name].signature)
    assert "_actdb_" not in line  # internal UDF names are not the user's business


def test_token_that_is_not_one_token_says_how_it_tokenizes(gpt2_store: Path,
                                                           gpt2_dir: Path) -> None:
    from transformers import AutoTokenizer

    text = "Parisxyzzy"
    tok = AutoTokenizer.from_pretrained(str(gpt2_dir))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert len(pieces) > 1
    line = error_line(
        run("query", gpt2_store, f"SELECT cosine_to_anchor(vec, '{text}') FROM acts"),
        repr(text), "token",
    )
    # Every piece is listed, in order.
    at = 0
    for piece in pieces:
        found = line.find(repr(piece), at)
        assert found >= 0, f"piece {piece!r} missing (in order) from {line!r}"
        at = found + len(repr(piece))
    assert str(len(pieces)) in line


def test_unknown_anchor_set(gpt2_store: Path) -> None:
    line = error_line(
        run("query", gpt2_store, "SELECT cosine_to_anchor(vec, ' the', 'bogus') FROM acts"),
        "anchor", "'bogus'",
    )
    for name in ("unembed", "embed", "unembed_folded"):
        assert name in line  # the valid choices


def test_logit_without_lm_head(bert_store: Path) -> None:
    error_line(run("query", bert_store, "SELECT logit(vec, 'the') FROM acts"),
               "bert", "LM head")


@pytest.mark.parametrize("dim", [D_MODEL, 1000, -1])
def test_dim_out_of_range_says_valid_range(gpt2_store: Path, dim: int) -> None:
    line = error_line(
        run("query", gpt2_store, f"SELECT dim_contribution(vec, {dim}) FROM acts"), str(dim)
    )
    if dim >= 0:
        assert "range" in line.lower()
        assert re.search(rf"\b0\s*(\.\.|to|-|and)\s*{D_MODEL - 1}\b", line), line


@pytest.mark.parametrize(
    ("sql", "kind"),
    [
        ("INSERT INTO meta VALUES ('k', 'v')", "INSERT"),
        ("UPDATE meta SET value = '99' WHERE key = 'format_version'", "UPDATE"),
        ("DELETE FROM tokens", "DELETE"),
        ("CREATE TABLE cli_test_new (x INTEGER)", "CREATE"),
        ("DROP TABLE tokens", "DROP"),
        ("ATTACH '{tmp}/other.duckdb' AS other", "ATTACH"),
        ("COPY tokens TO '{tmp}/out.csv'", "COPY"),
    ],
)
def test_statements_that_change_the_store_are_refused(
    gpt2_store: Path, tmp_path: Path, sql: str, kind: str
) -> None:
    before = counts(gpt2_store)
    error_line(run("query", gpt2_store, sql.format(tmp=tmp_path)), kind, "read-only")
    assert counts(gpt2_store) == before
    assert not list(tmp_path.iterdir())  # neither the ATTACH file nor the COPY output appeared
    with actdb.connect(gpt2_store, device="cpu") as db:
        assert db.sql("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'cli_test_new'"
                      ).fetchall() == [(0,)]
        assert db.sql("SELECT value FROM meta WHERE key = 'format_version'"
                      ).fetchall()[0][0] != "99"


@pytest.mark.parametrize("sql", ["SELECT 1; SELECT 2", "SELECT 1; DROP TABLE tokens"])
def test_two_statements_are_refused(gpt2_store: Path, sql: str) -> None:
    before = counts(gpt2_store)
    error_line(run("query", gpt2_store, sql), "one statement", "2")
    assert counts(gpt2_store) == before


def test_debug_shows_the_traceback(gpt2_store: Path) -> None:
    result = run("--debug", "query", gpt2_store, "SELECT cosin(vec) FROM acts")
    assert result.exit_code == 1
    # The error escapes the one-sentence handler (so Python prints its traceback).
    assert isinstance(result.exception, actdb.QueryError), repr(result.exception)
    assert result.exc_info is not None and result.exc_info[2] is not None
    assert "Error: unknown function" not in result.stderr


def test_real_process_exit_code_and_one_line(gpt2_store: Path) -> None:
    exe = Path(sys.executable).with_name("actdb")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "actdb.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([*cmd, "query", str(gpt2_store), "SELECT cosin(vec) FROM acts"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "cosin" in lines[0] and "cosine" in lines[0]


# -- ingest errors -----------------------------------------------------------------------------


def test_ingest_model_path_that_does_not_exist(victim: Path, tmp_path: Path) -> None:
    before = counts(victim)
    missing = tmp_path / "no-such-model"
    prompts = write(tmp_path / "p.txt", "A brand new prompt.\n")
    error_line(ingest_cli(victim, missing, prompts), str(missing), "not exist")
    assert_intact(victim, before)


def test_ingest_model_with_no_norm_sites(victim: Path, tmp_path: Path,
                                         no_norm_model: Path) -> None:
    before = counts(victim)
    prompts = write(tmp_path / "p.txt", "A brand new prompt.\n")
    line = error_line(ingest_cli(victim, no_norm_model, prompts), "norm")
    assert "ResNet" in line or str(no_norm_model) in line, line
    assert_intact(victim, before)


@pytest.mark.parametrize(
    ("name", "text", "needles"),
    [
        pytest.param("empty.txt", "", ["no prompts"], id="empty-txt"),
        pytest.param("blank.jsonl", "\n\n", ["no prompts"], id="blank-jsonl"),
        pytest.param("bad.jsonl", '{"text": "fine"}\n{"text": oops}\n', ["line 2", "JSON"],
                     id="invalid-json"),
        pytest.param("notext.jsonl", '{"text": "fine"}\n{"text": "ok"}\n{"label": 1}\n',
                     ["line 3", "text"], id="no-text"),
    ],
)
def test_ingest_bad_prompts_file(victim: Path, gpt2_dir: Path, tmp_path: Path, name: str,
                                 text: str, needles: list[str]) -> None:
    before = counts(victim)
    prompts = write(tmp_path / name, text)
    error_line(ingest_cli(victim, gpt2_dir, prompts), str(prompts), *needles)
    assert_intact(victim, before)


def test_ingest_prompts_file_that_does_not_exist(victim: Path, gpt2_dir: Path,
                                                 tmp_path: Path) -> None:
    before = counts(victim)
    missing = tmp_path / "nope.txt"
    error_line(ingest_cli(victim, gpt2_dir, missing), str(missing), "not exist")
    assert_intact(victim, before)


def test_ingest_store_path_is_a_regular_file(gpt2_dir: Path, tmp_path: Path) -> None:
    target = write(tmp_path / "s.actdb", "not a store")
    prompts = write(tmp_path / "p.txt", "A prompt.\n")
    error_line(ingest_cli(target, gpt2_dir, prompts), str(target), "file")
    assert target.read_text() == "not a store"  # untouched


def _set_version(store: Path, value: str) -> None:
    con = duckdb.connect(str(store / "catalog.duckdb"))
    try:
        con.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", [value])
    finally:
        con.close()


def test_ingest_into_newer_format_version(fresh_store: Path, gpt2_dir: Path,
                                          tmp_path: Path) -> None:
    before = counts(fresh_store)
    con = duckdb.connect(str(fresh_store / "catalog.duckdb"), read_only=True)
    version = con.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchall()[0][0]
    con.close()
    _set_version(fresh_store, "99")
    prompts = write(tmp_path / "p.txt", "A brand new prompt.\n")
    error_line(ingest_cli(fresh_store, gpt2_dir, prompts), "version", "99")
    # Nothing was rewritten: the version is still 99, and once it is set back the store is
    # exactly what it was.
    con = duckdb.connect(str(fresh_store / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT value FROM meta WHERE key = 'format_version'"
                       ).fetchall() == [("99",)]
    con.close()
    _set_version(fresh_store, version)
    assert_intact(fresh_store, before)


def test_ingest_into_read_only_store_directory(fresh_store: Path, gpt2_dir: Path,
                                               tmp_path: Path) -> None:
    before = counts(fresh_store)
    prompts = write(tmp_path / "p.txt", "A brand new prompt.\n")
    mode = fresh_store.stat().st_mode
    os.chmod(fresh_store, 0o555)  # tests run as root: the mode bits are what must count
    try:
        error_line(ingest_cli(fresh_store, gpt2_dir, prompts), str(fresh_store), "writ")
        assert_intact(fresh_store, before)  # still opens and verifies while read-only
    finally:
        os.chmod(fresh_store, stat.S_IMODE(mode))
    assert_intact(fresh_store, before)


# -- query success paths -----------------------------------------------------------------------

QUERY = ("SELECT prompt_id, position, token, site, layer, vec_norm(vec) AS n, "
         "dim_contribution(vec, 3) AS d3 FROM acts WHERE prompt_id = $p AND site = $s "
         "ORDER BY position")


@pytest.fixture(scope="module")
def expected(gpt2_store: Path) -> pd.DataFrame:
    with actdb.connect(gpt2_store, device="cpu") as db:
        df = db.sql(QUERY, params={"p": 1, "s": "final"}).df()
    assert len(df) > 1 and (df["prompt_id"] == 1).all() and (df["site"] == "final").all()
    return df


def _same(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == list(want.columns)
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True),
                                  check_dtype=False, rtol=1e-6)


def test_query_csv_parses_back(gpt2_store: Path, expected: pd.DataFrame) -> None:
    result = run("query", gpt2_store, QUERY, "--format", "csv", "-p", "p=1", "-p", "s=final")
    assert result.exit_code == 0, result.stderr
    got = pd.read_csv(io.StringIO(result.stdout), keep_default_na=False,
                      dtype={"token": str, "site": str})
    _same(got, expected)


def test_query_json_lines_parse_back(gpt2_store: Path, expected: pd.DataFrame) -> None:
    result = run("query", gpt2_store, QUERY, "--format", "json", "-p", "p=1", "-p", "s=final")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(expected)
    _same(pd.DataFrame([json.loads(ln) for ln in lines]), expected)


def test_query_table(gpt2_store: Path, expected: pd.DataFrame) -> None:
    result = run("query", gpt2_store, QUERY, "-p", "p=1", "-p", "s=final")
    assert result.exit_code == 0, result.stderr
    lines = [ln for ln in result.stdout.splitlines() if ln.strip()]
    assert lines[0].split() == list(expected.columns)
    assert len(lines) == 1 + len(expected)


@pytest.mark.parametrize("given", [True, False], ids=["--format", "from-extension"])
@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
def test_query_to_file(gpt2_store: Path, expected: pd.DataFrame, tmp_path: Path,
                       fmt: str, given: bool) -> None:
    """-o FILE in the format --format names, or, without it, the one FILE's extension names
    (it wrote the table format into out.csv)."""
    out = tmp_path / f"out.{fmt}"
    result = run("query", gpt2_store, QUERY, *(("--format", fmt) if given else ()), "-o", out,
                 "-p", "p=1", "-p", "s=final")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    if fmt == "parquet":
        got = pq.read_table(out).to_pandas()
    elif fmt == "csv":
        got = pd.read_csv(out, keep_default_na=False, dtype={"token": str, "site": str})
    else:
        got = pd.DataFrame([json.loads(ln) for ln in out.read_text().splitlines()])
    _same(got, expected)


def test_query_refuses_a_vector_file_extension(gpt2_store: Path, tmp_path: Path) -> None:
    """-o x.npy without --format: query writes tables, and it wrote a text table into x.npy."""
    result = run("query", gpt2_store, "SELECT 1 AS x", "-o", tmp_path / "x.npy")
    assert result.exit_code == 2 and "actdb export" in result.stderr, result.stderr
    assert not (tmp_path / "x.npy").exists()


def test_query_parquet_needs_output_file(gpt2_store: Path) -> None:
    result = run("query", gpt2_store, "SELECT 1 AS x", "--format", "parquet")
    assert result.exit_code == 2
    assert "-o" in result.stderr and "Traceback" not in result.stderr


def test_query_param_binds_by_name(gpt2_store: Path) -> None:
    result = run("query", gpt2_store,
                 "SELECT count(*) AS n, min(prompt_id) AS lo, max(prompt_id) AS hi "
                 "FROM tokens WHERE prompt_id = $pid", "--format", "json", "-p", "pid=2")
    assert result.exit_code == 0, result.stderr
    row = json.loads(result.stdout.splitlines()[0])
    assert row["n"] > 0 and row["lo"] == row["hi"] == 2
    # a misspelt parameter: the one missing and the ones given, so the typo is plain to see
    error_line(run("query", gpt2_store, "SELECT count(*) FROM tokens WHERE prompt_id = $pid",
                   "-p", "pdi=2"), "pid", "the parameters given: pdi")


# -- functions, info, verify -------------------------------------------------------------------


def test_functions_lists_every_function_with_signature() -> None:
    result = run("functions")
    assert result.exit_code == 0, result.stderr
    for name, fn in REGISTRY.items():
        assert fn.signature in result.stdout, name
    as_json = run("functions", "--format", "json")
    assert as_json.exit_code == 0
    assert {r["name"] for r in json.loads(as_json.stdout)} == set(REGISTRY)


def test_info_names_model_sites_faithfulness_and_bytes(gpt2_store: Path) -> None:
    result = run("info", gpt2_store)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "gpt2" in out
    assert re.search(r"\d+(\.\d+)?\s*(B|KB|MB|GB|KiB|MiB|GiB)\b", out)
    assert "disk" in out
    with actdb.connect(gpt2_store, device="cpu") as db:
        sites = db.sql("SELECT site, role FROM sites WHERE model = 'gpt2'").fetchall()
    assert sites
    lines = out.splitlines()
    for site, role in sites:
        row = next((ln for ln in lines if re.search(rf"(^|\s){re.escape(site)}\s", ln)), None)
        assert row is not None, f"site {site} missing from:\n{out}"
        assert role in row
        assert re.search(r"\d(\.\d+)?e[-+]\d+", row), f"no faithfulness figure in {row!r}"
    # GPT-2 has no logit scale or cap: its logits are W_U . final_norm(x) + b_U, said so
    assert re.search(r"logits: W_U \. final_norm\(x\) \+ b_U; max rel err", out), out
    assert ", 1 model\n" in out, out


def test_verify_good_store(gpt2_store: Path) -> None:
    result = run("verify", gpt2_store)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "is consistent (1 model" in result.stdout, result.stdout


def test_verify_reports_missing_chunk(fresh_store: Path) -> None:
    acts = fresh_store / "tensors.zarr" / "models" / "0" / "acts"
    site = sorted(p.name for p in acts.iterdir() if p.is_dir())[0]
    chunks = sorted((acts / site / "direction").glob("c.*"))
    assert chunks
    chunks[0].unlink()
    result = run("verify", fresh_store)
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stderr
    assert site in result.stderr and "direction" in result.stderr
    assert "missing" in result.stderr.lower()


# -- ingest success paths ----------------------------------------------------------------------


def _tokens(store: Path) -> int:
    with actdb.connect(store, device="cpu") as db:
        return db.sql("SELECT count(*) FROM tokens").fetchall()[0][0]


def test_ingest_twice_adds_nothing(tmp_path: Path, gpt2_dir: Path) -> None:
    store = tmp_path / "s.actdb"
    prompts = write(tmp_path / "p.txt", "\n".join(SMALL_PROMPTS) + "\n")
    first = ingest_cli(store, gpt2_dir, prompts)
    assert first.exit_code == 0, first.stderr
    n = _tokens(store)
    assert n > 0
    second = ingest_cli(store, gpt2_dir, prompts)
    assert second.exit_code == 0, second.stderr
    assert _tokens(store) == n
    assert re.search(r"\b0 prompts ingested, all \d+ already stored; nothing to do",
                     second.stdout), second.stdout
    assert "relative error" not in second.stdout  # no figure for a check that did not run
    assert run("verify", store).exit_code == 0


def test_ingest_jsonl_extra_fields_become_columns(tmp_path: Path, gpt2_dir: Path) -> None:
    store = tmp_path / "s.actdb"
    prompts = write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in [
        {"text": "The sky is blue.", "label": "pos", "score": 3},
        {"text": "The cat sat down.", "label": "neg", "score": 5},
    ]) + "\n")
    result = ingest_cli(store, gpt2_dir, prompts)
    assert result.exit_code == 0, result.stderr
    with actdb.connect(store, device="cpu") as db:
        rows = db.sql("SELECT text, label, score FROM prompts ORDER BY text").fetchall()
    assert rows == [("The cat sat down.", "neg", 5), ("The sky is blue.", "pos", 3)]
    assert "note:" not in result.stderr
    again = ingest_cli(store, gpt2_dir, prompts)  # a resume: the same fields, nothing said
    assert again.exit_code == 0 and "note:" not in again.stderr, again.stderr
    # Fields the store will not hold are said (they were dropped in silence): a stored
    # prompt's other label and a new field of it, and a text repeated with other fields.
    changed = write(tmp_path / "p2.jsonl", "\n".join(json.dumps(r) for r in [
        {"text": "The sky is blue.", "label": "neg", "score": 3, "topic": "sky"},
        {"text": "A new one.", "label": "x"},
        {"text": "A new one.", "label": "y"},
    ]) + "\n")
    said = ingest_cli(store, gpt2_dir, changed)
    assert said.exit_code == 0, said.stderr
    assert "note: prompts already in the store keep the fields they were stored with; this " \
           "input gives other values for label (1 prompt), topic (1 prompt)" in said.stderr
    assert "note: 1 prompts repeat an earlier prompt's text with other fields (first: " \
           "'A new one.')" in said.stderr
    with actdb.connect(store, device="cpu") as db:
        rows = db.sql("SELECT text, label FROM prompts ORDER BY text").fetchall()
        assert "topic" not in db.sql("SELECT * FROM prompts").columns
    assert rows == [("A new one.", "x"), ("The cat sat down.", "neg"), ("The sky is blue.", "pos")]


def test_ingest_from_stdin(tmp_path: Path, gpt2_dir: Path) -> None:
    store = tmp_path / "s.actdb"
    result = ingest_cli(store, gpt2_dir, "-", input="Prompt from stdin.\nAnother one here.\n")
    assert result.exit_code == 0, result.stderr
    with actdb.connect(store, device="cpu") as db:
        texts = {r[0] for r in db.sql("SELECT text FROM prompts").fetchall()}
    assert texts == {"Prompt from stdin.", "Another one here."}
    # Text that starts with a brace is read as text when told so.
    told = ingest_cli(store, gpt2_dir, "-", "--prompts-format", "txt",
                      input="{x} is a set.\n")
    assert told.exit_code == 0, told.stderr
    with actdb.connect(store, device="cpu") as db:
        assert db.sql("SELECT count(*) FROM prompts WHERE text = '{x} is a set.'"
                      ).fetchall() == [(1,)]


def test_ingest_max_length_truncates_and_counts(tmp_path: Path, gpt2_dir: Path) -> None:
    store = tmp_path / "s.actdb"
    prompts = write(tmp_path / "p.txt",
                    "A rather long prompt that has many more than three tokens.\nHi\n")
    result = ingest_cli(store, gpt2_dir, prompts, "--max-length", 3)
    assert result.exit_code == 0, result.stderr
    assert re.search(r"\b1 truncated", result.stdout), result.stdout
    with actdb.connect(store, device="cpu") as db:
        per_prompt = dict(db.sql("SELECT p.text, count(*) FROM tokens t JOIN prompts p "
                                 "USING (prompt_id) GROUP BY p.text").fetchall())
    assert per_prompt["A rather long prompt that has many more than three tokens."] == 3
    assert per_prompt["Hi"] <= 3
    # A resume counts what it stores: the stored long prompt is not cut again.
    more = write(tmp_path / "q.txt", "A rather long prompt that has many more than three "
                 "tokens.\nHi\nAnother prompt of more than three tokens.\nOk\n")
    again = ingest_cli(store, gpt2_dir, more, "--max-length", 3)
    assert again.exit_code == 0, again.stderr
    assert re.search(r"2 prompts ingested, 2 already stored, 1 truncated", again.stdout), \
        again.stdout


# -- help and docs -----------------------------------------------------------------------------


def _commands() -> list[str]:
    return sorted(cli.commands)


def test_every_command_help_ends_with_an_example() -> None:
    top = run("--help")
    assert top.exit_code == 0 and "Example" in top.stdout
    assert set(_commands()) >= {"ingest", "query", "info", "verify", "functions"}
    for name in _commands():
        result = run(name, "--help")
        assert result.exit_code == 0, name
        text = result.stdout
        assert "Example" in text, f"`actdb {name} --help` has no example"
        assert f"actdb {name}" in text[text.index("Example"):], name


# README-CHECK: the README must mention every command (README.md may not exist yet).
def test_readme_mentions_every_command() -> None:
    readme = REPO / "README.md"
    assert readme.is_file(), f"{readme} is missing"
    text = readme.read_text(encoding="utf-8")
    missing = [name for name in _commands() if f"actdb {name}" not in text]
    assert not missing, f"README.md does not mention: {missing}"

