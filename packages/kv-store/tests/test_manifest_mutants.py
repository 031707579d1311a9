"""The namespace manifest at its limits: the stored format, every bound, the layout a worker records,
and the start-up check against backends that race, lag or hang (settle re-check, read-back retries,
the deadline). Written against the survivors of the mutation run (docs/mutation-report.md)."""

from __future__ import annotations

import hashlib
import struct
import threading

import msgspec
import numpy as np
import pytest
from kv_common.backend import Backend
from kv_common.embedded_backend import EmbeddedBackend
from kv_store import manifest as mf

HEADER = struct.Struct("<4sHHI")  # the stored header: magic, format version, reserved, JSON length
KEY = "kv/ns/tag/manifest"
SIZE = 4096


def manifest(**over) -> mf.Manifest:
    return mf.make_manifest({"block_size": 16, "dtype": "float32", "writer": "host a", **over})


# ---- format and bounds ---------------------------------------------------------------------------


def test_the_stored_header_is_magic_version_1_reserved_zero_and_length():
    m = manifest()
    raw = mf.encode(m)
    body = msgspec.json.encode(m)
    assert HEADER.unpack_from(raw) == (b"KVMF", 1, 0, len(body))
    assert raw[HEADER.size:] == body
    assert mf.FORMAT_VERSION == 1 and m.format == 1


def test_padding_fills_the_value_size_with_zeros():
    raw = mf.encode(manifest(), SIZE)
    unpadded = mf.encode(manifest())
    assert len(raw) == SIZE and raw[: len(unpadded)] == unpadded and not any(raw[len(unpadded):])
    assert mf.encode(manifest(), len(unpadded)) == unpadded  # an exact fit needs no padding
    with pytest.raises(ValueError, match="does not fit"):
        mf.encode(manifest(), len(unpadded) - 1)


def _manifest_of_encoded_size(size: int) -> mf.Manifest:
    base = len(mf.encode(mf.Manifest(settings={"k": ""})))
    return mf.Manifest(settings={"k": "x" * (size - base)})


def test_a_manifest_of_16_kib_is_the_largest_stored():
    largest = _manifest_of_encoded_size(16 << 10)
    raw = mf.encode(largest)
    assert len(raw) == 16 << 10
    assert mf.decode(raw) == largest
    with pytest.raises(ValueError, match="at most 16384"):
        mf.encode(_manifest_of_encoded_size((16 << 10) + 1))


def test_a_header_claiming_more_than_16_kib_is_refused_before_parsing():
    body = msgspec.json.encode(mf.Manifest(settings={"k": "v"}))
    limit = (16 << 10) - HEADER.size
    padded = body + b" " * (limit + 1 - len(body))  # valid JSON, one byte over the limit
    with pytest.raises(mf.ManifestError, match="exceeds"):
        mf.decode(HEADER.pack(b"KVMF", 1, 0, len(padded)) + padded)
    at_limit = padded[:-1]
    assert mf.decode(HEADER.pack(b"KVMF", 1, 0, len(at_limit)) + at_limit).settings == {"k": "v"}


def test_a_header_claiming_more_than_the_value_holds_is_refused():
    body = msgspec.json.encode(manifest())
    raw = HEADER.pack(b"KVMF", 1, 0, len(body) + 1) + body
    with pytest.raises(mf.ManifestError, match="exceeds"):
        mf.decode(raw)


def test_decode_reads_bytes_bytearray_and_memoryview():
    raw = mf.encode(manifest(), SIZE)
    assert mf.decode(raw) == mf.decode(bytearray(raw)) == mf.decode(memoryview(raw)) == manifest()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"KVMF" + bytes(7), "shorter"),
        (HEADER.pack(b"KVMF", 1, 0, 0), "unreadable"),  # a header and nothing else: not "shorter"
        (HEADER.pack(b"KVMA", 1, 0, 2) + b"{}", "no manifest magic"),
        (HEADER.pack(b"KVMF", 2, 0, 2) + b"{}", "format 2"),
        (HEADER.pack(b"KVMF", 0, 0, 2) + b"{}", "format 0"),
    ],
)
def test_what_is_not_a_manifest(raw, why):
    with pytest.raises(mf.ManifestError, match=why):
        mf.decode(raw)


