"""Settings of ``kv-mooncake-proxy`` and its command line (ours plus vllm-ascend's proxy flags)."""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

Fallback = Literal["none", "decode-only"]


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    fallback: Fallback = "none"
    # Deadlines (seconds). Generous defaults: shared machines stall a vCPU for 35-90 s now and then.
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0  # the whole prefill leg (max_tokens=1)
    first_byte_timeout_s: float = 300.0  # decode: until its first body byte (queue + pull + 1 step)
    idle_timeout_s: float = 120.0  # decode stream: longest silence between two chunks
    request_timeout_s: float = 1800.0  # a whole client request, both legs and all retries
    health_interval_s: float = 5.0  # probe period (healthy and taken-out instances alike)
    health_timeout_s: float = 10.0
    # Free the prefill's held blocks directly (MooncakeConnectorV1 side channel, FreeNow) when a
    # request ends before any decode produced a byte: client gone, decode 4xx, every decode failed.
    release_on_abort: bool = True
    release_timeout_s: float = 10.0
    default_max_tokens: int = 16  # load estimate for requests without max_tokens
    # An instance added at run time (/instances/add) that passes no health check in this long is dropped.
    join_timeout_s: float = 600.0
    # Conditional disaggregation: a prompt of fewer tokens than this (estimated, see
    # kv_mooncake.proxy.routing) runs on a decode alone. 0: off, every request is disaggregated.
    decode_only_below: int = 0
    # ... and a token-id prompt of which a decode holds at least this fraction (its KV events: a
    # --kv-events entry for the decode). 0: off.
    decode_only_cached: float = 0.0
    # Routing by KV events: (instance URL, its vLLM --kv-events-config ZMQ endpoint) pairs; a prefill
    # leg of a token-id prompt goes where the longest prefix is cached, load permitting.
    kv_events: tuple[tuple[str, str], ...] = ()
    kv_events_max_blocks: int = 200_000  # per instance
    log_level: str = "info"
    # POST /instances/add, /instances/remove and /reset_prefix_cache need the header X-Api-Key with
    # this value when set (vllm-ascend's proxy reads it from ADMIN_API_KEY too); open when None.
    admin_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_urls:
            raise ValueError("kv-mooncake-proxy needs at least one prefill instance (--prefill URL)")
        if not self.decode_urls:
            raise ValueError("kv-mooncake-proxy needs at least one decode instance (--decode URL)")
        for url in (*self.prefill_urls, *self.decode_urls):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ValueError(f"instance URL {url!r} must look like http://HOST:PORT")
        for name in ("connect_timeout_s", "prefill_timeout_s", "first_byte_timeout_s", "idle_timeout_s",
                     "request_timeout_s", "health_interval_s", "health_timeout_s", "release_timeout_s",
                     "join_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)!r})")
        if not 0 <= self.decode_only_below <= 1 << 24:
            raise ValueError(f"decode_only_below must be between 0 and {1 << 24} tokens (got {self.decode_only_below!r})")
        if not 0.0 <= self.decode_only_cached <= 1.0:
            raise ValueError(f"decode_only_cached must be a fraction from 0 to 1 (got {self.decode_only_cached!r})")
        for url, endpoint in self.kv_events:
            if not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) > 255:
                raise ValueError(f"KV events endpoint {endpoint!r} of {url} must be tcp://HOST:PORT or ipc://PATH")
        if len({url for url, _ in self.kv_events}) != len(self.kv_events):
            raise ValueError("one --kv-events endpoint per instance")
        if self.kv_events_max_blocks < 1:
            raise ValueError("kv_events_max_blocks must be >= 1")
        if self.fallback not in ("none", "decode-only"):
            raise ValueError(f"fallback must be 'none' or 'decode-only' (got {self.fallback!r})")


