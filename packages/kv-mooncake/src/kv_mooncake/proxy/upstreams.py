"""The prefill and decode instances behind the proxy: which are up, what load each carries.

An instance is taken out by a failed leg or health probe and back in by a served leg or a good
probe; every change is published as Prometheus gauges. Which instance serves a leg is
:mod:`.balancer`'s (pure bookkeeping); the probes and the metrics are here.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from kv_mooncake.proxy.balancer import Instance, InstancePool
from kv_mooncake.proxy.config import ProxyConfig
from kv_mooncake.proxy.metrics import ProxyMetrics

logger = logging.getLogger("kv_mooncake.proxy")


class Upstreams:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.prefills = InstancePool("prefill", config.prefill_urls)
        self.decodes = InstancePool("decode", config.decode_urls)
        for inst in self.instances():
            self._publish(inst)

    def instances(self) -> list[Instance]:
        return [*self.prefills.instances, *self.decodes.instances]

    def _publish(self, inst: Instance) -> None:
        self.metrics.healthy.labels(inst.role, inst.url).set(1 if inst.healthy else 0)
        self.metrics.outstanding.labels(inst.role, inst.url).set(inst.outstanding_tokens)

    def _pool(self, inst: Instance) -> InstancePool:
        return self.prefills if inst.role == "prefill" else self.decodes

    # ---- around every leg
    def acquire(self, inst: Instance, tokens: int) -> None:
        self._pool(inst).acquire(inst, tokens)
        self._publish(inst)

    def release(self, inst: Instance, tokens: int) -> None:
        self._pool(inst).release(inst, tokens)
        self._publish(inst)

    def failed(self, inst: Instance, kind: str, detail: str) -> None:
        self.metrics.leg_failures.labels(inst.role, inst.url, kind).inc()
        if self._pool(inst).mark_down(inst, f"{kind}: {detail}"):
            logger.warning("%s %s taken out (%s: %s)", inst.role, inst.url, kind, detail)
        self._publish(inst)

    def succeeded(self, inst: Instance) -> None:
        if self._pool(inst).mark_up(inst):
            logger.info("%s %s back in (served a request)", inst.role, inst.url)
            self._publish(inst)

    # ---- health
    async def health_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.gather(*(self._probe(client, i) for i in self.instances()))
            await asyncio.sleep(self.config.health_interval_s)

    async def _probe(self, client: httpx.AsyncClient, inst: Instance) -> None:
        try:
            r = await client.get(f"{inst.url}/health", timeout=self.config.health_timeout_s)
            ok, reason = r.status_code == 200, f"health check answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"health check failed: {type(exc).__name__} {exc}"
        if ok:
            if self._pool(inst).mark_up(inst):
                logger.info("%s %s back in (health check)", inst.role, inst.url)
        elif self._pool(inst).mark_down(inst, reason):
            logger.warning("%s %s taken out (%s)", inst.role, inst.url, reason)
        self._publish(inst)

    def can_serve(self) -> bool:
        """A request can go through: a prefill (or the decode-only fallback) and a decode are up."""
        can_prefill = self.prefills.any_healthy() or self.config.fallback == "decode-only"
        return can_prefill and self.decodes.any_healthy()

    def states(self) -> dict[str, list[dict]]:
        """Every instance as ``/health`` shows it, by role."""
        return {pool.role: [{"url": i.url, "healthy": i.healthy, "outstanding_tokens": i.outstanding_tokens,
                             "in_flight": i.in_flight, "last_error": i.last_error} for i in pool.instances]
                for pool in (self.prefills, self.decodes)}
