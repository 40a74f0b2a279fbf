"""The README's command reference is what `--help` says, and `--help`'s facts are the code's."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import zarr
from click.testing import CliRunner
from support import cli_reference
from support.prompts import PROMPTS

from actdb.cli import cli


def test_readme_command_reference_is_the_help() -> None:
    readme = cli_reference.README.read_text(encoding="utf-8")
    assert readme == cli_reference.rewritten(readme), (
        "README.md's command reference differs from `actdb --help`: run "
        "`python tests/support/cli_reference.py` and commit README.md")
    for path, _ in cli_reference._commands():
        assert f"<code>actdb {' '.join(path)} --help</code>" in readme


def test_ingest_help_states_the_default_chunk_size(tmp_path: Path,
                                                   model_dir: Callable[[str], Path]) -> None:
    """`ingest --help` names the default chunk's size: an ingest without --chunk-tokens makes
    direction chunks of that many bytes (a width of 64 divides it exactly)."""
    text = " ".join(CliRunner().invoke(cli, ["ingest", "--help"]).output.split())
    kib = int(re.search(r"--chunk-tokens .*?about (\d+) KiB", text)[1])  # type: ignore[index]
    store = tmp_path / "s.actdb"
    result = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(model_dir("gpt2")),
                                      "--prompts", "-", "--device", "cpu", "--name", "m",
                                      "--no-progress"], input=PROMPTS[0] + "\n")
    assert result.exit_code == 0, result.output
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    (model,) = list(group["models"].group_keys())
    sites = group[f"models/{model}/acts"]
    directions = [sites[f"{site}/direction"] for site in sites.group_keys()]
    assert directions
    for array in directions:
        rows, d = array.chunks
        assert d == 64 and rows * d * 2 == kib * 1024, (array.chunks, kib)
