"""Scheduler overhead and memory: every connector with no hits against no connector.

One in-process vLLM engine per row (so one ``LLMEngine.step()`` runs the scheduler, the connector's
scheduler hooks and the model), on the tiny 2-layer model, many short fresh prompts (nothing to
hit, but store connectors save what they see). Per round of ``ROUND`` requests: the engine's mean
step time and request throughput; per request: the scheduler-side lookup
(``get_num_new_matched_tokens``) time, wrapped by the benchmark child. Then the resident memory of
the engine's process tree (psutil) is sampled every ``SAMPLE_EVERY`` requests.

Every row's engine is up at once and the rounds go round-robin over the rows (the same prompts for
every row in a round), so each row is compared with the no-connector round next to it in time (the
median of the per-round ratios). Two no-connector engines ("no connector", "no connector (again)"):
the ratio between them is this machine's noise floor.
"""

from __future__ import annotations

import contextlib
import random
import time

from benchmarks._engine import (
    ROW_CONNECTOR,
    BenchEngine,
    MooncakeMaster,
    connector_configs,
    first_error_line,
    runnable_rows,
    scratch_dir,
)
from benchmarks.report import Section, median, plot_path, progress, table

MODEL: dict = {}  # the harness default tiny model (2 layers, hidden 128, 4 heads x 32)
ROUND = 256
MAX_TOKENS = 16
MAX_NUM_SEQS = 32
PROMPT_LEN = (64, 320)
ROWS = ["no connector", *ROW_CONNECTOR, "no connector (again)"]


class PromptSource:
    """Fresh random prompts, the same sequence for every row (seeded)."""

    def __init__(self, seed: int = 11, vocab: int = 1024) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def take(self, n: int) -> list[list[int]]:
        return [
            [self.rng.randrange(4, self.vocab) for _ in range(self.rng.randint(*PROMPT_LEN))]
            for _ in range(n)
        ]


class RowResult:
    def __init__(self) -> None:
        self.step_ms: list[float] = []  # mean step time per round
        self.req_per_s: list[float] = []
        self.lookup_us: list[float] = []
        self.rss: list[tuple[int, float]] = []  # (requests done, MiB)
        self.hits = 0


def start_row(row: str, model_dir, workdir, master) -> BenchEngine:
    """The row's engine, started and warmed up."""
    if row.startswith("no connector"):
        cfg, env = None, {}
    else:
        cfg, env = connector_configs(
            row, workdir=workdir, master=master, embedded_capacity=16 << 20, offload_bytes=256 << 20
        )
    # One OpenMP thread: the tiny model gains nothing from two, and spinning OpenMP threads make step
    # times swing by several x when other processes share the cores.
    env = {**env, "OMP_NUM_THREADS": "1"}
    eng = BenchEngine(
        model_dir,
        name="overhead",
        kv_transfer_config=cfg,
        env=env,
        max_tokens=MAX_TOKENS,
        max_model_len=512,
        kv_cache_bytes=128 << 20,
        extra_llm_kwargs={"max_num_seqs": MAX_NUM_SEQS},
    )
    try:
        eng.start()
        eng.generate(PromptSource(seed=99).take(64), timeout_s=300)  # warm-up
        eng.timings()
    except BaseException:
        eng.close()
        raise
    return eng


def measure_round(eng: BenchEngine, prompts: list[list[int]], res: RowResult) -> None:
    r = eng.generate(prompts, timeout_s=300)
    t = eng.timings()
    steps = t["step_s"]
    res.step_ms.append(1e3 * sum(steps) / max(1, len(steps)))
    res.req_per_s.append(len(prompts) / r.wall_s)
    res.lookup_us += [1e6 * x for x in t["lookup_s"]]
    res.hits += sum(1 for c in r.num_cached_tokens if c)  # should stay 0: fresh prompts


def measure_memory(eng: BenchEngine, mem_requests: int, sample_every: int, res: RowResult) -> None:
    src = PromptSource(seed=5)
    done = 0
    res.rss.append((0, eng.rss_bytes() / 2**20))
    while done < mem_requests:
        eng.generate(src.take(sample_every), timeout_s=300)
        done += sample_every
        res.rss.append((done, eng.rss_bytes() / 2**20))
    eng.timings()


def paired(res: RowResult, base: RowResult, attr: str) -> float:
    """Median over rounds of this row's value / the no-connector value of the same round."""
    return median([a / b for a, b in zip(getattr(res, attr), getattr(base, attr), strict=True) if b])


