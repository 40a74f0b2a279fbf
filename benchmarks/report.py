"""Benchmark results, the machine they ran on, and BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from method import Ratio

APART = Path(__file__).with_name("measured_apart.md")


@dataclass(kw_only=True)
class Result:
    """One workload: measured figures, ratios against baselines, targets."""

    title: str
    what: str
    figures: list[tuple[str, str]] = field(default_factory=list)  # (label, value with unit)
    ratios: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def figure(self, label: str, value: str) -> None:
        self.figures.append((label, value))

    def ratio(self, label: str, value: float | Ratio, target: str, met: bool) -> None:
        """A row of the table: a timed ratio (`Ratio`, printed with its spread and rounds)
        or a figure that no timing makes (bytes, CPU seconds, rows right)."""
        if isinstance(value, Ratio):
            self.ratios.append(Row(label=label, value=value.median, spread=value.spread,
                                   rounds=len(value.rounds), target=target, met=met))
            self.figure(f"{label}, each round", value.each())
        else:
            self.ratios.append(Row(label=label, value=value, spread="", rounds=0,
                                   target=target, met=met))


@dataclass(frozen=True, kw_only=True)
class Row:
    """One row of today's table."""

    label: str
    value: float
    spread: str  # min..max of the per-round ratios; empty for an untimed figure
    rounds: int
    target: str
    met: bool


def machine(load_at_start: tuple[float, float, float] | None = None) -> dict[str, str]:
    import duckdb
    import torch
    import zarr

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    flags: list[str] = []
    try:
        text = Path("/proc/cpuinfo").read_text()
        line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        flags = [f for f in line.split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")]
    except OSError:
        pass
    loads = [("at the start", load_at_start), ("at the end", os.getloadavg())]
    load = "; ".join(f"{when} {a:.2f}, {b:.2f}, {c:.2f}" for when, v in loads if v is not None
                     for a, b, c in [v])
    return {
        "CPU": f"{cpu}, {os.cpu_count()} cores",
        "load average (1, 5, 15 min)": load,
        "memory": mem,
        "GPU": gpu,
        "matrix instructions": ", ".join(flags) or "unknown",
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "torch": f"{torch.__version__} ({torch.get_num_threads()} threads)",
        "DuckDB": duckdb.__version__,
        "Zarr": zarr.__version__,
    }


def write_report(path: Path, results: list[Result], mach: dict[str, str], *, command: str,
                 seconds: float, scale: str) -> None:
    """BENCHMARKS.md: today's table first (each ratio against its baseline, the target, the
    machine and the command), the machine, then each workload's set-up and figures."""
    lines = [
        "# Benchmarks",
        "",
        "Today's figures: every ratio is actdb against a baseline measured in the same run, on "
        "the same data, with fixed seeds. A timed ratio is the median of per-round ratios, each "
        "round timing actdb and its baseline back to back in alternating order (actdb first in "
        "odd rounds, the baseline first in even ones; one untimed warm-up of each first; page "
        "cache warm), with the spread of the rounds' ratios (min..max) beside it "
        "(benchmarks/method.py). Compare ratios, not times across machines. Each workload's "
        "set-up and its figures follow the table; earlier runs are in git's history.",
        "",
        "| workload | measured against (baseline) | ratio | spread | rounds | target | met "
        "| machine | command |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for row in r.ratios:
            lines.append(f"| {r.title} | {row.label} | {row.value:.3g} | {row.spread or '-'} | "
                         f"{row.rounds or '-'} | {row.target} | "
                         f"{'yes' if row.met else '**no**'} | A | `{command}` |")
    lines += [
        "",
        "## Machine",
        "",
        f"A: the machine of this run (`{command}`, {seconds:.0f} s, scale `{scale}`):",
        "",
        *[f"- {k}: {v}" for k, v in mach.items()],
    ]
    for r in results:
        lines += ["", f"## {r.title}", "", r.what, ""]
        lines += [f"- {label}: {value}" for label, value in r.figures]
        if r.notes:
            lines += ["", *r.notes]
    # The figures of scripts run apart from the suite, kept where this rewrite cannot lose them.
    apart = (APART.read_text().split("-->", 1)[-1].strip() if APART.exists() else "")
    if apart:
        lines += ["", apart]
    path.write_text("\n".join(lines) + "\n")
