"""The README's command reference, generated from the CLI's own `--help`.

    python tests/support/cli_reference.py          # rewrite README.md's marked section
    python tests/support/cli_reference.py --check  # exit 1 if it differs from --help

The section lies between the BEGIN and END markers in README.md: a table of the commands with
their usage line and short help, then each command's whole `--help` text (at 100 columns).
tests/unit/test_cli_reference.py fails when the section and `--help` disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import click
from click.testing import CliRunner

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = ("<!-- BEGIN cli-reference: generated from `actdb --help`; regenerate with "
         "`python tests/support/cli_reference.py` after changing a command or an option -->")
END = "<!-- END cli-reference -->"
WIDTH = 100


def _help(args: list[str]) -> str:
    from actdb.cli import cli

    result = CliRunner().invoke(cli, [*args, "--help"], prog_name="actdb",
                                terminal_width=WIDTH, max_content_width=WIDTH)
    if result.exit_code != 0:
        raise RuntimeError(f"`actdb {' '.join(args)} --help` failed: {result.output}")
    return result.output.rstrip() + "\n"


def _commands() -> list[tuple[list[str], click.Command]]:
    """Every command, the plot group's pictures among them, in the order --help lists them."""
    from actdb.cli import cli

    out: list[tuple[list[str], click.Command]] = []
    ctx = click.Context(cli, info_name="actdb")
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None
        out.append(([name], command))
        if isinstance(command, click.Group):
            sub = click.Context(command, info_name=name, parent=ctx)
            for child in command.list_commands(sub):
                child_command = command.get_command(sub, child)
                assert child_command is not None
                out.append(([name, child], child_command))
    return out


def reference() -> str:
    """The section's text, markers included."""
    rows = ["| command | what it does |", "|---|---|"]
    blocks = []
    for path, command in _commands():
        text = _help(path)
        usage = text.splitlines()[0].removeprefix("Usage: ").strip()
        summary = command.get_short_help_str(limit=200).replace("|", "\\|")
        rows.append(f"| `{usage.replace('|', chr(92) + '|')}` | {summary} |")
        blocks.append(f"<details><summary><code>actdb {' '.join(path)} --help</code></summary>"
                      f"\n\n```text\n{text}```\n\n</details>")
    return "\n".join([BEGIN, "", *rows, "", *blocks, "", END])


def rewritten(readme: str) -> str:
    """README text with the marked section replaced by `reference()`."""
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"{README} has no cli-reference markers ({BEGIN!r} ... {END!r})")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + reference() + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = ap.parse_args()
    current = README.read_text(encoding="utf-8")
    new = rewritten(current)
    if args.check:
        sys.exit(0 if new == current else 1)
    if new != current:
        README.write_text(new, encoding="utf-8")
        print(f"rewrote the command reference in {README}")


if __name__ == "__main__":
    main()