def _plot(results: dict[str, RowResult]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(results)
    base = results[names[0]] if names and names[0].startswith("no connector") else None
    a1.barh(
        range(len(names)),
        [paired(results[n], base, "step_ms") if base else median(results[n].step_ms) for n in names],
        color=["grey" if n.startswith("no connector") else "C0" for n in names],
    )
    a1.set_yticks(range(len(names)), names, fontsize=7)
    a1.invert_yaxis()
    if base:
        a1.axvline(1.0, color="k", linewidth=0.8)
        a1.axvline(1.02, color="r", linewidth=0.8, linestyle=":")
        a1.set_xlabel("mean engine step time / no connector (red: +2 %)")
    a1.set_title("Scheduler overhead, no hits")
    for n in names:
        pts = results[n].rss
        if pts:
            a2.plot([p[0] for p in pts], [p[1] for p in pts], "--" if n.startswith("vLLM") else "-", label=n)
    a2.set_xlabel("requests")
    a2.set_ylabel("RSS of the engine process tree (MiB)")
    a2.set_title("Resident memory over requests")
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(plot_path("overhead.png"), dpi=110)
    plt.close(fig)
    return "benchmarks/plots/overhead.png"


def run(quick: bool) -> Section:
    from kv_common.testing import cached_tiny_model

    rounds = 3 if quick else 9
    mem_requests = 200 if quick else 1000
    sample_every = 25 if quick else 50
    warm = mem_requests // 4  # growth is measured from here to the end
    model_dir = cached_tiny_model(**MODEL)
    notes: list[str] = []
    results: dict[str, RowResult] = {}
    engines: dict[str, BenchEngine] = {}
    with contextlib.ExitStack() as stack:
        # Every row's engine is started first and stays up (idle between its rounds); the rounds
        # then go round-robin over the rows, so a drift of this shared machine's speed over minutes
        # hits every row alike, and each row is compared with the no-connector round next to it.
        for row in runnable_rows(ROWS, "KV_BENCH_OVERHEAD_ROWS", "overhead: start engines", notes):
            t0 = time.monotonic()
            try:
                workdir = stack.enter_context(scratch_dir("kv-bench-overhead-"))
                master = None
                if row in ("kv-store mooncake", "vLLM MooncakeStoreConnector"):
                    master = stack.enter_context(MooncakeMaster())
                engines[row] = start_row(row, model_dir, workdir, master)
                stack.callback(engines[row].close)
                results[row] = RowResult()
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{row}: failed after {time.monotonic() - t0:.0f} s: {first_error_line(exc)}")
        src = PromptSource()
        names = list(engines)
        for rnd in progress(range(rounds), desc="overhead rounds"):
            prompts = src.take(ROUND)  # the same prompts for every row in a round
            for row in names[rnd % len(names) :] + names[: rnd % len(names)]:
                measure_round(engines[row], prompts, results[row])
        for row in progress(names, desc="memory"):
            measure_memory(engines[row], mem_requests, sample_every, results[row])

    base = results.get("no connector")
    rows = []
    for name, r in results.items():
        step = median(r.step_ms)
        lk = sorted(r.lookup_us)
        if r.hits:
            notes.append(f"{name}: {r.hits} measured requests got cached tokens (expected none)")
        growth = "–"
        if r.rss:
            after = [m for n, m in r.rss if n >= warm]
            if after:
                growth = f"{after[-1] - after[0]:+.1f}"
        rows.append(
            [
                name,
                f"{paired(r, base, 'step_ms'):.3f}" if base else "–",
                f"{paired(r, base, 'req_per_s'):.3f}" if base else "–",
                f"{step:.3g}",
                f"{median(lk):.3g}" if lk else "–",
                f"{lk[int(0.99 * (len(lk) - 1))]:.3g}" if lk else "–",
                f"{r.rss[0][1]:,.0f}" if r.rss else "–",
                growth,
            ]
        )
    t = table(
        [
            "connector",
            "step time / none",
            "req/s / none",
            "mean step ms",
            "lookup µs (median)",
            "lookup µs (p99)",
            "RSS MiB at start",
            f"RSS growth MiB, req {warm} to {mem_requests}",
        ],
        rows,
    )
    again = results.get("no connector (again)")
    if base and again:
        noise = abs(paired(again, base, "step_ms") - 1)
        notes.append(
            f"noise floor: the two no-connector engines differ by {noise:.1%} in step time (median of the "
            "per-round ratios); a difference below that is not measurable here"
        )
    notes.append(
        f"workload: {rounds} rounds of {ROUND} fresh prompts of {PROMPT_LEN[0]}-{PROMPT_LEN[1]} random tokens, "
        f"max_tokens={MAX_TOKENS}, max_num_seqs={MAX_NUM_SEQS}, OMP_NUM_THREADS=1; step time = mean LLMEngine.step() per round, "
        "'/ none' = median over rounds of the ratio to the no-connector round beside it; 'mean step ms' = median "
        "over rounds; lookup = connector.get_num_new_matched_tokens per call (scheduler side)"
    )
    notes.append(
        f"memory: {mem_requests} more requests, RSS (psutil, engine process tree) every {sample_every}; "
        "kv-store embedded capacity 16 MiB (its LRU fills during warm-up), OffloadingConnector 256 MiB, "
        "Mooncake segments 512 MiB preallocated"
    )
    return Section(
        title="Scheduler overhead and memory",
        summary=(
            "Cost of having a connector when nothing hits: engine step time and request throughput relative to "
            "the same engine without a connector (target: within 2 %), the scheduler-side lookup time per call, "
            "and the engine's resident memory over many requests (flat after warm-up = no leak)."
        ),
        tables=[t],
        plots=[_plot(results)] if results else [],
        notes=notes,
    )
