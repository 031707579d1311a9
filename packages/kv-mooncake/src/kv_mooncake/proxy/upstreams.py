"""The prefill and decode instances behind the proxy: which are up, what load each carries.

An instance is taken out by a failed leg or health probe and back in by a served leg or a good
probe; every change is published as Prometheus gauges. Instances added at run time join on their
first good probe (or are dropped after ``join_timeout_s``); removed ones drain and leave the pool
when idle. Which instance serves a leg is :mod:`.balancer`'s (pure bookkeeping); the probes, the
pool changes and the metrics are here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping

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
        self._join_deadlines: dict[int, float] = {}  # id(instance) -> when a joining one is dropped
        for inst in self.instances():
            self._publish(inst)

    def instances(self) -> list[Instance]:
        return [*self.prefills.instances, *self.decodes.instances]

    def _publish(self, inst: Instance) -> None:
        if self._pool(inst).find(inst.url) is not inst:  # left the pool: its gauges are gone
            return
        self.metrics.healthy.labels(inst.role, inst.url).set(1 if inst.healthy else 0)
        self.metrics.outstanding.labels(inst.role, inst.url).set(inst.outstanding_tokens)

    def _unpublish(self, inst: Instance) -> None:
        for gauge in (self.metrics.healthy, self.metrics.outstanding):
            try:
                gauge.remove(inst.role, inst.url)
            except KeyError:
                pass

    def _pool(self, inst: Instance) -> InstancePool:
        return self.prefills if inst.role == "prefill" else self.decodes

    def pool(self, role: str) -> InstancePool:
        return self.prefills if role == "prefill" else self.decodes

    # ---- run-time changes (:mod:`.operations`)
    def add(self, role: str, url: str) -> tuple[Instance, str]:
        """Add ``url`` as a joining instance, or take a draining one back; (instance, what happened)."""
        pool = self.pool(role)
        inst = pool.find(url)
        if inst is not None:
            if inst.draining:
                inst.draining = False
                logger.info("%s %s taken back (was draining)", role, url)
                self._publish(inst)
                return inst, "taken back"
            return inst, "already present"
        inst = pool.add(url, joining=True)
        self._join_deadlines[id(inst)] = time.monotonic() + self.config.join_timeout_s
        logger.info("%s %s added, joins on its first good health check", role, url)
        self._publish(inst)
        return inst, "joining"

    def drain(self, inst: Instance) -> str:
        """No new legs for ``inst``; it leaves the pool once idle. Returns what happened."""
        if inst.joining:  # never served: leaves at once
            self._retire(inst)
            return "removed"
        inst.draining = True
        logger.info("%s %s draining (%d leg(s) in flight, %d hold(s))", inst.role, inst.url, inst.in_flight,
                    inst.holds)
        return "removed" if self._retire_if_drained(inst) else "draining"

    def _retire(self, inst: Instance) -> None:
        self._pool(inst).discard(inst)
        self._join_deadlines.pop(id(inst), None)
        self._unpublish(inst)
        self.metrics.instance_changes.labels(inst.role, "removed").inc()
        logger.info("%s %s left the pool", inst.role, inst.url)

    def _retire_if_drained(self, inst: Instance) -> bool:
        if inst.draining and inst.idle and self._pool(inst).find(inst.url) is inst:
            self._retire(inst)
            return True
        return False

    def hold(self, inst: Instance) -> None:
        """A prefill answered: its blocks wait for a decode (see :attr:`Instance.holds`)."""
        inst.holds += 1

    def unhold(self, inst: Instance) -> None:
        inst.holds = max(0, inst.holds - 1)
        self._retire_if_drained(inst)

    def urls(self, role: str) -> set[str]:
        """Every instance of ``role`` in the pool (joining and draining ones too)."""
        return {i.url for i in self.pool(role).instances}

    # ---- around every leg
    def take(self, role: str, tokens: int, exclude: Collection[str] = (),
             credit: Mapping[str, int] | None = None) -> Instance | None:
        """The instance of ``role`` for a leg (:meth:`InstancePool.pick`), acquired for ``tokens``
        in the same call; None when none is left. Give it back with ``release(instance, tokens)``."""
        pool = self.pool(role)
        inst = pool.pick(exclude=exclude, credit=credit)
        if inst is not None:
            pool.acquire(inst, tokens)
            self._publish(inst)
        return inst

    def release(self, inst: Instance, tokens: int) -> None:
        self._pool(inst).release(inst, tokens)
        if not self._retire_if_drained(inst):
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

    async def probe(self, client: httpx.AsyncClient, inst: Instance) -> bool:
        """One health check of ``inst`` (bounded by ``health_timeout_s``); True when it passed."""
        try:
            r = await client.get(f"{inst.url}/health", timeout=self.config.health_timeout_s)
            ok, reason = r.status_code == 200, f"health check answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"health check failed: {type(exc).__name__} {exc}"
        if self._pool(inst).find(inst.url) is not inst:  # removed while probed
            return ok
        if inst.joining:
            if ok:
                inst.joining = False
                self._join_deadlines.pop(id(inst), None)
                self._pool(inst).mark_up(inst)
                self.metrics.instance_changes.labels(inst.role, "added").inc()
                logger.info("%s %s joined (health check passed)", inst.role, inst.url)
            elif time.monotonic() > self._join_deadlines.get(id(inst), float("inf")):
                logger.warning("%s %s dropped: no good health check in %g s (%s)", inst.role, inst.url,
                               self.config.join_timeout_s, reason)
                self._retire(inst)
                return ok
            else:
                inst.last_error = reason
        elif ok:
            if self._pool(inst).mark_up(inst):
                logger.info("%s %s back in (health check)", inst.role, inst.url)
        elif self._pool(inst).mark_down(inst, reason):
            logger.warning("%s %s taken out (%s)", inst.role, inst.url, reason)
        self._publish(inst)
        return ok

    async def _probe(self, client: httpx.AsyncClient, inst: Instance) -> None:
        await self.probe(client, inst)

    def can_serve(self) -> bool:
        """A request can go through: a prefill (or the decode-only fallback) and a decode are up."""
        can_prefill = self.prefills.any_healthy() or self.config.fallback == "decode-only"
        return can_prefill and self.decodes.any_healthy()

    def states(self) -> dict[str, list[dict]]:
        """Every instance as ``/health`` shows it, by role."""
        return {pool.role: [{"url": i.url, "healthy": i.healthy, "state": _state(i),
                             "outstanding_tokens": i.outstanding_tokens, "in_flight": i.in_flight,
                             "holds": i.holds, "last_error": i.last_error} for i in pool.instances]
                for pool in (self.prefills, self.decodes)}


def _state(inst: Instance) -> str:
    return "joining" if inst.joining else "draining" if inst.draining else "serving"
