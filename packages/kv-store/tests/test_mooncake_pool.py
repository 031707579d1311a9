"""Which Mooncake deployment keeps the pool when instances come and go (real mooncake_master and
Mooncake's standalone ``mooncake_client``; instances are MooncakeBackends built from the connector's
own config, opened and closed one after another as vLLM instances restart)."""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("mooncake.store")

from kv_common.config import ConnectorConfigError  # noqa: E402
from kv_store.backends import make_mooncake_backend  # noqa: E402
from kv_store.config import parse_config, resolve_mooncake  # noqa: E402
from kv_store.testing import MooncakeClient  # noqa: E402

VALUE = 64 << 10
KEYS = [f"pool-{i}" for i in range(24)]


def instance(master_address: str, **mooncake):
    """A vLLM worker's backend as the connector builds it (role None: a worker, not the scheduler)."""
    config = parse_config({"backend": "mooncake", "mooncake": {
        "master_server_address": master_address, "local_buffer_size": "16mb", "setup_retries": 1, **mooncake}})
    return make_mooncake_backend(config)


def store_all(backend) -> bytearray:
    """Zero-copy puts from a registered buffer, as the connector's worker does."""
    src = bytearray(VALUE * len(KEYS))
    for i in range(len(KEYS)):
        src[i * VALUE : (i + 1) * VALUE] = bytes([i + 1]) * VALUE
    view = memoryview(src)
    backend.register_buffer(view)
    assert backend.batch_put(KEYS, [view[i * VALUE : (i + 1) * VALUE] for i in range(len(KEYS))]) == [True] * len(KEYS)
    return src


def read_all(backend) -> tuple[list[int], bytearray]:
    dst = bytearray(VALUE * len(KEYS))
    view = memoryview(dst)
    backend.register_buffer(view)
    codes = backend.batch_get_into(KEYS, [view[i * VALUE : (i + 1) * VALUE] for i in range(len(KEYS))])
    return codes, dst


def test_instance_segments_leave_with_their_instance(mooncake_master):
    """The default: each instance holds what it stored; it exits and a fresh one finds nothing."""
    a = instance(mooncake_master.address, global_segment_size="64mb")
    store_all(a)
    a.close()
    b = instance(mooncake_master.address, mount_segment=False)
    try:
        assert b.batch_exists(KEYS) == [False] * len(KEYS)
        codes, _ = read_all(b)
        assert codes == [-1] * len(KEYS)
    finally:
        b.close()


def test_standalone_client_pool_outlives_instances(mooncake_master):
    """A standalone mooncake_client holds the memory, instances mount none: A stores and exits,
    a fresh B reads every value back byte for byte; then B exits and a fresh C still does."""
    with MooncakeClient(mooncake_master.address, segment="64MB"):
        a = instance(mooncake_master.address, mount_segment=False)
        src = store_all(a)
        a.close()
        for _ in range(2):  # B, then C
            b = instance(mooncake_master.address, mount_segment=False)
            try:
                assert b.batch_exists(KEYS) == [True] * len(KEYS)
                codes, dst = read_all(b)
                assert codes == [VALUE] * len(KEYS)
                assert dst == src
            finally:
                b.close()


def test_standalone_client_dies_reads_are_misses(mooncake_master, caplog):
    """The pool's holder crashes: a fresh instance gets misses and failed puts, never an error or a
    hang; once a new holder runs, the pool works again (empty)."""
    from kv_store import mooncake_backend

    # vLLM's logging config (once vllm is imported) stops "vllm.*" at its own handler: listen there.
    mooncake_backend.logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger=mooncake_backend.logger.name)
    holder = MooncakeClient(mooncake_master.address, segment="64MB").__enter__()
    try:
        a = instance(mooncake_master.address, mount_segment=False)
        store_all(a)
        a.close()
        holder.kill()
        b = instance(mooncake_master.address, mount_segment=False)
        try:
            t0 = time.monotonic()
            codes, _ = read_all(b)  # the master may still list the keys (client_ttl): reads fail
            assert codes == [-1] * len(KEYS)
            assert b.batch_put(["after-crash"], [memoryview(bytearray(VALUE))]) == [False]
            assert time.monotonic() - t0 < 60
            # -800 while the master still lists the dead client's keys, -200 once it expired them
            assert any("holding the value is gone" in r.message or "no mounted segment has room" in r.message
                       for r in caplog.records), [r.message for r in caplog.records]
        finally:
            b.close()
    finally:
        holder.__exit__()
        mooncake_backend.logger.removeHandler(caplog.handler)
    with MooncakeClient(mooncake_master.address, segment="64MB"):
        c = instance(mooncake_master.address, mount_segment=False)
        try:
            codes, _ = read_all(c)
            assert codes == [-1] * len(KEYS)
            store_all(c)
            assert c.batch_exists(KEYS) == [True] * len(KEYS)
        finally:
            c.close()


def test_mount_segment_false_mounts_nothing_even_with_a_shared_mooncake_json(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text('{"master_server_address": "10.0.0.5:50051", "global_segment_size": "16GB"}')
    resolved = resolve_mooncake(parse_config({"backend": "mooncake", "mooncake": {
        "config_path": str(path), "mount_segment": "false"}}).mooncake)
    assert resolved["global_segment_size"] == 0
    assert resolve_mooncake(parse_config({"backend": "mooncake", "mooncake": {
        "config_path": str(path)}}).mooncake)["global_segment_size"] == 16 << 30


def test_mount_segment_false_contradicting_an_inline_segment_is_refused():
    with pytest.raises(ConnectorConfigError, match="mount_segment.*global_segment_size.*64mb"):
        parse_config({"backend": "mooncake", "mooncake": {
            "master_server_address": "127.0.0.1:1", "mount_segment": False, "global_segment_size": "64mb"}})
    # an explicit zero agrees
    parse_config({"backend": "mooncake", "mooncake": {
        "master_server_address": "127.0.0.1:1", "mount_segment": False, "global_segment_size": 0}})


def test_client_helper_without_master_fails_within_its_deadline_and_leaves_nothing():
    from kv_common.testing.ports import free_port

    client = MooncakeClient(f"127.0.0.1:{free_port()}", segment="16MB", start_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="mooncake_client"):
        client.__enter__()  # it gives up after a few setup retries (or the deadline kills it)
    assert time.monotonic() - t0 < 90
    assert client.proc is not None and client.proc.poll() is not None  # stopped, not left behind
    assert not client.alive