def test_a_body_that_disagrees_with_its_header_is_refused():
    body = b'{"format":2,"settings":{}}'
    with pytest.raises(mf.ManifestError, match="inconsistent"):
        mf.decode(HEADER.pack(b"KVMF", 1, 0, len(body)) + body)


def test_at_most_128_settings():
    full = {f"k{i}": i for i in range(128)}
    assert len(mf.make_manifest(full).settings) == 128
    with pytest.raises(ValueError, match="129 manifest settings"):
        mf.make_manifest({**full, "one more": 1})
    assert len(mf.decode(mf.encode(mf.Manifest(settings={f"k{i}": "" for i in range(128)}))).settings) == 128
    too_many = mf.encode(mf.Manifest(settings={f"k{i}": "" for i in range(129)}))
    with pytest.raises(mf.ManifestError, match="inconsistent"):
        mf.decode(too_many)


def test_values_are_text_and_long_ones_keep_a_digest():
    m = mf.make_manifest({"t": (1, 2), "n": 3, "b": False, "s": "x", "a": None})
    assert m.settings == {"a": "None", "b": "False", "n": "3", "s": "x", "t": "(1, 2)"}
    assert list(m.settings) == ["a", "b", "n", "s", "t"]
    exact = "x" * 512
    assert mf.make_manifest({"v": exact}).settings["v"] == exact
    long = "x" * 513
    assert mf.make_manifest({"v": long}).settings["v"] == "x" * 500 + "..." + hashlib.sha256(long.encode()).hexdigest()[:9]


def test_a_manifest_is_an_immutable_keyword_only_value():
    m = manifest()
    with pytest.raises(AttributeError):
        m.format = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        mf.Manifest(1, {})  # type: ignore[misc]


def test_a_mismatch_carries_its_message_and_differences():
    exc = mf.ManifestMismatch("text", [("a", "1", "2")])
    assert str(exc) == "text" and exc.differences == [("a", "1", "2")]
    assert mf.ManifestMismatch("text").differences == []


# ---- layout tag, differences, messages ----------------------------------------------------------


def test_layout_tag_is_64_bits_of_the_settings_without_the_writer():
    tags = {mf.layout_tag(manifest(block_size=b)) for b in range(1, 65)}
    assert len(tags) == 64
    assert all(0 < t < 1 << 64 for t in tags)
    assert max(tags) >= 1 << 56  # all 64 bits are used
    assert mf.layout_tag(manifest(writer="b")) == mf.layout_tag(manifest())
    assert mf.layout_tag(manifest(dtype="bfloat16")) != mf.layout_tag(manifest())


def test_differences_name_settings_on_either_side_but_not_the_writer():
    stored = mf.make_manifest({"a": 1, "b": 2, "writer": "x"})
    mine = mf.make_manifest({"a": 1, "c": 3, "writer": "y"})
    assert mf.differences(stored, mine) == [("b", "2", "(absent)"), ("c", "(absent)", "3")]
    assert mf.differences(stored, stored) == []


def test_mismatch_message_names_each_setting_and_the_writer():
    text = mf.mismatch_message("ns 'x'", [("a", "1", "2"), ("b", "3", "4")], "host a")
    assert text.startswith("ns 'x' holds KV written with another layout (written by host a): "
                           "a: stored '1', this engine '2'; b: stored '3', this engine '4'. Refusing")
    assert "written by" not in mf.mismatch_message("ns", [("a", "1", "2")])


# ---- the layout a worker records -----------------------------------------------------------------


def test_layer_set_spelled_out():
    assert mf.layer_set([]) == "0"
    assert mf.layer_set(["a"]) == "1: a .. a #" + hashlib.sha256(b"a").hexdigest()[:12]
    assert mf.layer_set(["a", "b", "c"]) == "3: a .. c #" + hashlib.sha256(b"a\nb\nc").hexdigest()[:12]


