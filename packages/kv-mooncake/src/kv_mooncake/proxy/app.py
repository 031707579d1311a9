"""The proxy: an OpenAI-compatible front for disaggregated prefill (FastAPI + httpx).

One client request becomes two legs with the same ``X-Request-Id``:

1. prefill leg: the request with ``max_tokens=1``, not streamed, ``kv_transfer_params=
   {"do_remote_decode": true}`` on the prefill instance with the least outstanding tokens. A connect
   error, 5xx, timeout or an answer without ``kv_transfer_params`` takes that instance out and the
   leg is tried once on another prefill; then 503 (or, only with ``--fallback decode-only``, the
   decode prefills the request itself). A 4xx goes to the client as it is.
2. decode leg: the client's request plus the prefill's ``kv_transfer_params``, relayed as it
   arrives. A failure before the decode's first byte (connect error, 5xx, no first byte in time)
   is tried once on another decode with the same parameters: the prefill still holds the blocks.

Every leg has a deadline, and the whole request one more. When a request ends before any decode
produced a byte (client gone, decode 4xx, every decode failed) the prefill's blocks are freed at
once through its side channel (:mod:`kv_mooncake.proxy.release`) instead of at hold expiry; a
client leaving closes the running leg's connection, which makes vLLM abort that request.

Here: the FastAPI routes and each request raced against its client leaving. The legs are
:mod:`.relay`'s, the instances' health and load :mod:`.upstreams`'s, the bodies :mod:`.bodies`'s,
the run-time operations (``/instances/add``, ``/instances/remove``, ``/reset_prefix_cache``)
:mod:`.operations`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kv_mooncake.proxy.bodies import error_response, prefill_request_body
from kv_mooncake.proxy.config import ProxyConfig
from kv_mooncake.proxy.exchange import Exchange
from kv_mooncake.proxy.kv_events import KvEventsSubscriber
from kv_mooncake.proxy.metrics import ProxyMetrics
from kv_mooncake.proxy.operations import (
    OperationRefused,
    Operations,
    check_admin_key,
    parse_instance_change,
    parse_json_body,
    parse_reset_query,
)
from kv_mooncake.proxy.relay import Relay, RelayResponse
from kv_mooncake.proxy.upstreams import Upstreams

__all__ = ["Proxy", "build_app", "prefill_request_body"]

logger = logging.getLogger("kv_mooncake.proxy")

_FORWARDED_HEADERS = ("authorization",)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Proxy:
    """The proxy's routes over its upstream instances (``upstreams``) and the legs (``relay``)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.upstreams = Upstreams(config, self.metrics)
        self.relay = Relay(config, self.upstreams, self.metrics)
        self.operations = Operations(self.upstreams)
        self.kv_events = (KvEventsSubscriber(dict(config.kv_events), config.kv_events_max_blocks, self.metrics)
                          if config.kv_events else None)
        if self.kv_events is not None:
            self.relay.indexes = self.kv_events.indexes
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.relay.start()
        if self.kv_events is not None:
            await self.kv_events.start()
        self._health_task = asyncio.create_task(self.upstreams.health_loop(self.relay.client),
                                                name="kv-proxy-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.relay.stop()

    # ---- one client request
    async def serve(self, request: Request, path: str, endpoint: str) -> Response:
        """A client request, raced against its client leaving: a client gone cancels the legs."""
        t0 = time.monotonic()
        try:
            body = await request.json()
        except ValueError:
            return self._count(endpoint, error_response(400, "request body is not valid JSON", "invalid_request_error"))
        if not isinstance(body, dict):
            return self._count(endpoint, error_response(400, "request body must be a JSON object",
                                                        "invalid_request_error"))
        n = body.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024):
            return self._count(endpoint, error_response(400, f"n must be an integer from 1 to 1024 (got {n!r:.40})",
                                                        "invalid_request_error"))
        ex = Exchange(
            request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
            endpoint=endpoint,
            deadline=t0 + self.config.request_timeout_s,
            headers={h: v for h in _FORWARDED_HEADERS if (v := request.headers.get(h))},
        )
        work = asyncio.create_task(self.relay.handle(ex, path, body))
        gone = asyncio.create_task(_wait_for_disconnect(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            gone.cancel()
            response = work.result()
            if not isinstance(response, StreamingResponse):
                self.metrics.request_seconds.observe(time.monotonic() - t0)
            return self._count(endpoint, response)
        work.cancel()  # closes the running leg's connection: vLLM aborts that request
        with contextlib.suppress(asyncio.CancelledError):
            response = await work
            if isinstance(response, RelayResponse):  # finished just as the client left
                response.on_close()
        self.metrics.disconnects.inc()
        self.relay.release_if_unpulled(ex)
        logger.info("request %s: client disconnected, legs aborted", ex.request_id)
        return self._count(endpoint, Response(status_code=499))

    def _count(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    # ---- passthrough GETs
    async def models(self) -> Response:
        reasons = []
        instances = [*self.upstreams.decodes.instances, *self.upstreams.prefills.instances]
        for inst in sorted(instances, key=lambda i: not i.healthy):
            try:
                r = await self.relay.client.get(f"{inst.url}/v1/models", timeout=self.config.health_timeout_s)
            except httpx.HTTPError as exc:
                reasons.append(f"{inst.url}: {type(exc).__name__}")
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return error_response(503, "no instance answered /v1/models: " + "; ".join(reasons), "service_unavailable")

    # ---- operations
    async def operate(self, request: Request, what: str) -> Response:
        """POST /instances/add, /instances/remove, /reset_prefix_cache: checked at the edge, 4xx
        with an OpenAI error object when refused."""
        try:
            check_admin_key(self.config.admin_api_key, request.headers.get("x-api-key"))
            if what == "reset":
                query = parse_reset_query(dict(request.query_params))
                ok, report = await self.operations.reset_prefix_cache(query, self.relay.client,
                                                                      self.config.health_timeout_s)
                return JSONResponse(report, status_code=200 if ok else 502)
            change = parse_instance_change(parse_json_body(await request.body()))
            if what == "add":
                return JSONResponse(await self.operations.add(change, self.relay.client))
            return JSONResponse(self.operations.remove(change))
        except OperationRefused as exc:
            kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    409: "conflict_error"}.get(exc.status, "invalid_request_error")
            return error_response(exc.status, str(exc), kind)

    def health(self) -> JSONResponse:
        ok = self.upstreams.can_serve()
        body = {"status": "ok" if ok else "unavailable", **self.upstreams.states()}
        return JSONResponse(body, status_code=200 if ok else 503)


def build_app(config: ProxyConfig) -> FastAPI:
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(title="kv-mooncake-proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.serve(request, "/v1/completions", "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.serve(request, "/v1/chat/completions", "chat")

    @app.post("/instances/add")
    async def instances_add(request: Request) -> Response:
        return await proxy.operate(request, "add")

    @app.post("/instances/remove")
    async def instances_remove(request: Request) -> Response:
        return await proxy.operate(request, "remove")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        return await proxy.operate(request, "reset")

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
