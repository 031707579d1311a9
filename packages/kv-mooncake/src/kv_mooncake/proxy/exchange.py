"""One client request across its legs (``Exchange``, ``DecodeLeg``) and how a leg can end."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from kv_mooncake.proxy.balancer import Instance


class PassThrough(Exception):  # noqa: N818 - an outcome, not a failure of the proxy
    """An upstream answered 4xx: the client gets that answer as it is."""

    def __init__(self, status: int, content: bytes, content_type: str | None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.content, self.content_type = status, content, content_type


class Unavailable(Exception):  # noqa: N818
    """No instance of a role could serve the leg (after the retry)."""

    def __init__(self, role: str, reasons: list[str]) -> None:
        super().__init__(f"no {role} instance could serve the request: " + ("; ".join(reasons) or "none configured"))
        self.role = role


class DeadlineExceeded(Exception):  # noqa: N818
    pass


class LegFailed(Exception):  # noqa: N818
    """One attempt on one instance failed in a way another instance may not (retry-worthy)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass
class Exchange:
    """One client request across its legs."""

    request_id: str
    endpoint: str
    deadline: float
    headers: dict[str, str]
    params: dict | None = None  # the prefill's kv_transfer_params, once known
    first_byte: bool = False  # a decode produced a byte: it has the KV, nothing left to release
    released: bool = False
    prefill: Instance | None = None  # the prefill holding this request's blocks until a decode pulls them
    t0: float = field(default_factory=time.monotonic)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def budget(self, leg_timeout_s: float) -> float:
        left = self.remaining()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.request_id} passed its deadline")
        return min(leg_timeout_s, left)


@dataclass
class DecodeLeg:
    instance: Instance
    tokens: int
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes
    closed: bool = False

    @property
    def content_type(self) -> str | None:
        return self.response.headers.get("content-type")
