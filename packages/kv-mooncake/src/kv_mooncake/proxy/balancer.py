"""Which instance serves the next leg: least outstanding tokens, round-robin on ties.

Pure bookkeeping (no I/O, no clock): the proxy calls :meth:`InstancePool.acquire` / ``release``
around every leg and ``mark_down`` / ``mark_up`` on failures and health probes (each instance's
circuit breaker: out after one failure, back in after one success; no cool-down, the health loop
probes). Instances added at run time join on their first good health probe; removed ones drain (no
new legs) and leave the pool once nothing of theirs is in flight (:mod:`.operations`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kv_common.breaker import Breaker


def instance_breaker() -> Breaker:
    """Open after one failed leg or health probe, until a served leg or a good probe closes it."""
    return Breaker(threshold=1, cooldown=None)


@dataclass
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    outstanding_tokens: int = 0
    in_flight: int = 0
    last_error: str = ""
    # A prefill's answered requests whose blocks no decode has pulled yet (the decode's first byte
    # ends that): a draining prefill leaves only when this is 0 too.
    holds: int = 0
    joining: bool = False  # added at run time, waiting for its first good health probe
    draining: bool = False  # removed at run time: no new legs, leaves once idle
    breaker: Breaker = field(default_factory=instance_breaker, repr=False, compare=False)

    @property
    def healthy(self) -> bool:
        """Joined, and no failure since its last success."""
        return not self.joining and self.breaker.state == "closed"

    @property
    def in_rotation(self) -> bool:
        """May get new legs (when healthy, or when no instance of its role is)."""
        return not (self.joining or self.draining)

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.holds == 0


class InstancePool:
    def __init__(self, role: str, urls: Collection[str]) -> None:
        if not urls:
            raise ValueError(f"no {role} instance")
        self.role = role
        self.instances = [Instance(url=u, role=role) for u in urls]
        self._next = 0  # round-robin cursor: where the next tie-break starts

    def pick(self, exclude: Collection[str] = (), credit: Mapping[str, int] | None = None) -> Instance | None:
        """The healthy instance in rotation with the fewest outstanding tokens (ties: round-robin),
        or, when none is healthy, a taken-out one (a request still gets its try; the failure is
        fast). Joining and draining instances never get a leg. ``credit``: prompt tokens an
        instance has cached already (KV events), taken off its load: the holder of a prefix wins
        unless it carries that many more outstanding tokens than another."""
        n = len(self.instances)
        candidates = [(i, x) for i, x in enumerate(self.instances) if x.url not in exclude and x.in_rotation]
        pool = [c for c in candidates if c[1].healthy] or candidates
        if not pool:
            return None
        credit = credit or {}
        index, chosen = min(pool, key=lambda c: (c[1].outstanding_tokens - credit.get(c[1].url, 0),
                                                 (c[0] - self._next) % n))
        self._next = (index + 1) % n
        return chosen

    def acquire(self, instance: Instance, tokens: int) -> None:
        instance.outstanding_tokens += tokens
        instance.in_flight += 1

    def release(self, instance: Instance, tokens: int) -> None:
        instance.outstanding_tokens = max(0, instance.outstanding_tokens - tokens)
        instance.in_flight = max(0, instance.in_flight - 1)

    def mark_down(self, instance: Instance, reason: str) -> bool:
        """Take an instance out; True when it was healthy until now."""
        was = instance.healthy
        instance.breaker.failure()
        instance.last_error = reason
        return was

    def mark_up(self, instance: Instance) -> bool:
        """Probe succeeded: back in; True when it was out until now."""
        was = instance.healthy
        instance.breaker.success()
        instance.last_error = ""
        return not was

    def any_healthy(self) -> bool:
        return any(x.healthy and x.in_rotation for x in self.instances)

    def find(self, url: str) -> Instance | None:
        return next((x for x in self.instances if x.url == url), None)

    def add(self, url: str, joining: bool = True) -> Instance:
        """A new instance (out of rotation until its first good probe when ``joining``)."""
        if self.find(url) is not None:
            raise ValueError(f"{self.role} {url} is in the pool already")
        inst = Instance(url=url, role=self.role, joining=joining)
        self.instances.append(inst)
        return inst

    def discard(self, inst: Instance) -> None:
        """Out of the pool for good (a drained or abandoned instance)."""
        with_index = [i for i, x in enumerate(self.instances) if x is inst]
        if not with_index:
            return
        del self.instances[with_index[0]]
        if self.instances:
            self._next %= len(self.instances)
        else:
            self._next = 0


def estimate_prompt_tokens(body: dict) -> int:
    """Rough prompt size for load balancing (no tokenizer in the proxy): token-id prompts count
    exactly, text counts ~4 characters per token."""
    def size(x: object) -> int:
        if isinstance(x, str):
            return len(x) // 4 + 1
        if isinstance(x, list):
            if x and all(isinstance(t, int) for t in x):
                return len(x)
            return sum(size(y) for y in x)
        if isinstance(x, dict):
            return sum(size(v) for k, v in x.items() if k in ("content", "text"))
        return 0

    if "messages" in body:
        return max(1, size(body.get("messages")))
    return max(1, size(body.get("prompt", "")))


def requested_max_tokens(body: dict, default: int) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return default
