"""python -m benchmarks [--quick] [--only NAME ...] [--append]: run the sections, write BENCHMARKS.md.

A section is a module of an area folder (``p2p/``, ``store/``, ``connectors/``, ``serving/``: every
package under ``benchmarks/`` whose name has no leading ``_``) that has ``run(quick)`` or ``main()``;
:data:`SECTIONS` gives each its name (its BENCHMARKS.md markers, what ``--only`` takes) and the
report's order. Without ``--only`` every section runs and the whole report is written from this one run:
the summary is generated from the sections' claims (each computed from this run's figures). With
``--only`` (or ``--append``, the 3.12 UCM session) the named sections and their summary entries
replace those of the existing report, each section carrying its own run line (date, machine, mode,
load), so a section re-run alone never passes for part of the other sections' run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pkgutil
import sys
import time
import traceback

from benchmarks._lib.benchmarks_md import run_line, write_report
from benchmarks._lib.report import ROOT, Claim, Section, load_average, table

# Section name -> its module under benchmarks/, in report order. The names are those the sections
# had as flat ``benchmarks/bench_*.py`` modules: BENCHMARKS.md's markers, its run lines, the
# noxfile's ``--only`` and the docs keep them. A module found in an area but not named here runs
# under its path (e.g. ``store.new_thing``), after these, in alphabetical order.
SECTIONS = {
    "bench_transfer_raw": "p2p.transfer_ceilings",
    "bench_mooncake": "p2p.pull",
    "bench_verify_kv": "p2p.verify_kv_cost",
    "bench_pull_concurrency": "p2p.pull_concurrency",
    "bench_integrity": "store.integrity_put_get",
    "bench_integrity_cost": "store.checksum_speed",
    "bench_store": "store.put_get",
    "bench_store_load": "store.load_async",
    "bench_overhead": "connectors.overhead",
    "bench_producer_hold": "p2p.producer_hold",
    "bench_ttft": "connectors.ttft",
    "bench_proxy": "serving.proxy_cost",
    "bench_pd_goodput": "serving.pd_goodput",
    "bench_proxy_routing": "serving.proxy_routing",
    "bench_ucm": "connectors.ttft_ucm",
    "bench_ucm_store": "store.ucm_put_get",
}


def discover() -> dict[str, str]:
    """Every section found, name -> module path (``area.module``), in report order."""
    here = ROOT / "benchmarks"
    areas = [a.name for a in pkgutil.iter_modules([str(here)]) if a.ispkg and not a.name.startswith("_")]
    found = {f"{a}.{m.name}" for a in areas for m in pkgutil.iter_modules([str(here / a)])
             if not m.ispkg and not m.name.startswith("_")}
    named = {name: module for name, module in SECTIONS.items() if module in found}
    return named | {module: module for module in sorted(found - set(SECTIONS.values()))}


def as_section(module, result) -> Section:
    """A bench module's result as a Section: modules that return rows (a list of dicts) get a
    generic table under their docstring's first line."""
    if isinstance(result, Section):
        return result
    title = ((module.__doc__ or module.__name__).strip().splitlines() or [module.__name__])[0].rstrip(".")
    rows = [r for r in (result or []) if isinstance(r, dict)]
    keys = [k for k in (rows[0] if rows else {}) if not isinstance(rows[0][k], (dict, list))]
    tables = [table(keys, [[r.get(k, "–") for k in keys] for r in rows])] if rows else []
    return Section(title=title, summary=(module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
                   tables=tables, notes=["rows as the module returns them (it builds no Section of its own)"])


def from_main(module, quick: bool) -> Section:
    """Run a bench module that has only ``main()`` (it parses ``sys.argv`` and prints Markdown):
    what it prints becomes the section's body, under its docstring's first line."""
    import contextlib
    import io

    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module.__name__] + (["--quick"] if quick else [])
    try:
        with contextlib.redirect_stdout(out):
            module.main()
    finally:
        sys.argv = argv
    doc = (module.__doc__ or module.__name__).strip()
    title = doc.split("\n\n")[0].replace("\n", " ")
    short = title.split(":")[0] if ":" in title[:80] else title[:80]
    return Section(title=short, summary=title, tables=[out.getvalue().strip()],
                   notes=["printed by the module's own main() (it builds no Section): no generated findings"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--only", nargs="*", default=None,
                        help="section names, e.g. bench_mooncake (or module paths, e.g. p2p.pull)")
    parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument(
        "--append",
        action="store_true",
        help="replace the sections run here in the existing report (e.g. the UCM ones, Python 3.12)",
    )
    parser.add_argument(
        "--load-note",
        default=os.environ.get("KV_BENCH_LOAD_NOTE", ""),
        help="what else ran on the machine (written into every run line)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sections_found = discover()
    if args.only:
        unknown = set(args.only) - set(sections_found) - set(sections_found.values())
        if unknown:
            parser.error(f"no such section: {', '.join(sorted(unknown))} (sections: {', '.join(sections_found)})")
        sections_found = {n: m for n, m in sections_found.items() if n in args.only or m in args.only}
    mode = "quick" if args.quick else "full"
    command = "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv)
    whole_run = run_line(mode, command.strip(), float("nan"), float("nan"), args.load_note).split("; load")[0]
    partial = bool(args.only) or args.append
    base_doc = ""
    if partial and os.path.exists(args.output):
        with open(args.output) as fh:
            base_doc = fh.read()
    if partial:
        head = "This file holds only sections re-run alone; run `python -m benchmarks` for the whole report."
    else:
        head = "Whole report: " + whole_run.replace("Run ", "run started ", 1) + "."
        if args.quick:
            head += (
                "\n\n> **Quick mode**: fewer sizes, repetitions and requests than the full run; read the "
                "spreads, not just the medians, and each section's run line for the machine's load. A quick "
                "run shows that the benchmarks run and roughly where the targets stand; the figures to "
                "quote come from a full-mode run (`nox -s bench`) on a quiet machine."
            )
    sections: list[tuple[str, Section]] = []
    for name, module_path in sections_found.items():
        started, load_before = time.monotonic(), load_average()
        started_at = datetime.datetime.now(datetime.timezone.utc)
        print(f"== {name}", flush=True)
        try:
            module = importlib.import_module(f"benchmarks.{module_path}")
            if hasattr(module, "run"):
                section = as_section(module, module.run(quick=args.quick))
            else:  # a standalone script (a main() printing Markdown): its output is the section
                section = from_main(module, args.quick)
        except Exception as exc:  # one broken bench must not hide the others' numbers
            traceback.print_exc()
            section = Section(title=name, notes=[f"failed: {type(exc).__name__}: {exc}"])
            section.claims.append(Claim(f"{name} failed: {type(exc).__name__}: {exc}"[:300]))
        section.notes.append(f"took {time.monotonic() - started:.0f} s")
        section.run_line = run_line(mode, command.strip(), load_before, load_average(), args.load_note, started_at)
        sections.append((name, section))
        # Written after every section: a run stopped part-way (a stalled VM, a deadline) keeps the
        # sections it finished.
        write_report(args.output, base_doc, head, sections)

    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
