"""Shared plumbing for the benchmark modules: machine facts, medians, ratios, sections, plots.

Each ``benchmarks/bench_*.py`` exposes ``run(quick: bool) -> Section``; ``python -m benchmarks``
runs them all and writes BENCHMARKS.md with the plots first and the tables after.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLOTS = ROOT / "benchmarks" / "plots"


@dataclass
class Section:
    title: str
    summary: str = ""  # one paragraph: what was measured and how to read it
    tables: list[str] = field(default_factory=list)  # markdown tables
    plots: list[str] = field(default_factory=list)  # paths relative to the repo root
    notes: list[str] = field(default_factory=list)  # what could not run here, and why


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(value: float, reference: float) -> float:
    return value / reference if reference else float("nan")


def table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def plot_path(name: str) -> Path:
    PLOTS.mkdir(parents=True, exist_ok=True)
    return PLOTS / name


def progress(iterable, total: int | None = None, desc: str = ""):
    """A progress bar for long runs (tqdm when present, plain otherwise)."""
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc)
    except ImportError:
        return iterable
