"""UcmBackend over the real UCM Posix store (a tmp directory), on Python 3.12 with UCM installed.

* the shared ``BackendContract`` suite of kv-common;
* store level, in this connector's layout: the generic store worker (vLLM's CPU KV layout, one
  value per block = all layers + checksum trailer) saves through UCM in one process and another
  process's worker loads byte-exact into other blocks; the scheduler's lookup-only store sees the
  blocks; a missing block, a flipped byte and a truncated file become load errors, not exceptions.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))

pytest.importorskip("ucm", reason="UCM (uc-manager[cu130]) is Python 3.12 only")
torch = pytest.importorskip("torch", reason="UCM's Python store wrapper imports torch")

from kv_common.testing.backend_contract import BackendContract  # noqa: E402
from kv_store.config import StoreConnectorConfig  # noqa: E402
from kv_ucm.block_ids import ucm_key_id  # noqa: E402
from kv_ucm.ucm_backend import UcmBackend  # noqa: E402

try:  # the store core's metadata module subclasses vLLM's KVConnectorMetadata
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.scheduler import StoreScheduler
    from kv_store.worker import StoreWorker

    STORE_CORE_ERROR = None
except ImportError as exc:  # e.g. no vLLM in this environment
    STORE_CORE_ERROR = f"the store core does not import here: {exc}"

needs_store_core = pytest.mark.skipif(STORE_CORE_ERROR is not None, reason=str(STORE_CORE_ERROR))


def posix(root) -> dict:
    return {"ucm_connector_name": "UcmPipelineStore",
            "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": str(root),
                                     "posix_gc_enable": False}}


class TestUcmPosixContract(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path):
        with UcmBackend(posix(tmp_path)) as b:
            yield b


# -- store level, this connector's layout ---------------------------------------------------------

BS, HEADS, HEAD, LAYERS, NUM_BLOCKS = 16, 2, 32, 3, 12
NS, TAG = "ns-test", "hg0of1.pcp0of1.dcp0of1"


def chain(n: int, salt: bytes = b"") -> list[bytes]:
    out, parent = [], salt
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # vLLM's CPU layout per layer: [num_blocks, num_kv_heads, block_size, 2*head_size]
    return {f"layer{i}": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=g) for i in range(LAYERS)}


def make_worker(backend, kv):
    w = StoreWorker(backend=backend, namespace=NS, rank_tag=TAG, config=StoreConnectorConfig(staging_bytes=1 << 20))
    w.register_kv_caches(kv)
    backend.open(w.value_size)
    return w


def drain(worker, req_ids):
    deadline = time.monotonic() + 30
    done = set()
    while done != set(req_ids) and time.monotonic() < deadline:
        done |= worker.get_finished(set(req_ids))
        time.sleep(0.01)
    return done


SAVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_ucm_backend_posix import TAG, caches, chain, make_worker, drain, posix
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_ucm.ucm_backend import UcmBackend
    backend = UcmBackend(posix(sys.argv[1]))
    worker = make_worker(backend, caches(seed=5))
    hashes = chain(4)
    worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="r", block_hashes=hashes, block_ids=[[2, 3, 4, 5]])]))
    assert drain(worker, {"r"}) == {"r"}
    report = worker.take_report()
    print("RESULT stored", len(report.stored_by_tag.get(TAG, [])), worker.value_size)
    worker.close(10)
    backend.close()
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Another process saved blocks 2..5 of its caches (seed 5) as a 4-block request."""
    root = tmp_path_factory.mktemp("ucm-store-level")
    kv = root / "kv"
    kv.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", SAVER, str(kv), os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=180, cwd=str(root),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln.split()[1:] for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines and lines[0][0] == "stored", out.stdout[-2000:]
    assert int(lines[0][1]) == 4
    return kv, int(lines[0][2])


def block_file(root, key: str):
    name = ucm_key_id(key).hex()
    for dirpath, _dirs, files in os.walk(root):
        if name in files:
            return os.path.join(dirpath, name)
    raise AssertionError(f"no UCM file for {key}")


@needs_store_core
def test_other_process_saved_this_process_loads_byte_exact(saved, tmp_path):
    kv, value_size = saved
    hashes = chain(4)
    keys = [f"kv/{NS}/{TAG}/{h.hex()}" for h in hashes]
    # one UCM file per block, exactly one value (all layers + trailer)
    assert all(os.path.getsize(block_file(kv, k)) == value_size for k in keys)

    # the scheduler's lookup-only store sees them (4 blocks + 1 token: 64 tokens from UCM)
    sched_backend = UcmBackend(posix(kv), value_size=value_size, lookup_only=True)
    sched = StoreScheduler(backend=sched_backend, namespace=NS, rank_tags=[TAG], block_size=BS,
                           config=StoreConnectorConfig(), load_enabled=True, save_enabled=True)
    # 4 full blocks + 1 token (vLLM hashes full blocks only)
    req = SimpleNamespace(request_id="q", block_hashes=hashes, num_tokens=4 * BS + 1)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    sched.close()
    sched_backend.close()

    src = caches(seed=5)
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    backend = UcmBackend(posix(kv))
    worker = make_worker(backend, dst)
    assert worker.value_size == value_size
    worker.load_sync(StorePlan(loads=[BlockTransfer(request_id="q", block_hashes=hashes, block_ids=[[7, 8, 9, 10]])]))
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][7:11], src[name][2:6])
        assert not dst[name][:7].any() and not dst[name][11:].any()
    worker.close(10)
    backend.close()