def _urls(hosts: Sequence[str] | None, ports: Sequence[int] | None, flag: str) -> list[str]:
    """vllm-ascend style ``--X-hosts a b --X-ports 1 2`` (one port per host) as URLs."""
    if not hosts and not ports:
        return []
    hosts, ports = list(hosts or []), list(ports or [])
    if len(hosts) != len(ports):
        raise ValueError(f"--{flag}-hosts has {len(hosts)} entries but --{flag}-ports has {len(ports)}: "
                         "give one port per host")
    return [f"http://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-mooncake-proxy",
        description="OpenAI-compatible proxy for disaggregated prefill: each request is prefilled on "
                    "one prefill instance (max_tokens=1) and generated on one decode instance, which "
                    "pulls the KV cache from the prefill.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill instance, http://HOST:PORT (repeat for several)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode instance, http://HOST:PORT (repeat for several)")
    ascend = p.add_argument_group("vllm-ascend proxy flags (drop-in)")
    ascend.add_argument("--prefiller-hosts", nargs="+", metavar="HOST")
    ascend.add_argument("--prefiller-ports", nargs="+", type=int, metavar="PORT")
    ascend.add_argument("--decoder-hosts", nargs="+", metavar="HOST")
    ascend.add_argument("--decoder-ports", nargs="+", type=int, metavar="PORT")
    p.add_argument("--fallback", choices=["none", "decode-only"], default="none",
                   help="when no prefill can serve a request: 'none' answers 503 (default), "
                        "'decode-only' lets the decode instance prefill it itself")
    d = ProxyConfig.__dataclass_fields__
    p.add_argument("--connect-timeout", type=float, default=d["connect_timeout_s"].default)
    p.add_argument("--prefill-timeout", type=float, default=d["prefill_timeout_s"].default,
                   help="deadline of the prefill leg, seconds")
    p.add_argument("--first-byte-timeout", type=float, default=d["first_byte_timeout_s"].default,
                   help="deadline for the decode's first byte, seconds")
    p.add_argument("--idle-timeout", type=float, default=d["idle_timeout_s"].default,
                   help="longest silence of a decode stream, seconds")
    p.add_argument("--request-timeout", type=float, default=d["request_timeout_s"].default,
                   help="deadline of a whole request, seconds")
    p.add_argument("--health-interval", type=float, default=d["health_interval_s"].default)
    p.add_argument("--health-timeout", type=float, default=d["health_timeout_s"].default)
    p.add_argument("--no-release-on-abort", action="store_true",
                   help="do not free a prefill's held blocks through its side channel when a request "
                        "ends before its decode started (they are then freed on expiry)")
    p.add_argument("--join-timeout", type=float, default=d["join_timeout_s"].default,
                   help="an instance added with POST /instances/add that passes no health check in this "
                        "many seconds is dropped")
    p.add_argument("--decode-only-below", type=int, default=d["decode_only_below"].default, metavar="TOKENS",
                   help="conditional disaggregation: a prompt shorter than TOKENS (token-id prompts "
                        "counted exactly, text estimated at 4 characters per token) runs on a decode "
                        "alone, without a prefill leg; 0 (default) disaggregates every request")
    p.add_argument("--decode-only-cached", type=float, default=d["decode_only_cached"].default,
                   metavar="FRACTION",
                   help="conditional disaggregation: a token-id prompt of which a decode holds at least "
                        "FRACTION already (from that decode's --kv-events) runs on that decode alone; "
                        "0 (default) turns the rule off")
    p.add_argument("--kv-events", action="append", default=[], metavar="URL=ENDPOINT",
                   help="route prefill legs by where the prompt's prefix is cached: the instance URL and "
                        "the ZMQ endpoint of its vLLM --kv-events-config publisher, e.g. "
                        "http://127.0.0.1:8100=tcp://127.0.0.1:5557 (repeat per instance)")
    p.add_argument("--kv-events-max-blocks", type=int, default=d["kv_events_max_blocks"].default,
                   help="bound of the prefix index kept per instance, in blocks")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def open_operations_warning(config: ProxyConfig) -> str | None:
    """What to warn about at start-up: the run-time operations (add / remove instances, reset every
    prefix cache) reachable beyond loopback without ``ADMIN_API_KEY``. None when nothing is open."""
    if config.admin_api_key is not None:
        return None
    try:
        if ipaddress.ip_address(config.host.strip("[]")).is_loopback:
            return None
    except ValueError:
        if config.host == "localhost":
            return None
    return (f"kv-mooncake-proxy listens on {config.host}, beyond loopback, and ADMIN_API_KEY is not set: anyone "
            "who reaches this port may add or remove instances and reset their prefix caches; set ADMIN_API_KEY "
            "(the operations then need the X-Api-Key header) or bind to a trusted network only")


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        prefill = [*a.prefill, *_urls(a.prefiller_hosts, a.prefiller_ports, "prefiller")]
        kv_events = []
        for item in a.kv_events:
            url, sep, endpoint = item.partition("=")
            if not sep:
                raise ValueError(f"--kv-events {item!r}: expected URL=ENDPOINT")
            kv_events.append((url.rstrip("/"), endpoint))
        decode = [*a.decode, *_urls(a.decoder_hosts, a.decoder_ports, "decoder")]
        return ProxyConfig(
            prefill_urls=tuple(u.rstrip("/") for u in prefill),
            decode_urls=tuple(u.rstrip("/") for u in decode),
            host=a.host, port=a.port, fallback=a.fallback,
            connect_timeout_s=a.connect_timeout, prefill_timeout_s=a.prefill_timeout,
            first_byte_timeout_s=a.first_byte_timeout, idle_timeout_s=a.idle_timeout,
            request_timeout_s=a.request_timeout, health_interval_s=a.health_interval,
            health_timeout_s=a.health_timeout, release_on_abort=not a.no_release_on_abort,
            admin_api_key=os.environ.get("ADMIN_API_KEY") or None, join_timeout_s=a.join_timeout,
            decode_only_below=a.decode_only_below, decode_only_cached=a.decode_only_cached, kv_events=tuple(kv_events),
            kv_events_max_blocks=a.kv_events_max_blocks, log_level=a.log_level,
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
