"""Benchmark results, the machine they ran on, and BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class Result:
    """One workload: measured figures, ratios against baselines, targets."""

    title: str
    what: str
    figures: list[tuple[str, str]] = field(default_factory=list)  # (label, value with unit)
    ratios: list[tuple[str, float, str, bool]] = field(default_factory=list)  # label, x, target
    notes: list[str] = field(default_factory=list)

    def figure(self, label: str, value: str) -> None:
        self.figures.append((label, value))

    def ratio(self, label: str, value: float, target: str, met: bool) -> None:
        self.ratios.append((label, value, target, met))


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
        "the same data, with fixed seeds (times are medians of repeated runs after a warm-up, "
        "page cache warm). Compare ratios, not times across machines. Each workload's set-up "
        "and its figures follow the table; earlier runs are in git's history.",
        "",
        "| workload | measured against (baseline) | ratio | target | met | machine | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for label, value, target, met in r.ratios:
            lines.append(f"| {r.title} | {label} | {value:.3g} | {target} | "
                         f"{'yes' if met else '**no**'} | A | `{command}` |")
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
    path.write_text("\n".join(lines) + "\n")