@needs_store_core
def test_missing_flipped_and_truncated_blocks_are_load_errors(saved, tmp_path):
    import shutil

    kv = tmp_path / "kv"
    shutil.copytree(saved[0], kv)
    hashes = chain(4)
    keys = [f"kv/{NS}/{TAG}/{h.hex()}" for h in hashes]
    src = caches(seed=5)
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    backend = UcmBackend(posix(kv))
    worker = make_worker(backend, dst)

    def load(block_hashes, block_ids):
        worker.load_sync(StorePlan(loads=[BlockTransfer(request_id="q", block_hashes=block_hashes,
                                                        block_ids=[block_ids])]))
        return worker.ledger.take_block_ids_with_load_errors()

    # a block nobody stored: a miss for it and every later block of the request, no exception
    assert load([hashes[0], chain(1, b"never")[0], hashes[2]], [1, 2, 3]) == {2, 3}
    assert torch.equal(dst["layer0"][1], src["layer0"][2])

    # a flipped byte: UCM returns it as data, the store core's crc32 catches it
    path = block_file(kv, keys[1])
    with open(path, "r+b") as f:
        f.seek(1000)
        b = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([b ^ 0xFF]))
    assert load(hashes, [4, 5, 6, 7]) == {5, 6, 7}
    assert torch.equal(dst["layer2"][4], src["layer2"][2])

    # a truncated file: UCM fails that block's read
    os.truncate(block_file(kv, keys[0]), 100)
    assert load(hashes[:1], [8]) == {8}
    assert backend.counters["get_missed"] >= 1
    assert worker.stats.failures.get("corrupt") == 1 and worker.stats.failures.get("miss") == 2
    worker.close(10)
    backend.close()


@needs_store_core
def test_dump_failure_is_counted_not_raised(tmp_path):
    """A store directory that vanished under a running worker: saves fail, nothing raises."""
    import shutil

    kv = tmp_path / "kv"
    kv.mkdir()
    backend = UcmBackend(posix(kv))
    worker = make_worker(backend, caches(seed=1))
    shutil.rmtree(kv)
    worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="r", block_hashes=chain(2, b"x"), block_ids=[[0, 1]])]))
    assert drain(worker, {"r"}) == {"r"}
    assert backend.counters["put_failed"] == 2
    assert worker.stats.to_dict()  # recorded
    report = worker.take_report()
    assert report is None or not report.stored_by_tag
    worker.close(10)
    backend.close()


# -- the disk cap (issue 15 §3: on by default, least recently used first) -------------------------

CAP_VALUE = 64 << 10  # 64 KiB per block


def posix_bytes(root) -> int:
    """Bytes of UCM block files under ``root`` (UCM's own bookkeeping files start with a dot)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if not f.startswith("."))
    return total


def test_posix_store_is_capped_by_default(tmp_path):
    with UcmBackend(posix(tmp_path), value_size=CAP_VALUE) as b:
        assert b.disk_capacity_bytes and b.disk_capacity_bytes > 0  # on without any setting


def test_posix_store_stays_under_its_disk_cap(tmp_path):
    cap = 8 * CAP_VALUE
    with UcmBackend(posix(tmp_path), value_size=CAP_VALUE, disk_capacity_bytes=cap) as b:
        for i in range(32):
            assert b.batch_put([f"k{i}"], [bytes([i]) * CAP_VALUE]) == [True]
            assert posix_bytes(tmp_path) <= cap
        assert b.batch_exists(["k31", "k0"]) == [True, False]
        # an evicted block is a miss, never someone else's bytes
        buf = bytearray(CAP_VALUE)
        assert b.batch_get_into(["k0"], [memoryview(buf)]) == [-1]
        assert b.counters["disk_evictions"] >= 24


def test_posix_eviction_goes_by_last_access_not_write_time(tmp_path):
    cap = 8 * CAP_VALUE
    with UcmBackend(posix(tmp_path), value_size=CAP_VALUE, disk_capacity_bytes=cap) as b:
        for i in range(6):
            b.batch_put([f"k{i}"], [bytes([i]) * CAP_VALUE])
            time.sleep(0.01)
        buf = bytearray(CAP_VALUE)
        assert b.batch_get_into(["k0"], [memoryview(buf)]) == [CAP_VALUE]  # k0: used last
        time.sleep(0.01)
        for i in range(6, 12):
            b.batch_put([f"k{i}"], [bytes([i]) * CAP_VALUE])
            time.sleep(0.01)
        assert b.batch_exists(["k0", "k1", "k11"]) == [True, False, True]
        assert b.batch_get_into(["k0"], [memoryview(buf)]) == [CAP_VALUE] and buf == bytes([0]) * CAP_VALUE


def test_posix_cap_counts_blocks_already_in_the_directory(tmp_path):
    cap = 8 * CAP_VALUE
    with UcmBackend(posix(tmp_path), value_size=CAP_VALUE, disk_capacity_bytes=0) as b:  # 0: no cap
        for i in range(12):
            b.batch_put([f"old{i}"], [bytes([i]) * CAP_VALUE])
    assert posix_bytes(tmp_path) == 12 * CAP_VALUE
    with UcmBackend(posix(tmp_path), value_size=CAP_VALUE, disk_capacity_bytes=cap) as b:
        b.batch_put(["new"], [b"\1" * CAP_VALUE])
        assert posix_bytes(tmp_path) <= cap
        assert b.batch_exists(["new"]) == [True]
