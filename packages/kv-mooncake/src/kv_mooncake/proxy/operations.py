"""Run-time operations: add and remove instances, reset every instance's prefix cache.

The bodies are vllm-ascend's proxy's: ``{"type": "prefill" | "decode", "instances": ["host:port", ...]}``
(``"instances"`` may be one string; its elastic proxy's ``"instance": "host:port"`` is taken too).
They are parsed here, at the edge, into an :class:`InstanceChange` (a role and bounded, normalised
URLs) or refused with an :class:`OperationRefused` carrying the HTTP status; nothing else reaches
the pool. An added instance joins on its first good health check; a removed one drains: no new legs,
in-flight ones finish (a prefill also waits for its held blocks to be pulled), then it leaves.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import httpx

from kv_mooncake.proxy.upstreams import Upstreams

Role = Literal["prefill", "decode"]

MAX_BODY_BYTES = 64 << 10
MAX_INSTANCES = 64  # per call
MAX_ADDRESS_CHARS = 255
MAX_ANSWER_CHARS = 2000  # of an instance's answer, in the reset report
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*$"
                   r"|^\[[0-9A-Fa-f:.]+\]$")
RESET_QUERY_FLAGS = ("reset_running_requests", "reset_external")  # what vLLM's /reset_prefix_cache takes


class OperationRefused(Exception):  # noqa: N818 - an answer to the operator, not a proxy failure
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class InstanceChange:
    role: Role
    urls: tuple[str, ...]


def instance_url(address: object) -> str:
    """``host:port`` or ``http(s)://host:port`` as the proxy's URL form, or OperationRefused(400)."""
    if not isinstance(address, str) or not address or len(address) > MAX_ADDRESS_CHARS:
        raise OperationRefused(400, f"an instance must be a 'host:port' string of at most {MAX_ADDRESS_CHARS} "
                                    f"characters (got {_show(address)})")
    text = address if "://" in address else f"http://{address}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise OperationRefused(400, f"instance {_show(address)} is not host:port") from None
    host = parts.netloc.rsplit(":", 1)[0] if parts.netloc else ""
    if (parts.scheme not in ("http", "https") or port is None or not 0 < port < 65536 or not _HOST.match(host)
            or parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc):
        raise OperationRefused(400, f"instance {_show(address)} must look like host:port (port 1-65535)")
    return f"{parts.scheme}://{host}:{port}"


def parse_instance_change(body: object) -> InstanceChange:
    """A /instances/add or /instances/remove body, checked and bounded (OperationRefused otherwise)."""
    if not isinstance(body, dict):
        raise OperationRefused(400, "the body must be a JSON object like "
                                    '{"type": "prefill", "instances": ["host:port"]}')
    role = body.get("type")
    if role not in ("prefill", "decode"):
        raise OperationRefused(400, f"'type' must be 'prefill' or 'decode' (got {_show(role)})")
    unknown = sorted(set(body) - {"type", "instances", "instance"})
    if unknown:
        raise OperationRefused(400, f"unknown field(s) {unknown}: expected 'type' and 'instances'")
    raw: object = body.get("instances", body.get("instance"))
    if "instances" in body and "instance" in body:
        raise OperationRefused(400, "give 'instances' or 'instance', not both")
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise OperationRefused(400, "'instances' must be a non-empty list of 'host:port' strings")
    if len(raw) > MAX_INSTANCES:
        raise OperationRefused(400, f"at most {MAX_INSTANCES} instances per call (got {len(raw)})")
    urls = tuple(dict.fromkeys(instance_url(a) for a in raw))  # duplicates once, order kept
    return InstanceChange(role, urls)


