from __future__ import annotations

import multiprocessing as mp
import os
import threading
from pathlib import Path

import pytest
from kv_common.backend import Backend
from kv_common.embedded_backend import EmbeddedBackend, key_filename


def block(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def get(backend: Backend, key: str, size: int = 100) -> bytes | None:
    buf = bytearray(size)
    n = backend.batch_get_into([key], [memoryview(buf)])[0]
    return bytes(buf) if n == size else None


def test_put_get_exists_in_memory():
    b = EmbeddedBackend(capacity_bytes=10_000)
    assert b.batch_put(["a", "b"], [block(1), memoryview(block(2))]) == [True, True]
    assert b.batch_exists(["a", "b", "c"]) == [True, True, False]
    assert get(b, "a") == block(1)
    assert b.batch_get(["b", "c"]) == [block(2), None]
    assert b.batch_get_into(["c"], [memoryview(bytearray(100))]) == [-1]


def test_existing_key_keeps_its_value():
    b = EmbeddedBackend()
    b.batch_put(["k"], [block(1)])
    assert b.batch_put(["k"], [block(2)]) == [True]
    assert get(b, "k") == block(1)


def test_put_copies_the_callers_buffer():
    b = EmbeddedBackend()
    buf = bytearray(block(7))
    b.batch_put(["k"], [memoryview(buf)])
    buf[:] = block(9)
    assert get(b, "k") == block(7)


def test_wrong_buffer_size_is_a_miss():
    b = EmbeddedBackend()
    b.batch_put(["k"], [block(1)])
    assert b.batch_get_into(["k"], [memoryview(bytearray(99))]) == [-1]


def test_lru_eviction_without_spill():
    b = EmbeddedBackend(capacity_bytes=300)
    b.batch_put(["a", "b", "c"], [block(1), block(2), block(3)])
    assert get(b, "a") == block(1)  # a is now most recently used; b is the oldest
    b.batch_put(["d"], [block(4)])
    assert b.batch_exists(["a", "b", "c", "d"]) == [True, False, True, True]
    stats = b.stats()
    assert stats["evictions"] == 1
    assert stats["memory_bytes"] == 300
    assert stats["memory_items"] == 3


def test_value_larger_than_capacity_is_refused_without_spill():
    b = EmbeddedBackend(capacity_bytes=50)
    assert b.batch_put(["big"], [block(1)]) == [False]
    assert b.batch_exists(["big"]) == [False]


def test_spill_and_read_back(tmp_path: Path):
    b = EmbeddedBackend(capacity_bytes=200, spill_dir=tmp_path)
    b.batch_put(["a", "b", "c", "d"], [block(i) for i in range(4)])
    assert b.stats()["memory_items"] == 2
    assert b.stats()["spills"] == 2
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted([key_filename("a"), key_filename("b")])
    assert b.batch_exists(["a", "b", "c", "d"]) == [True] * 4
    for i, key in enumerate("abcd"):
        assert get(b, key) == block(i)
    assert b.batch_get(["a"]) == [block(0)]
    stats = b.stats()
    assert stats["hits"] == 5 and stats["misses"] == 0


def test_keys_with_any_characters(tmp_path: Path):
    b = EmbeddedBackend(capacity_bytes=0, spill_dir=tmp_path)  # everything goes to disk
    keys = ["../../etc/passwd", "a/b\\c", "nul\x00byte", "ünïcode🙂", "x" * 1000]
    assert b.batch_put(keys, [block(i) for i in range(len(keys))]) == [True] * len(keys)
    for i, key in enumerate(keys):
        assert get(b, key) == block(i)
    assert all(len(p.name) == 64 + 4 for p in tmp_path.iterdir())


def test_remove(tmp_path: Path):
    b = EmbeddedBackend(capacity_bytes=100, spill_dir=tmp_path, write_through=True)
    b.batch_put(["a", "b"], [block(1), block(2)])
    b.batch_remove(["a", "b", "never"])
    assert b.batch_exists(["a", "b"]) == [False, False]
    assert list(tmp_path.iterdir()) == []


def _corrupt_backend(tmp_path: Path) -> tuple[EmbeddedBackend, Path]:
    writer = EmbeddedBackend(spill_dir=tmp_path, write_through=True)
    writer.batch_put(["k"], [block(5, 1000)])
    return EmbeddedBackend(spill_dir=tmp_path), tmp_path / key_filename("k")


def test_truncated_file_detected_and_removed(tmp_path: Path):
    reader, path = _corrupt_backend(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    assert reader.batch_exists(["k"]) == [True]  # exists does not read; get does
    assert reader.batch_get_into(["k"], [memoryview(bytearray(1000))]) == [-1]
    assert not path.exists()
    assert reader.stats()["corrupt"] == 1


def test_corrupt_payload_detected(tmp_path: Path):
    reader, path = _corrupt_backend(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert reader.batch_get(["k"]) == [None]
    assert not path.exists()


def test_bad_header_and_trailing_garbage(tmp_path: Path):
    reader, path = _corrupt_backend(tmp_path)
    good = path.read_bytes()
    path.write_bytes(b"NOTMAGIC" + good[8:])
    assert get(reader, "k", 1000) is None
    assert not path.exists()
    path.write_bytes(good + b"extra")
    assert get(reader, "k", 1000) is None
    path.write_bytes(b"abc")
    assert reader.batch_get(["k"]) == [None]


def test_no_temp_files_left(tmp_path: Path):
    b = EmbeddedBackend(spill_dir=tmp_path, write_through=True)
    b.batch_put([f"k{i}" for i in range(20)], [block(i) for i in range(20)])
    assert all(not p.name.startswith(".") for p in tmp_path.iterdir())
    assert len(list(tmp_path.iterdir())) == 20


def test_spill_capacity_evicts_oldest_files(tmp_path: Path):
    file_size = 100 + 20  # payload + header
    b = EmbeddedBackend(capacity_bytes=0, spill_dir=tmp_path, spill_capacity_bytes=3 * file_size)
    for i in range(5):
        b.batch_put([f"k{i}"], [block(i)])
        os.utime(tmp_path / key_filename(f"k{i}"), (1000 + i, 1000 + i))  # distinct mtimes
    assert b.batch_exists([f"k{i}" for i in range(5)]) == [False, False, True, True, True]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3 * file_size
    assert b.stats()["spill_evictions"] == 2


def test_write_through_needs_spill_dir():
    with pytest.raises(ValueError):
        EmbeddedBackend(write_through=True)


def test_mismatched_lengths():
    with pytest.raises(ValueError):
        EmbeddedBackend().batch_put(["a"], [])


def test_thread_safety(tmp_path: Path):
    b = EmbeddedBackend(capacity_bytes=2_000, spill_dir=tmp_path)
    errors = []

    def worker(t: int) -> None:
        for i in range(100):
            key = f"t{t}-{i}"
            b.batch_put([key], [block(i)])
            if get(b, key) != block(i):
                errors.append(key)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert b.stats()["memory_bytes"] <= 2_000


def _child(spill_dir: str, role: str, queue) -> None:
    backend = EmbeddedBackend(capacity_bytes=1 << 20, spill_dir=spill_dir, write_through=True)
    if role == "writer":
        ok = backend.batch_put([f"shared/{i}" for i in range(10)], [block(i, 4096) for i in range(10)])
        queue.put(all(ok))
    else:
        buffers = [memoryview(bytearray(4096)) for _ in range(10)]
        results = backend.batch_get_into([f"shared/{i}" for i in range(10)], buffers)
        good = all(n == 4096 for n in results) and all(
            bytes(buf) == block(i, 4096) for i, buf in enumerate(buffers)
        )
        queue.put(good)


def test_cross_process_share_through_spill_dir(tmp_path: Path):
    ctx = mp.get_context("spawn")  # like two separate vLLM engines: nothing inherited
    queue = ctx.Queue()
    writer = ctx.Process(target=_child, args=(str(tmp_path), "writer", queue))
    writer.start()
    writer.join(30)
    assert writer.exitcode == 0 and queue.get(timeout=5) is True
    reader = ctx.Process(target=_child, args=(str(tmp_path), "reader", queue))
    reader.start()
    reader.join(30)
    assert reader.exitcode == 0 and queue.get(timeout=5) is True
    # And this process sees the blocks too, without having put them.
    local = EmbeddedBackend(spill_dir=tmp_path)
    assert local.batch_exists(["shared/3", "shared/99"]) == [True, False]
    assert get(local, "shared/3", 4096) == block(3, 4096)


def test_a_subclass_that_overrides_calls_is_unbounded_unless_it_says_so():
    """The bound lets a caller wait for a call with the KV cache as its buffer: a subclass (one
    that can hang, say) must not inherit it silently."""

    class Gated(EmbeddedBackend):
        def batch_get_into(self, keys, buffers):
            return super().batch_get_into(keys, buffers)

    class SaysSo(Gated):
        call_bound_s = EmbeddedBackend.call_bound_s

    assert EmbeddedBackend(1 << 20).call_bound_s(1 << 20) is not None
    assert Gated(1 << 20).call_bound_s(1 << 20) is None
    assert SaysSo(1 << 20).call_bound_s(1 << 20) == EmbeddedBackend(1 << 20).call_bound_s(1 << 20)
    assert Backend.pass_bytes == EmbeddedBackend.pass_bytes  # memory speed: cache-sized passes


def test_medium_values_are_vllms():
    """The Backend's kv_event_medium values are vLLM's own strings (checked against vLLM where it is
    installed: kv-store's tests), so a router reading kv-store's events needs no mapping."""
    from kv_common.backend import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, Backend
    from kv_common.embedded_backend import EmbeddedBackend

    assert (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE) == ("GPU", "CPU", "STORAGE")
    assert Backend.kv_event_medium == EmbeddedBackend.kv_event_medium == MEDIUM_CPU
