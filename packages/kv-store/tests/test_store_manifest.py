"""The namespace manifest: the first writer stores its layout, every other worker checks it.

The bug (issue 14 §2): two workers of different layout sharing one namespace (a pinned one, or a
layout the derived digest does not cover) find each other's blocks. With equal value sizes the
other layout's KV loads and passes the checksum (silently wrong); with different sizes every hit
fails its size check and is recomputed, request after request.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

torch = pytest.importorskip("torch")

from kv_common.backend import Backend, BackendError
from kv_common.embedded_backend import EmbeddedBackend
from kv_store import keys
from kv_store import manifest as mf
from kv_store.config import StoreConnectorConfig
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.worker import StoreWorker

KEY = keys.manifest_key("shared", "hg0of1.pcp0of1.dcp0of1")
SIZE = 4096


def settings(**over):
    base = {"model_name": "tiny", "revision": "", "dtype": "torch.float32", "cache_dtype": "float32",
            "quantization": "", "block_size": 16, "kernel_block_size": "16", "use_mla": False,
            "tp_size": 1, "pp_size": 1, "kv_layout.group0": "2 x float32[4, 16, 64]",
            "layers": "2: l0 .. l1", "value_size": SIZE, "store_format": mf.FORMAT_VERSION, "writer": "a"}
    base.update(over)
    return mf.make_manifest(base)


# ---- encode / decode -----------------------------------------------------------------------------

def test_roundtrip_padded_to_the_value_size():
    m = settings()
    raw = mf.encode(m, SIZE)
    assert len(raw) == SIZE
    assert mf.decode(raw) == m
    assert mf.decode(mf.encode(m)) == m  # unpadded too
    assert all(isinstance(v, str) for v in m.settings.values())  # compared by name and text


def test_comparison_names_each_differing_setting_with_both_values():
    diffs = mf.differences(settings(), settings(block_size=32, cache_dtype="bfloat16", writer="b"))
    assert diffs == [("block_size", "16", "32"), ("cache_dtype", "float32", "bfloat16")]  # writer: info only
    text = mf.mismatch_message("ns 'shared'", diffs, "host pid 1")
    assert "block_size: stored '16', this engine '32'" in text
    assert "cache_dtype: stored 'float32', this engine 'bfloat16'" in text
    assert "\n" not in text  # one message, one line
    assert mf.differences(settings(), mf.make_manifest({**settings().settings, "extra": "x"})) == [
        ("extra", "(absent)", "x")]


@pytest.mark.parametrize("raw, why", [
    (b"", "shorter"),
    (b"XXXX" + bytes(64), "magic"),
    (mf._HEADER.pack(mf.MAGIC, 99, 0, 2) + b"{}", "format 99"),
    (mf._HEADER.pack(mf.MAGIC, 1, 0, 1 << 30) + b"{}", "length"),
    (mf._HEADER.pack(mf.MAGIC, 1, 0, 5) + b"{nope", "unreadable"),
    (mf._HEADER.pack(mf.MAGIC, 1, 0, 13) + b'{"format": 1}', "unreadable"),  # no settings
])
def test_corrupt_values_are_refused_without_parsing_beyond_the_bounds(raw, why):
    with pytest.raises(mf.ManifestError, match=why):
        mf.decode(raw)


def test_size_is_bounded():
    with pytest.raises(ValueError, match="settings"):
        mf.make_manifest({f"k{i}": i for i in range(mf.MAX_SETTINGS + 1)})
    long = mf.make_manifest({"layers": "x" * 100_000})
    assert len(long.settings["layers"]) == mf.MAX_VALUE_CHARS
    assert mf.make_manifest({"layers": "x" * 100_000 + "y"}) != long  # truncation keeps a digest
    with pytest.raises(ValueError, match="does not fit"):
        mf.encode(settings(), 64)
    big = mf.Manifest(settings={f"k{i}": "v" * 500 for i in range(100)})
    with pytest.raises(ValueError, match="at most"):
        mf.encode(big)
    assert b"pickle" not in msgspec.json.encode(settings())  # JSON, plain strings


# ---- layout of a worker --------------------------------------------------------------------------

def test_layout_names_dtype_shape_layers_and_kernel_block_size():
    caches = {f"model.layers.{i}.attn": torch.zeros(8, 4, 16, 64) for i in range(2)}
    out = mf.layout_settings(caches, {}, block_size=16, num_blocks=8)
    assert out["kv_layout.group0"] == "2 x float32[4, 16, 64]"
    assert out["layers"].startswith("2: model.layers.0.attn .. model.layers.1.attn #")
    assert out["kernel_block_size"] == "16"
    # vLLM splitting each 64-token block into 4 kernel blocks of 16: 4x the rows
    split = mf.layout_settings({"l": torch.zeros(32, 4, 16, 64)}, {}, block_size=64, num_blocks=8)
    assert split["kernel_block_size"] == "16"
    # the same bytes per block in another arrangement is another layout
    other = mf.layout_settings({f"model.layers.{i}.attn": torch.zeros(8, 16, 4, 64) for i in range(2)}, {},
                               block_size=16, num_blocks=8)
    assert other["kv_layout.group0"] != out["kv_layout.group0"]
    # another stage's layers (same shapes) is another layer set
    stage1 = mf.layout_settings({f"model.layers.{i}.attn": torch.zeros(8, 4, 16, 64) for i in (2, 3)}, {},
                                block_size=16, num_blocks=8)
    assert stage1["layers"] != out["layers"]


# ---- the check over a real backend ---------------------------------------------------------------

def _worker(backend, shape):
    caches = {f"l{i}": torch.randn(8, *shape) for i in range(2)}
    w = StoreWorker(backend=backend, namespace="shared", rank_tag="hg0of1.pcp0of1.dcp0of1",
                    config=StoreConnectorConfig(staging_bytes=1 << 16))
    w.register_kv_caches(caches)
    return w, caches


def _worker_manifest(worker, caches, block_size):
    layout = mf.layout_settings(caches, {}, block_size=block_size, num_blocks=8)
    return mf.make_manifest({"model_name": "tiny", "block_size": block_size, **layout,
                             "value_size": worker.value_size})


def test_two_layouts_sharing_one_namespace_the_second_refuses_at_start(tmp_path):
    """Worker A (16-token blocks, 4 heads) and B (8-token blocks, 8 heads: the same bytes per block)
    share a pinned namespace. Without the check B loads A's block: no size error, the checksum
    passes, and B's KV is A's bytes in another arrangement (silently wrong). With the manifest B
    refuses at start-up, naming the settings."""
    backend = EmbeddedBackend(16 << 20, spill_dir=tmp_path, write_through=True)
    a, a_caches = _worker(backend, (4, 16, 64))
    assert mf.publish_and_check(backend, KEY, _worker_manifest(a, a_caches, 16), a.value_size, where="ns",
                                settle_s=0) == "written"
    h = [b"\x07" * 32]
    a.submit_saves(StorePlan(saves=[BlockTransfer(request_id="r", block_hashes=h, block_ids=[[1]])]))
    a.close(5)

    b, b_caches = _worker(EmbeddedBackend(16 << 20, spill_dir=tmp_path, write_through=True), (8, 8, 64))
    assert b.value_size == a.value_size  # nothing in the value itself tells the layouts apart
    b.load_sync(StorePlan(loads=[BlockTransfer(request_id="r2", block_hashes=h, block_ids=[[2]])]))
    assert not b.ledger.take_block_ids_with_load_errors()  # the silent wrong load the check prevents
    with pytest.raises(mf.ManifestMismatch) as err:
        mf.publish_and_check(b.backend, KEY, _worker_manifest(b, b_caches, 8), b.value_size, where="ns",
                             settle_s=0)
    text = str(err.value)
    assert "block_size: stored '16', this engine '8'" in text
    assert "kv_layout.group0: stored '2 x float32[4, 16, 64]', this engine '2 x float32[8, 8, 64]'" in text
    assert {d[0] for d in err.value.differences} == {"block_size", "kv_layout.group0", "kernel_block_size"}
    b.close(5)


def test_evicted_manifest_another_layout_still_never_loads_the_old_blocks(tmp_path):
    """The manifest is evicted (Mooncake and the embedded LRU evict it like any value) while A's
    blocks stay; B, another arrangement of the same bytes per block, then stores its own manifest
    and passes its start-up check. B must still never load A's block: every value carries A's
    layout tag (the connector sets it from the manifest), so B's load fails its check and is
    recomputed."""
    backend = EmbeddedBackend(16 << 20, spill_dir=tmp_path, write_through=True)
    a, a_caches = _worker(backend, (4, 16, 64))
    a_manifest = _worker_manifest(a, a_caches, 16)
    a.layout_tag = mf.layout_tag(a_manifest)  # as StoreConnectorBase.check_manifest does
    assert mf.publish_and_check(backend, KEY, a_manifest, a.value_size, where="ns", settle_s=0) == "written"
    h, h2 = [b"\x07" * 32], [b"\x08" * 32]
    a.submit_saves(StorePlan(saves=[BlockTransfer(request_id="r", block_hashes=h + h2, block_ids=[[1, 4]])]))
    a.close(5)
    backend.batch_remove([KEY])  # evicted
    assert not backend.batch_exists([KEY])[0]

    b, b_caches = _worker(EmbeddedBackend(16 << 20, spill_dir=tmp_path, write_through=True), (8, 8, 64))
    b_manifest = _worker_manifest(b, b_caches, 8)
    b.layout_tag = mf.layout_tag(b_manifest)
    assert b.layout_tag != a.layout_tag
    assert mf.publish_and_check(b.backend, KEY, b_manifest, b.value_size, where="ns", settle_s=0) == "written"
    b.load_sync(StorePlan(loads=[BlockTransfer(request_id="r2", block_hashes=h, block_ids=[[2]])]))
    assert b.ledger.take_block_ids_with_load_errors() == {2}  # a miss, recomputed (and A's value removed)
    b.close(5)

    # The same layout (a restart of A, a second instance) reads A's block: the tag is stable.
    a2, a2_caches = _worker(EmbeddedBackend(16 << 20, spill_dir=tmp_path, write_through=True), (4, 16, 64))
    a2.layout_tag = mf.layout_tag(_worker_manifest(a2, a2_caches, 16))
    assert a2.layout_tag == a.layout_tag
    a2.load_sync(StorePlan(loads=[BlockTransfer(request_id="r3", block_hashes=h2, block_ids=[[3]])]))
    assert not a2.ledger.take_block_ids_with_load_errors()
    assert torch.equal(a2_caches["l0"][3], a_caches["l0"][4])
    a2.close(5)


def test_same_layout_matches_and_keeps_the_first_manifest(tmp_path):
    one = EmbeddedBackend(1 << 20, spill_dir=tmp_path, write_through=True)
    two = EmbeddedBackend(1 << 20, spill_dir=tmp_path, write_through=True)
    assert mf.publish_and_check(one, KEY, settings(writer="a"), SIZE, where="ns", settle_s=0) == "written"
    assert mf.publish_and_check(two, KEY, settings(writer="b"), SIZE, where="ns", settle_s=0) == "matched"
    assert mf.decode(two.batch_get([KEY])[0]).settings["writer"] == "a"


class FakeFixedSizeBackend(Backend):
    """Stores one value size only and has no batch_get (as UCM's backend)."""

    name = "fake-fixed"

    def __init__(self, inner):
        self.inner = inner

    def batch_exists(self, keys_):
        return self.inner.batch_exists(keys_)

    def batch_put(self, keys_, values):
        return self.inner.batch_put(keys_, values)

    def batch_get_into(self, keys_, buffers):
        return self.inner.batch_get_into(keys_, buffers)


def test_fixed_size_backend_a_value_of_another_size_is_a_mismatch():
    inner = EmbeddedBackend(1 << 20)
    backend = FakeFixedSizeBackend(inner)
    assert mf.publish_and_check(backend, KEY, settings(), SIZE, where="ns", settle_s=0) == "written"
    assert len(inner.batch_get([KEY])[0]) == SIZE  # stored like a block
    assert mf.publish_and_check(backend, KEY, settings(), SIZE, where="ns", settle_s=0) == "matched"
    with pytest.raises(mf.ManifestMismatch, match="cannot read as a 8192-byte value"):
        mf.publish_and_check(backend, KEY, settings(value_size=8192), 8192, where="ns", settle_s=0)


class FakeMooncakePutWindowBackend(Backend):
    """A put is listed (exists) before its value can be read: Mooncake's master knows the key
    while the writer's replica is still being copied, and a get then returns nothing."""

    name = "fake-put-window"

    def __init__(self, inner, unreadable_reads):
        self.inner = inner
        self.unreadable_reads = unreadable_reads

    def batch_exists(self, keys_):
        return self.inner.batch_exists(keys_)

    def batch_put(self, keys_, values):
        return self.inner.batch_put(keys_, values)

    def batch_get(self, keys_):
        if self.unreadable_reads > 0:
            self.unreadable_reads -= 1
            return [None] * len(keys_)
        return self.inner.batch_get(keys_)

    def batch_get_into(self, keys_, buffers):
        return self.inner.batch_get_into(keys_, buffers)


def test_a_manifest_still_being_written_is_waited_for_not_refused():
    """CI (stop 30): two engines of one layout started together on one mooncake_master; the
    second saw the first's manifest listed but not yet readable and refused to start."""
    inner = EmbeddedBackend(1 << 20)
    inner.batch_put([KEY], [mf.encode(settings(writer="b"), SIZE)])
    backend = FakeMooncakePutWindowBackend(inner, unreadable_reads=3)
    slept = []
    assert mf.publish_and_check(backend, KEY, settings(), SIZE, where="ns", settle_s=0,
                                sleep=slept.append) == "matched"
    assert slept  # it waited for the value rather than refusing at once


def test_a_manifest_that_stays_unreadable_is_still_a_mismatch():
    inner = EmbeddedBackend(1 << 20)
    inner.batch_put([KEY], [mf.encode(settings(writer="b"), SIZE)])
    backend = FakeMooncakePutWindowBackend(inner, unreadable_reads=10**6)
    with pytest.raises(mf.ManifestMismatch, match="cannot read as a 4096-byte value"):
        mf.publish_and_check(backend, KEY, settings(), SIZE, where="ns", settle_s=0, sleep=lambda s: None)


def test_corrupted_stored_manifest_fails_closed():
    backend = EmbeddedBackend(1 << 20)
    backend.batch_put([KEY], [b"KVMF" + bytes(SIZE - 4)])  # magic, then a zero version
    with pytest.raises(mf.ManifestMismatch, match="unreadable manifest"):
        mf.publish_and_check(backend, KEY, settings(), SIZE, where="ns", settle_s=0)


def test_concurrent_first_writers_agree_on_one_winner(tmp_path):
    """Two first writers of different layouts at once on a backend whose put-if-absent is atomic
    (one EmbeddedBackend shared by two threads; the Mooncake master likewise keeps the first
    put of a key): exactly one is accepted, the other refuses. (Embedded instances in different
    processes are not atomic: each keeps its own value in its memory tier; see README.)"""
    backend = EmbeddedBackend(1 << 20, spill_dir=tmp_path, write_through=True)
    for round_ in range(5):
        key = keys.manifest_key(f"race{round_}", "t")
        barrier = threading.Barrier(2)
        results: dict[str, object] = {}

        def start(name, m, key=key, barrier=barrier, results=results):
            barrier.wait()
            try:
                results[name] = mf.publish_and_check(backend, key, m, SIZE, where="ns", settle_s=0.2)
            except mf.ManifestMismatch as exc:
                results[name] = exc

        threads = [threading.Thread(target=start, args=("a", settings(block_size=16))),
                   threading.Thread(target=start, args=("b", settings(block_size=32)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        refused = [n for n, r in results.items() if isinstance(r, mf.ManifestMismatch)]
        assert len(results) == 2 and len(refused) == 1, results


# ---- a store that does not answer ----------------------------------------------------------------

class FakeHangingBackend(Backend):
    name = "fake-hang"

    def __init__(self):
        self.release = threading.Event()

    def batch_exists(self, keys_):
        self.release.wait(30)
        return [False] * len(keys_)

    def batch_put(self, keys_, values):
        return [False] * len(keys_)

    def batch_get_into(self, keys_, buffers):
        return [-1] * len(keys_)


class FakeBrokenBackend(FakeHangingBackend):
    name = "fake-broken"

    def batch_exists(self, keys_):
        raise BackendError("fake-broken", "exists", -900)


def test_unreachable_store_does_not_block_start_up(caplog):
    hanging = FakeHangingBackend()
    t0 = time.monotonic()
    out = mf.check_with_deadline(hanging, KEY, settings(), SIZE, where="ns", timeout_s=0.3)
    assert time.monotonic() - t0 < 15  # the deadline, not the 30 s hang
    assert out.startswith("unverified: no answer")
    hanging.release.set()
    out = mf.check_with_deadline(FakeBrokenBackend(), KEY, settings(), SIZE, where="ns", timeout_s=5)
    assert out.startswith("unverified: BackendError") and "-900" in out
    # a store that takes values but never keeps them: not verified, not a mismatch
    forgetful = FakeHangingBackend()
    forgetful.release.set()
    # (its read-back retries take 2 s: a deadline well past that, on a loaded machine too)
    out = mf.check_with_deadline(forgetful, KEY, settings(), SIZE, where="ns", timeout_s=30)
    assert out.startswith("unverified: OSError: the manifest was not stored")


def test_mismatch_through_the_deadline_wrapper_still_raises():
    backend = EmbeddedBackend(1 << 20)
    mf.publish_and_check(backend, KEY, settings(), SIZE, where="ns", settle_s=0)
    with pytest.raises(mf.ManifestMismatch, match="quantization: stored '', this engine 'fp8'"):
        mf.check_with_deadline(backend, KEY, settings(quantization="fp8"), SIZE, where="ns", timeout_s=5,
                               settle_s=0)


# ---- what the derived namespace covers ----------------------------------------------------------

def test_mac_and_plain_deployments_get_different_namespaces():
    """A MAC deployment refuses plain values and the reverse: sharing a namespace, each would load,
    fail and remove the other's blocks (tests/test_e2e_store_manifest.py shows it with engines)."""
    pytest.importorskip("vllm")
    from kv_store.connector_base import value_seal

    plain = value_seal(StoreConnectorConfig())
    mac = value_seal(StoreConnectorConfig(mac_key_env="K"), {"K": "x" * 32})
    other = value_seal(StoreConnectorConfig(mac_key_env="K"), {"K": "y" * 32})
    assert plain == "plain" and value_seal(StoreConnectorConfig(checksum=False)) == "plain"
    assert len({plain, mac, other}) == 3 and "x" not in mac  # keyed, the secret not in the name


def test_manifest_settings_name_the_model_by_its_last_path_component():
    pytest.importorskip("vllm")
    from kv_store.connector_base import manifest_settings

    fp = {"model": "/mnt/a/models/tiny/", "revision": "r1", "block_size": 16}
    out = manifest_settings(fp, rank_tag="t", value_size=100, layout={"layers": "2"})
    assert out["model_name"] == "tiny" and "model" not in out and out["revision"] == "r1"
    assert out["rank_tag"] == "t" and out["value_size"] == 100 and out["layers"] == "2"
    assert mf.encode(mf.make_manifest(out), 4096)  # fits a small value
