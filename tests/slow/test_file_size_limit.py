"""A file-size limit (`ulimit -f`, RLIMIT_FSIZE) reached during an ingest: the write fails
with EFBIG (SIGXFSZ ignored, as a shell's `ulimit -f` with the signal trapped leaves it), and
whichever file it hit (the catalog's log or its checkpoint, a chunk file, a tokenizer file,
a shard catalog, a new store's catalog) the CLI says so in one sentence, exit 1, the store
verifies, and the same command without the limit completes it. Also: a store's locks are
released when closing it fails."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import actdb
from actdb.cli import cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
PROMPTS = [f"prompt {i} " + "word " * (i % 30) for i in range(60)]
# The CLI, folding the catalog's log into the file at every commit (a checkpoint each time).
_SCRIPT = ("import sys; from actdb.store import catalog_log as log; "
           "log.FOLD_MIN_BYTES, log.FOLD_FILE_SHARE = 1, 10**9; "
           "from actdb.cli import cli; cli(sys.argv[1:])")


def _cli(args: list[str], limit: int | None = None) -> subprocess.CompletedProcess[str]:
    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write returns EFBIG instead
        assert limit is not None
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ACTDB_FAULT", None)
    return subprocess.run([sys.executable, "-c", _SCRIPT, *args], env=env, text=True,
                          capture_output=True, timeout=240,
                          preexec_fn=limited if limit is not None else None)


# case -> (what the store holds first, extra ingest arguments, limit, what the sentence names)
CASES = {
    "catalog": ("m", [], 60_000, "the catalog"),
    "vectors": ("m-wide", ["--chunk-tokens", "4096"], 150_000, "vectors of model 'm'"),
    "tokenizer": ("other", [], 12_000, "a tokenizer"),
    "shard catalog": ("m", ["--shard", "0/2"], 3_000, "a shard catalog"),
    "new store": (None, [], 5_000, "the catalog"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_file_size_limit_is_one_sentence_and_the_store_stays_whole(
        case: str, tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    held, extra, limit, what = CASES[case]
    model = model_dir("gpt2")
    store = tmp_path / "s.actdb"
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    if held is not None:  # a model stored first, under this name, with these chunks
        chunks = 4096 if held == "m-wide" else 64
        actdb.ingest(store, model=str(model), prompts=PROMPTS[:1], device="cpu",
                     name="m0" if held == "other" else "m", chunk_tokens=chunks)
    args = ["ingest", str(store), "--model", str(model), "--prompts", str(prompts),
            "--device", "cpu", "--name", "m", "-q", "--batch-size", "4", *extra]
    res = _cli(args, limit)
    assert res.returncode == 1, res.stderr
    assert res.stderr == (
        f"Error: a file of store {str(store)!r} reached this process's file-size limit "
        f"(ulimit -f) while writing {what}; nothing committed is lost: raise the limit and "
        "run the same command again to resume\n")
    if store.exists():
        check = CliRunner().invoke(cli, ["verify", str(store), "--full"])
        assert check.exit_code == 0, check.output
    # The same ingest without the limit completes it (here in this process).
    kw = {"device": "cpu", "name": "m", "batch_size": 4}
    if "--shard" in extra:
        for i in (0, 1):
            actdb.ingest(store, model=str(model), prompts=PROMPTS, shard=(i, 2), **kw)
        actdb.merge(store)
    else:
        actdb.ingest(store, model=str(model), prompts=PROMPTS, **kw)
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompt_runs WHERE model = 'm'"
                      ).fetchall() == [(len(PROMPTS),)]
    check = CliRunner().invoke(cli, ["verify", str(store), "--full"])
    assert check.exit_code == 0, check.output


def test_a_failed_close_still_releases_the_store(tmp_path: Path,
                                                 model_dir: Callable[[str], Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's catalog that cannot be closed (its last write fails): the error comes out,
    and the store's lock is released all the same, so the same long-lived process (a Dask
    worker) can ingest again."""
    import errno

    from actdb.store import catalog
    from actdb.store.store import open_backend

    store, model = tmp_path / "c.actdb", model_dir("gpt2")
    actdb.ingest(store, model=str(model), prompts=PROMPTS[:1], device="cpu", name="m",
                 chunk_tokens=64)
    real_close = catalog.Catalog.close

    def failing_close(self: catalog.Catalog, **kw: bool) -> None:
        real_close(self, **kw)
        # the shard ingest's own writer, closed with the store (not made and closed at once)
        if (self.path.parent.parent.name == "shards" and not self.read_only
                and not kw.get("strict")):
            raise OSError(errno.EIO, "the shard catalog could not be closed")

    monkeypatch.setattr(catalog.Catalog, "close", failing_close)
    with pytest.raises(OSError, match="could not be closed"):
        actdb.ingest(store, model=str(model), prompts=PROMPTS[:8], device="cpu", name="m",
                     shard=(0, 2))
    monkeypatch.setattr(catalog.Catalog, "close", real_close)
    whole = open_backend(str(store))
    whole.lock()  # no shard's shared lock was left behind
    whole.unlock()
    for i in (0, 1):
        actdb.ingest(store, model=str(model), prompts=PROMPTS[:8], device="cpu", name="m",
                     shard=(i, 2))
    actdb.merge(store)
    assert CliRunner().invoke(cli, ["verify", str(store), "--full"]).exit_code == 0
