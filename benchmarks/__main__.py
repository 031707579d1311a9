"""python -m benchmarks [--quick] [--only NAME ...]: run every bench module, write BENCHMARKS.md."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
import time
import traceback

from benchmarks.report import ROOT, Section, machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--only", nargs="*", default=None, help="bench module names, e.g. bench_mooncake")
    parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the sections to an existing report (e.g. the UCM row, which needs Python 3.12)",
    )
    args = parser.parse_args(argv)
    names = sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "benchmarks")]) if m.name.startswith("bench_"))
    if args.only:
        names = [n for n in names if n in args.only]
    sections: list[Section] = []
    for name in names:
        started = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            section = importlib.import_module(f"benchmarks.{name}").run(quick=args.quick)
        except Exception as exc:  # one broken bench must not hide the others' numbers
            traceback.print_exc()
            section = Section(title=name, notes=[f"failed: {type(exc).__name__}: {exc}"])
        section.notes.append(f"took {time.monotonic() - started:.0f} s")
        sections.append(section)
    session = "bench-ucm-3.12" if args.append else "bench"
    command = f"nox -s {session}" + (" -- --quick" if args.quick else "")
    if args.append:
        with open(args.output) as fh:
            existing = fh.read()
        for s in sections:  # replace a "not run here" placeholder of the same section
            existing = re.sub(rf"## {re.escape(s.title)}\n(?:(?!\n## |\n<!--).)*", "", existing, flags=re.S)
        out = [existing.rstrip(), "", f"<!-- appended by `{command}` on {machine()} -->", ""]
    else:
        out = [
            "# Benchmarks",
            "",
            f"Machine: {machine()}. Command: `{command}` (the UCM sections: `nox -s bench-ucm-3.12`, run after it).",
            "Every number is a median of several runs; ratios compare against the raw engine or",
            "backend measured in the same run.",
            "",
        ]
    for s in sections:
        out += [f"## {s.title}", ""]
        if s.summary:
            out += [s.summary, ""]
        out += [f"![{s.title}]({p})" for p in s.plots] + ([""] if s.plots else [])
        for t in s.tables:
            out += [t, ""]
        out += [f"- {n}" for n in s.notes] + [""]
    with open(args.output, "w") as fh:
        fh.write("\n".join(out))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
