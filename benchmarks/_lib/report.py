"""Shared plumbing for the benchmark modules: machine facts, statistics, sections, claims, plots.

Each section module (``benchmarks/<area>/<what>.py``) exposes ``run(quick: bool) -> Section``;
``python -m benchmarks`` runs them all and writes the whole BENCHMARKS.md: a summary generated from
the sections' claims (each computed from this run's figures), then every section with its own run
line (date, machine, mode, load), its findings next to its plots and tables. What the runs write
besides BENCHMARKS.md goes under :data:`RESULTS` (plots under :data:`PLOTS`), apart from the code.
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"  # generated: plots, standalone tables
PLOTS = RESULTS / "plots"


@dataclass
class Claim:
    """One finding of a run, written from its numbers: ``met`` is None for a plain figure, else
    whether the target it names was met."""

    text: str
    met: bool | None = None

    def markdown(self) -> str:
        mark = {True: "**met**: ", False: "**missed**: ", None: ""}[self.met]
        return f"{mark}{self.text}"


@dataclass
class Section:
    title: str
    summary: str = ""  # one paragraph: what was measured and how to read it
    tables: list[str] = field(default_factory=list)  # markdown tables
    plots: list[str] = field(default_factory=list)  # paths relative to the repo root
    notes: list[str] = field(default_factory=list)  # what could not run here, and why
    claims: list[Claim] = field(default_factory=list)  # findings, generated from the figures
    run_line: str = ""  # date, machine, mode, load: filled in by ``python -m benchmarks``


# ---------------------------------------------------------------- statistics
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(value: float, reference: float) -> float:
    return value / reference if reference else float("nan")


def bootstrap_ci(
    values: Sequence[float],
    stat: Callable[[Sequence[float]], float] = median,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 1,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat`` over ``values`` (nan, nan for fewer than 3)."""
    if len(values) < 3:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return quantile(stats, (1 - level) / 2), quantile(stats, 1 - (1 - level) / 2)


def slope_ci(xs: Sequence[float], ys: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Least-squares slope of ys on xs with a normal-approximation interval (slope, lo, hi)."""
    n = len(xs)
    if n < 3:
        return float("nan"), float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx:
        return float("nan"), float("nan"), float("nan")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    resid = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    se = math.sqrt(resid / (n - 2) / sxx)
    z = statistics.NormalDist().inv_cdf(1 - (1 - level) / 2)
    return b, b - z * se, b + z * se


def against_target(
    what: str, value: float, target: float, *, higher_is_better: bool = True, fmt: str = ".3g", unit: str = ""
) -> Claim:
    """A claim stating ``value`` against ``target``: met, or missed by how much."""
    if math.isnan(value):
        return Claim(f"{what}: not measured (target {'>=' if higher_is_better else '<='} {target:{fmt}}{unit})", False)
    met = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    gap = abs(value - target)
    shown, gap_shown = f"{value:{fmt}}", f"{gap:{fmt}}"
    if not met and float(gap_shown) == 0:  # missed by less than the format shows: say by how much
        shown, gap_shown = f"{value:.3g}", f"{gap:.1g}"
    tail = f"target {sign} {target:{fmt}}{unit}" + ("" if met else f", short by {gap_shown}{unit}")
    return Claim(f"{what}: {shown}{unit} ({tail})", met)


# ---------------------------------------------------------------- output
def table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "–"
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


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def plot_path(name: str) -> Path:
    PLOTS.mkdir(parents=True, exist_ok=True)
    return PLOTS / name


def save_plot(fig, name: str) -> str:
    """Write ``fig`` (tight layout, 110 dpi) to ``benchmarks/results/plots/NAME`` and close it; returns the
    path the report links, relative to the repository root."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(ROOT))


def prompt_length_axes(ax, lengths: Sequence[int]) -> None:
    """Prompt lengths on a log-2 x axis labelled 1k, 2k, ..., times on a log y axis, a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(lengths), [f"{n // 1024}k" for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.grid(True, which="both", alpha=0.3)


def progress(iterable, total: int | None = None, desc: str = ""):
    """A progress bar for long runs (tqdm when present, plain otherwise)."""
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc)
    except ImportError:
        return iterable


def side_by_side(what: str, ours: str, ours_v: tuple[float, float, float], peer: str,
                 peer_v: tuple[float, float, float] | None, *, interval: str, fmt: str = ".2f",
                 unit: str = "", peer_missing: str = "not measured in this run (see the notes)") -> Claim:
    """Ours against vLLM's own connector on one figure (lower is better), each as (value, low,
    high): ahead (met) or behind (missed) only when the intervals do not overlap, else unresolved."""
    if peer_v is None or math.isnan(peer_v[0]):
        return Claim(f"{what}: {ours} against {peer}: {peer} {peer_missing}")

    def shown(v: tuple[float, float, float]) -> str:
        return f"{v[0]:{fmt}}{unit} ({interval} {v[1]:{fmt}} to {v[2]:{fmt}})"

    text = f"{what}: {ours} {shown(ours_v)} against {peer} {shown(peer_v)}"
    if ours_v[2] < peer_v[1]:
        return Claim(f"{text}: ours ahead by {peer_v[0] - ours_v[0]:{fmt}}{unit}", True)
    if ours_v[1] > peer_v[2]:
        return Claim(f"{text}: ours behind by {ours_v[0] - peer_v[0]:{fmt}}{unit}", False)
    return Claim(f"{text}: the intervals overlap, no difference resolved in this run")