def test_layout_settings_spelled_out():
    caches = {"l0": np.zeros((8, 4, 2, 6), np.float32), "l1": np.zeros((8, 4, 2, 6), np.float32),
              "l2": np.zeros((8, 2, 2, 6), np.float16)}
    out = mf.layout_settings(caches, {"l2": 1}, block_size=16, num_blocks=8)
    assert out == {
        "kv_layout.group0": "2 x float32[4, 2, 6]",
        "kv_layout.group1": "1 x float16[2, 2, 6]",
        "layers": mf.layer_set(["l0", "l1", "l2"]),
        "kernel_block_size": "16",
    }


@pytest.mark.parametrize(
    ("shapes", "num_blocks", "kernel"),
    [
        ([(32, 2)], 8, "4"),  # 4 kernel blocks per block
        ([(8, 2)], None, "unknown"),
        ([(8, 2)], 0, "unknown"),
        ([(8, 2), (16, 2)], 8, "unknown"),  # rows disagree
        ([(10, 2)], 8, "unknown"),  # not a multiple of the blocks
        ([(0, 2)], 8, "unknown"),
        ([()], 1, "unknown"),  # a scalar has no rows
    ],
)
def test_kernel_block_size(shapes, num_blocks, kernel):
    caches = {f"l{i}": np.zeros(s, np.float32) for i, s in enumerate(shapes)}
    assert mf.layout_settings(caches, {}, block_size=16, num_blocks=num_blocks)["kernel_block_size"] == kernel


# ---- the check against backends ------------------------------------------------------------------


class FakeLaggingBackend(Backend):
    """A backend whose put shows only after ``lag`` reads, and whose stored value may be replaced by
    another writer (``replace_with`` after ``replace_after`` reads): put-if-absent that is not atomic."""

    name = "fake-lagging"

    def __init__(self, lag: int = 0, store_put: bool = True) -> None:
        self.values: dict[str, bytes] = {}
        self.lag, self.reads, self.store_put = lag, 0, store_put
        self.replace_with: bytes | None = None
        self.replace_after = 0

    def batch_exists(self, keys_):
        self.reads += 1
        if self.replace_with is not None and self.reads > self.replace_after:
            self.values[keys_[0]] = self.replace_with
        visible = self.reads > self.lag
        return [visible and k in self.values for k in keys_]

    def batch_put(self, keys_, values):
        if self.store_put:
            for k, v in zip(keys_, values):
                self.values.setdefault(k, bytes(v))
        return [True] * len(keys_)

    def batch_get_into(self, keys_, buffers):
        return [-1] * len(keys_)

    def batch_get(self, keys_):
        return [self.values.get(k) for k in keys_]


def _check(backend, mine=None, **kw):
    sleeps: list[float] = []
    kw.setdefault("settle_s", 0)
    out = mf.publish_and_check(backend, KEY, mine or manifest(), SIZE, where="ns", sleep=sleeps.append, **kw)
    return out, sleeps


def test_first_writer_writes_then_others_match():
    backend = FakeLaggingBackend()
    assert _check(backend) == ("written", [])
    assert backend.values[KEY] == mf.encode(manifest(), SIZE)
    assert _check(backend) == ("matched", [])
    with pytest.raises(mf.ManifestMismatch, match="block_size: stored '16', this engine '32'"):
        _check(backend, manifest(block_size=32))


def test_a_lagging_put_is_read_back_after_retries():
    out, sleeps = _check(FakeLaggingBackend(lag=4))
    assert out == "written" and sleeps == [0.1] * 3


def test_read_back_gives_up_after_20_retries():
    with pytest.raises(OSError, match="not stored"):
        _check(FakeLaggingBackend(store_put=False))
    sleeps: list[float] = []
    with pytest.raises(OSError):
        mf.publish_and_check(FakeLaggingBackend(store_put=False), KEY, manifest(), SIZE, where="ns", settle_s=0,
                             sleep=sleeps.append)
    assert len(sleeps) == 20
    # The last of the 20 retries still counts: 1 read before the put, 1 right after, 20 retries.
    assert _check(FakeLaggingBackend(lag=21))[0] == "written"


