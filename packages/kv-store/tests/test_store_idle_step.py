"""An idle vLLM step of a store connector waits for its saves and loads instead of spinning.

vLLM keeps stepping while a finished request's blocks wait for its saves (and while async loads
run): with nothing to compute, each step is empty and the engine spins through them. A save stuck
on a slow backend (up to ``save_timeout_s``, 30 s by default) kept a core busy doing nothing, as a
holding P2P prefill did (kv_common.idle_step). The store worker now waits in those steps, up to
``idle_step_wait_ms``, and a save or load that ends wakes it at once."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kv_common.config import ConnectorConfigError  # noqa: E402
from kv_store.config import parse_config  # noqa: E402
from kv_store.metadata import BlockTransfer, StorePlan  # noqa: E402
from kv_store.vllm_metadata import StoreConnectorMetadata  # noqa: E402
from test_store_hybrid_groups import attention, kv_config  # noqa: E402
from test_store_stall import BlockingBackend  # noqa: E402

WAIT_MS = 40.0


def worker_connector(backend, **extra):
    from types import SimpleNamespace

    from kv_common.testing.fake_vllm_config import fake_vllm_config
    from kv_common.vllm_compat import base_module
    from kv_store.connector_base import StoreConnectorBase

    class GatedStoreConnector(StoreConnectorBase):
        connector_name = "GatedStoreConnector"

        def make_backend(self, config, role):
            return backend

    config = fake_vllm_config(block_size=16)
    config.kv_transfer_config = SimpleNamespace(kv_connector_extra_config=extra, is_kv_consumer=True,
                                                is_kv_producer=True, kv_load_failure_policy="recompute")
    conn = GatedStoreConnector(config, base_module().KVConnectorRole.WORKER, kv_config(attention()))
    conn.register_kv_caches({"model.layers.0.attn": torch.randn((8, 4, 16, 64))})
    return conn


def step(conn, plan: StorePlan, finished: set[str]) -> tuple[set[str], float, float]:
    """One engine step as vLLM's model runner drives the connector: (requests reported finished
    sending, wall seconds, CPU seconds of this thread)."""
    t0, c0 = time.monotonic(), time.thread_time()
    conn.bind_connector_metadata(StoreConnectorMetadata(plan))
    conn.start_load_kv(None)
    conn.wait_for_save()
    sending, _ = conn.get_finished(finished)
    conn.clear_connector_metadata()
    return sending or set(), time.monotonic() - t0, time.thread_time() - c0


@pytest.fixture
def gated():
    backend = BlockingBackend(16 << 20)
    conn = worker_connector(backend, idle_step_wait_ms=WAIT_MS)
    yield conn, backend
    backend.release_all()
    conn.shutdown()


def _save_in_flight(conn, backend) -> None:
    backend.hold("put")
    save = BlockTransfer(request_id="s", block_hashes=[bytes(32)], block_ids=[[1]])
    done, _, _ = step(conn, StorePlan(saves=[save]), {"s"})  # vLLM finished "s": its blocks wait for the save
    assert done == set()


def test_idle_steps_with_a_save_in_flight_wait_instead_of_spinning(gated):
    conn, backend = gated
    _save_in_flight(conn, backend)
    wall = cpu = 0.0
    for _ in range(10):
        done, w, c = step(conn, StorePlan(idle=True), set())
        assert done == set()
        wall, cpu = wall + w, cpu + c
    # Before: 10 empty steps took ~1 ms, all of it CPU (the engine loop spun through them).
    assert wall >= 10 * WAIT_MS / 1000 * 0.8, wall
    assert cpu < 0.3 * wall, (cpu, wall)


def test_a_save_that_ends_during_an_idle_step_is_reported_in_that_step(gated):
    conn, backend = gated
    _save_in_flight(conn, backend)
    threading.Timer(0.01, backend.release, args=("put",)).start()
    deadline = time.monotonic() + 10
    done: set[str] = set()
    while not done:  # the step the save ends in reports it, without sleeping out its wait
        assert time.monotonic() < deadline
        done, wall, _ = step(conn, StorePlan(idle=True), set())
    assert done == {"s"}
    assert wall < WAIT_MS / 1000, wall


def test_a_step_with_tokens_never_waits_and_nothing_in_flight_never_waits(gated):
    conn, backend = gated
    _, wall, _ = step(conn, StorePlan(idle=True), set())  # idle, but no save or load in flight
    assert wall < WAIT_MS / 1000 / 2, wall
    _save_in_flight(conn, backend)
    _, wall, _ = step(conn, StorePlan(idle=False), set())  # a save in flight, but tokens to compute
    assert wall < WAIT_MS / 1000 / 2, wall


def test_the_scheduler_marks_a_step_without_tokens_idle():
    from types import SimpleNamespace

    from kv_store.connector_base import StoreConnectorBase

    class FakeScheduler:
        def build_plan(self, scheduler_output):
            return StorePlan()

    conn = StoreConnectorBase.__new__(StoreConnectorBase)
    conn._scheduler = FakeScheduler()
    assert conn.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0)).plan.idle
    assert not conn.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=7)).plan.idle


@pytest.mark.parametrize("wait_ms", [-1, 101])
def test_idle_step_wait_out_of_bounds_is_refused_naming_it(wait_ms):
    with pytest.raises(ConnectorConfigError, match="idle_step_wait_ms"):
        parse_config({"idle_step_wait_ms": wait_ms})
    assert parse_config({"idle_step_wait_ms": 0}).idle_step_wait_ms == 0