def parse_json_body(raw: bytes) -> object:
    if len(raw) > MAX_BODY_BYTES:
        raise OperationRefused(413, f"body over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise OperationRefused(400, "the body is not valid JSON") from None


def parse_reset_query(params: dict[str, str]) -> dict[str, str]:
    """The query of /reset_prefix_cache, passed on to every instance: vLLM's two flags, as booleans."""
    unknown = sorted(set(params) - set(RESET_QUERY_FLAGS))
    if unknown:
        raise OperationRefused(400, f"unknown query parameter(s) {unknown}: expected {list(RESET_QUERY_FLAGS)}")
    out = {}
    for key, value in params.items():
        if value.lower() not in ("true", "false"):
            raise OperationRefused(400, f"{key} must be true or false (got {_show(value)})")
        out[key] = value.lower()
    return out


def check_admin_key(expected: str | None, given: str | None) -> None:
    if expected is None:
        return
    if not given:
        raise OperationRefused(401, "this operation needs the X-Api-Key header (ADMIN_API_KEY)")
    if not hmac.compare_digest(expected.encode(), given.encode()):
        raise OperationRefused(403, "X-Api-Key does not match ADMIN_API_KEY")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _address(url: str) -> str:
    return url.split("://", 1)[1]


class Operations:
    """The pool changes and the fan-out, over the proxy's upstreams and HTTP client."""

    def __init__(self, upstreams: Upstreams) -> None:
        self.upstreams = upstreams

    def _current(self) -> dict[str, list[str]]:
        """vllm-ascend's answer fields: the instances in rotation, as host:port."""
        return {f"current_{role}_instances": [_address(i.url) for i in self.upstreams.pool(role).instances
                                              if i.in_rotation]
                for role in ("prefill", "decode")}

    async def add(self, change: InstanceChange, client: httpx.AsyncClient) -> dict:
        added = [(url, *self.upstreams.add(change.role, url)) for url in change.urls]
        # One probe of each new instance now, all at once (each bounded by health_timeout_s); the
        # health loop probes the ones that fail until they pass or --join-timeout drops them.
        await asyncio.gather(*(self.upstreams.probe(client, inst) for _, inst, what in added if what == "joining"))
        results = []
        for url, inst, what in added:
            if what == "joining":
                what = "waiting for a good health check" if inst.joining else "added"
                if self.upstreams.pool(change.role).find(url) is not inst:
                    what = "dropped"
            results.append({"instance": _address(url), "result": what})
        message = f"add {change.role} instances: " + ", ".join(f"{r['instance']} {r['result']}" for r in results)
        return {"message": message, "results": results, **self._current()}

    def remove(self, change: InstanceChange) -> dict:
        pool = self.upstreams.pool(change.role)
        missing = [_address(u) for u in change.urls if pool.find(u) is None]
        if missing:
            raise OperationRefused(404, f"not {change.role} instances of this proxy: {missing}")
        serving_after = [i for i in pool.instances if i.in_rotation and i.url not in change.urls]
        if not serving_after:
            raise OperationRefused(409, f"removing {[_address(u) for u in change.urls]} would leave no {change.role} "
                                        "instance in rotation: add another first")
        results = []
        for url in change.urls:
            inst = pool.find(url)
            assert inst is not None
            in_flight, holds = inst.in_flight, inst.holds
            what = self.upstreams.drain(inst)
            result: dict = {"instance": _address(url), "result": what}
            if what == "draining":
                result.update(in_flight=in_flight, holds=holds)
            results.append(result)
        message = f"remove {change.role} instances: " + ", ".join(f"{r['instance']} {r['result']}" for r in results)
        return {"message": message, "results": results, **self._current()}

    async def reset_prefix_cache(self, query: dict[str, str], client: httpx.AsyncClient,
                                 timeout_s: float) -> tuple[bool, dict]:
        """POST /reset_prefix_cache to every instance in the pool at once; (all succeeded, report)."""
        instances = [i for i in self.upstreams.instances() if not i.joining]

        async def one(inst) -> dict:
            entry: dict = {"role": inst.role, "instance": _address(inst.url)}
            try:
                r = await asyncio.wait_for(client.post(f"{inst.url}/reset_prefix_cache", params=query),
                                           timeout_s)
            except (httpx.HTTPError, asyncio.TimeoutError, TimeoutError) as exc:
                return {**entry, "ok": False, "status": None, "error": f"{type(exc).__name__} {exc}"[:MAX_ANSWER_CHARS]}
            try:
                answer: object = r.json()
            except ValueError:
                answer = r.text[:MAX_ANSWER_CHARS]
            # vLLM answers {"success": false} while blocks are held (running requests): not a reset.
            ok = r.status_code == 200 and not (isinstance(answer, dict) and answer.get("success") is False)
            return {**entry, "ok": ok, "status": r.status_code, "answer": answer}

        report = list(await asyncio.gather(*(one(i) for i in instances)))
        return all(e["ok"] for e in report), {"instances": report}