def test_a_racing_writer_seen_at_read_back_is_a_mismatch():
    backend = FakeLaggingBackend()
    backend.replace_with, backend.replace_after = mf.encode(manifest(block_size=32), SIZE), 1
    with pytest.raises(mf.ManifestMismatch, match="block_size"):
        _check(backend)


def test_a_racing_writer_seen_after_the_settle_pause_is_a_mismatch():
    backend = FakeLaggingBackend()
    backend.replace_with, backend.replace_after = mf.encode(manifest(block_size=32), SIZE), 2
    with pytest.raises(mf.ManifestMismatch, match="block_size"):
        _check(backend, settle_s=0.5)
    quiet = FakeLaggingBackend()
    assert _check(quiet, settle_s=0.5) == ("written", [0.5])


class FakeGetIntoBackend(FakeLaggingBackend):
    """No batch_get (as UCM's backend): values come back through batch_get_into."""

    def __init__(self, n: int | None = None) -> None:
        super().__init__()
        self.n = n

    def batch_get(self, keys_):
        raise NotImplementedError

    def batch_get_into(self, keys_, buffers):
        out = []
        for k, buf in zip(keys_, buffers):
            value = self.values.get(k)
            if value is None or len(value) != len(buf):
                out.append(-1)
                continue
            buf[:] = value
            out.append(len(value) if self.n is None else self.n)
        return out


def test_a_backend_without_batch_get_reads_into_a_value_sized_buffer():
    backend = FakeGetIntoBackend()
    assert _check(backend)[0] == "written"
    assert _check(backend)[0] == "matched"
    empty = FakeGetIntoBackend(n=0)
    empty.values[KEY] = mf.encode(manifest(), SIZE)
    with pytest.raises(mf.ManifestMismatch, match="unreadable manifest"):
        _check(empty)


def test_check_with_deadline_returns_the_outcome_or_raises_the_mismatch():
    backend = EmbeddedBackend(1 << 20)
    assert mf.check_with_deadline(backend, KEY, manifest(), SIZE, where="ns", timeout_s=30, settle_s=0) == "written"
    assert mf.check_with_deadline(backend, KEY, manifest(), SIZE, where="ns", timeout_s=30, settle_s=0) == "matched"
    with pytest.raises(mf.ManifestMismatch):
        mf.check_with_deadline(backend, KEY, manifest(dtype="x"), SIZE, where="ns", timeout_s=30, settle_s=0)


def test_no_deadline_waits_for_the_answer():
    # timeout_s 0: no deadline; the settle pause (0.3 s) makes the answer come late.
    backend = EmbeddedBackend(1 << 20)
    assert mf.check_with_deadline(backend, KEY, manifest(), SIZE, where="ns", timeout_s=0, settle_s=0.3) == "written"


class FakeHangingBackend(FakeLaggingBackend):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def batch_exists(self, keys_):
        self.release.wait(20)
        return super().batch_exists(keys_)


def test_a_hanging_store_is_given_up_on_and_cannot_hold_the_process():
    backend = FakeHangingBackend()
    try:
        out = mf.check_with_deadline(backend, KEY, manifest(), SIZE, where="ns", timeout_s=0.5)
        assert out == "unverified: no answer from the store within 0.5 s"
        hung = [t for t in threading.enumerate() if t.name == "store-manifest"]
        assert hung and all(t.daemon for t in hung)
    finally:
        backend.release.set()


def test_a_failing_store_is_unverified_with_the_error():
    out = mf.check_with_deadline(FakeLaggingBackend(store_put=False), KEY, manifest(), SIZE, where="ns",
                                 timeout_s=60, settle_s=0)
    assert out == "unverified: OSError: the manifest was not stored (backend full or refusing values)"
