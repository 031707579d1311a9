"""Across hosts: what a MooncakeConnectorV1 instance tells its peers, what it listens on, and how fast
a decode gives up on an address where nothing can answer."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from types import SimpleNamespace

import pytest
from kv_common.testing.ports import free_port
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.group_blocks import GroupBlocks
from kv_mooncake.params import RemoteSource
from kv_mooncake.scheduler import MooncakeScheduler
from kv_mooncake.step import MooncakeStep, PullRequest

# 127.0.0.2 is this machine's (all of 127/8 is loopback on Linux) but never the old default.
OTHER_LOCAL = "127.0.0.2"


def _advertised_host(config: MooncakeConfig) -> str:
    prefill = MooncakeScheduler(config, engine_id="P", block_size=16, is_producer=True, is_consumer=False,
                                side_channel_port=17000)
    request = SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True},
                              prompt_token_ids=list(range(20)), status=SimpleNamespace(name="FINISHED_STOPPED"))
    held, params = prefill.request_finished(request, [[1, 2]])
    assert held and params
    return params["remote_host"]


def test_the_prefill_advertises_this_machines_address_as_vllm_finds_it(monkeypatch):
    network_utils = pytest.importorskip("vllm.utils.network_utils")
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    assert _advertised_host(MooncakeConfig()) == network_utils.get_ip()
    monkeypatch.setenv("VLLM_HOST_IP", "10.9.8.7")
    assert _advertised_host(MooncakeConfig()) == "10.9.8.7"


def test_an_explicit_side_channel_host_wins(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.9.8.7")
    assert _advertised_host(MooncakeConfig(side_channel_host="10.0.0.1")) == "10.0.0.1"


def test_addresses_of_each_listener():
    config = MooncakeConfig(side_channel_host="10.0.0.1")
    assert (config.advertised_host(), config.bind_host(), config.transfer_engine_host()) == ("10.0.0.1",) * 3
    config = MooncakeConfig(side_channel_host="10.0.0.1", side_channel_bind_host="0.0.0.0", te_host="10.0.0.2")
    assert (config.advertised_host(), config.bind_host(), config.transfer_engine_host()) == \
        ("10.0.0.1", "0.0.0.0", "10.0.0.2")


def test_the_worker_listens_on_and_advertises_the_default_address(monkeypatch):
    pytest.importorskip("mooncake.engine")
    np = pytest.importorskip("numpy")
    from kv_common.kv_byte_settings import KVByteSettings
    from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext, query_leaks

    monkeypatch.setenv("VLLM_HOST_IP", OTHER_LOCAL)
    layer = np.zeros(4 * 1024, dtype=np.uint8)
    worker = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="P", is_producer=True, is_consumer=False,
                                                          side_channel_port=free_port(OTHER_LOCAL),
                                                          kv_byte_settings=KVByteSettings(model="m")))
    try:
        worker.register_cache(LocalCache(["l0"], [layer.ctypes.data], [1024], 4, 1),
                              {"block_size": 16, "head_size": 8, "num_layers": 1}, "float32")
        assert worker.te.rpc_address.startswith(f"{OTHER_LOCAL}:")
        assert worker.server is not None
        assert worker.server.address == f"{OTHER_LOCAL}:{worker.context.side_channel_port}"
        assert query_leaks(worker.server.address)["held_blocks"] == 0
    finally:
        worker.close()


def test_an_address_that_cannot_be_bound_names_the_settings(monkeypatch):
    from conftest import FakeTransferEngine
    from kv_mooncake.errors import SideChannelError
    from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

    monkeypatch.setenv("VLLM_HOST_IP", "192.0.2.213")  # TEST-NET-1: not this machine's
    worker = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="P", is_producer=True, is_consumer=False,
                                                          side_channel_port=free_port()),
                            engine_factory=FakeTransferEngine)
    try:
        with pytest.raises(SideChannelError, match="side_channel_bind_host.*VLLM_HOST_IP.*'192.0.2.213'"):
            worker.register_cache(LocalCache(["l0"], [0], [1024], 4, 1),
                                  {"block_size": 16, "head_size": 8, "num_layers": 1}, "float32")
    finally:
        worker.close()


def test_an_unspecified_address_is_a_warning_at_start(monkeypatch, caplog):
    from conftest import FakeTransferEngine
    from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

    monkeypatch.setenv("VLLM_HOST_IP", "0.0.0.0")  # what vLLM's helper answers when it finds no route
    worker = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="P", is_producer=True, is_consumer=False,
                                                          side_channel_port=free_port()),
                            engine_factory=FakeTransferEngine)
    try:
        with caplog.at_level(logging.WARNING):
            worker.register_cache(LocalCache(["l0"], [0], [1024], 4, 1),
                                  {"block_size": 16, "head_size": 8, "num_layers": 1}, "float32")
        assert any("peers are told 0.0.0.0, which no peer can connect to" in r.getMessage() for r in caplog.records)
    finally:
        worker.close()


def test_doctor_prints_the_advertised_addresses(monkeypatch):
    from kv_common import doctor

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    config = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": free_port()}
    report = doctor.run(json.dumps(config))
    lines = [c for c in report.checks if "peers are told" in c.detail]
    assert [c.status for c in lines] == [doctor.WARN, doctor.WARN], lines
    assert any("side channel" in c.detail and "127.0.0.1" in c.detail and "side_channel_host" in c.detail
               for c in lines)
    assert any("TransferEngine" in c.detail and "te_host" in c.detail for c in lines)


def test_a_pull_to_an_address_where_nothing_listens_fails_at_once(caplog):
    pytest.importorskip("mooncake.engine")
    np = pytest.importorskip("numpy")
    from kv_common.kv_byte_settings import KVByteSettings
    from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

    config = MooncakeConfig(side_channel_host="127.0.0.1", pull_timeout_s=30.0)
    layer = np.zeros(8 * 1024, dtype=np.uint8)
    decode = MooncakeWorker(config, RankContext(engine_id="D", is_producer=False, is_consumer=True,
                                                side_channel_port=1, kv_byte_settings=KVByteSettings(model="m")))
    closed = free_port()  # nothing listens there
    try:
        decode.register_cache(LocalCache(["l0"], [layer.ctypes.data], [1024], 8, 1),
                              {"block_size": 16, "head_size": 8, "num_layers": 1}, "float32")
        source = RemoteSource(engine_id="P", host="127.0.0.1", port=closed, request_id="r", block_ids_by_group=[[0, 1]])
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            decode.start_step(MooncakeStep(pulls=[PullRequest(request_id="r", source=source,
                                                              local_block_ids=[[3, 4]],
                                                              blocks_by_group=[GroupBlocks(0, 2)])]))
            while "r" not in (decode.get_finished()[1] or ()) and time.monotonic() - t0 < 35:
                time.sleep(0.005)
        took = time.monotonic() - t0
        assert took < 1.0, f"a pull to a closed port took {took:.2f}s (pull_timeout_s 30)"
        assert decode.ledger.take_block_ids_with_load_errors() == {3, 4}
        failed = [r.getMessage() for r in caplog.records if "failed after" in r.getMessage()]
        assert failed and f"127.0.0.1:{closed}" in failed[0] and "refused" in failed[0], failed
    finally:
        decode.close()


def test_the_probe_names_a_refusal_and_keeps_its_verdict_briefly():
    from kv_mooncake.pull.peers import ReachabilityProbe

    now = [0.0]
    probe = ReachabilityProbe(timeout_s=0.5, ttl_s=2.0, clock=lambda: now[0])
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        assert probe.unreachable(address) is None
    assert probe.unreachable(address) is None  # closed since, but the verdict is a second old
    now[0] = 2.5
    assert "refused" in (probe.unreachable(address) or "")
    assert "does not resolve" in (probe.unreachable("no-such-host.invalid:1") or "")


def test_the_probe_reads_an_address_as_the_side_channel_does():
    """One reading of 'host:port' (``wire.split_address``): what the side channel would
    connect to is what the probe tries, and what it refuses the probe names as not HOST:PORT."""
    from kv_mooncake.pull.peers import ReachabilityProbe

    probe = ReachabilityProbe(timeout_s=0.5)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert probe.unreachable(f"tcp://127.0.0.1:{port}") is None
        assert probe.unreachable(f"[127.0.0.1]:{port}") is None
        assert "not HOST:PORT" in (probe.unreachable(f":{port}") or "")
        assert "not HOST:PORT" in (probe.unreachable("127.0.0.1:x") or "")


def test_a_slow_address_is_not_a_verdict():
    """A connect that times out (a loaded or far peer) leaves the pull to its own deadline."""
    from kv_mooncake.pull.peers import ReachabilityProbe

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        backlog = []  # a full accept queue: the kernel drops further SYNs, so a connect hangs
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(listener.getsockname())
            backlog.append(s)
        time.sleep(0.1)
        t0 = time.monotonic()
        assert ReachabilityProbe(timeout_s=0.3).unreachable(f"127.0.0.1:{listener.getsockname()[1]}") is None
        assert time.monotonic() - t0 < 2.0
        for s in backlog:
            s.close()
