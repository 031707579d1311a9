"""Conformance tests every ``Backend`` must pass, shared by all backends.

Subclass in a test module and provide a ``backend`` fixture (a fresh, empty store)::

    class TestEmbedded(BackendContract):
        @pytest.fixture
        def backend(self):
            yield EmbeddedBackend(64 << 20)
"""

from __future__ import annotations

import os
import uuid

from kv_common.backend import Backend, BackendCapabilities, calls_lacking


def _key(tag: str) -> str:
    return f"contract/{uuid.uuid4().hex}/{tag}"


def _buffers(n: int, size: int) -> tuple[bytearray, list[memoryview]]:
    raw = bytearray(n * size)
    view = memoryview(raw)
    return raw, [view[i * size : (i + 1) * size] for i in range(n)]


class BackendContract:
    value_size = 4096

    def _register(self, backend: Backend, raw: bytearray) -> None:
        backend.register_buffer(memoryview(raw))

    def test_missing_keys_are_absent(self, backend: Backend) -> None:
        keys = [_key("a"), _key("b")]
        assert backend.batch_exists(keys) == [False, False]
        raw, bufs = _buffers(2, self.value_size)
        self._register(backend, raw)
        assert backend.batch_get_into(keys, bufs) == [-1, -1]

    def test_put_then_get_roundtrip(self, backend: Backend) -> None:
        n = 4
        keys = [_key(str(i)) for i in range(n)]
        src, src_bufs = _buffers(n, self.value_size)
        src[:] = os.urandom(len(src))
        self._register(backend, src)
        assert backend.batch_put(keys, src_bufs) == [True] * n
        assert backend.batch_exists(keys) == [True] * n
        dst, dst_bufs = _buffers(n, self.value_size)
        self._register(backend, dst)
        assert backend.batch_get_into(keys, dst_bufs) == [self.value_size] * n
        assert dst == src

    def test_mixed_batch_reports_per_key(self, backend: Backend) -> None:
        present, missing = _key("p"), _key("m")
        src, (buf,) = _buffers(1, self.value_size)
        src[:] = b"\x07" * len(src)
        self._register(backend, src)
        assert backend.batch_put([present], [buf]) == [True]
        assert backend.batch_exists([present, missing]) == [True, False]
        dst, bufs = _buffers(2, self.value_size)
        self._register(backend, dst)
        assert backend.batch_get_into([present, missing], bufs) == [self.value_size, -1]
        assert bytes(bufs[0]) == bytes(src)

    def test_existing_key_keeps_a_value_and_counts_ok(self, backend: Backend) -> None:
        key = _key("dup")
        src, (buf,) = _buffers(1, self.value_size)
        src[:] = b"\x01" * len(src)
        self._register(backend, src)
        assert backend.batch_put([key], [buf]) == [True]
        src[:] = b"\x01" * len(src)
        assert backend.batch_put([key], [buf]) == [True]
        dst, (out,) = _buffers(1, self.value_size)
        self._register(backend, dst)
        assert backend.batch_get_into([key], [out]) == [self.value_size]
        assert bytes(out) == bytes(src)

    def test_put_without_exists_call_keeps_the_stored_value(self, backend: Backend) -> None:
        """Callers put without asking ``batch_exists`` first: a batch of a stored key (other bytes
        now) and a new key succeeds for both, the stored value stays, the new one is readable."""
        stored, new = _key("stored"), _key("new")
        src, (first, second) = _buffers(2, self.value_size)
        src[:] = b"\x01" * len(src)
        self._register(backend, src)
        assert backend.batch_put([stored], [first]) == [True]
        first[:] = b"\x02" * len(first)
        assert backend.batch_put([stored, new], [first, second]) == [True, True]
        dst, bufs = _buffers(2, self.value_size)
        self._register(backend, dst)
        assert backend.batch_get_into([stored, new], bufs) == [self.value_size] * 2
        assert bytes(bufs[0]) in (b"\x01" * self.value_size, b"\x02" * self.value_size)  # whole, never mixed
        assert bytes(bufs[1]) == b"\x01" * self.value_size

    def test_pass_size_and_call_bound_are_well_formed(self, backend: Backend) -> None:
        """How a caller drives the backend: a positive pass size or None (whole request), and a
        call bound that is None (unbounded) or a non-negative time that grows with the bytes, and
        whether its calls leave the GIL (a bool: the caller's thread or an I/O thread)."""
        assert isinstance(backend.calls_release_gil, bool)
        assert backend.pass_bytes is None or (isinstance(backend.pass_bytes, int) and backend.pass_bytes > 0)
        small, large = backend.call_bound_s(self.value_size), backend.call_bound_s(1024 * self.value_size)
        assert (small is None) == (large is None)
        if small is not None and large is not None:
            assert 0 <= small <= large

    def test_declared_capabilities_have_their_calls(self, backend: Backend) -> None:
        """A caller reads ``capabilities`` instead of probing for methods: each call a declared
        capability promises is the backend's own, not ``Backend``'s default (which raises)."""
        assert isinstance(backend.capabilities, BackendCapabilities)
        assert calls_lacking(backend) == []

    def test_declared_zero_copy_parts_round_trip(self, backend: Backend) -> None:
        """``zero_copy_parts``: a value put as parts reads back whole, and into parts cut elsewhere."""
        if not backend.capabilities.zero_copy_parts:
            return
        key, cut = _key("parts"), self.value_size // 3
        src, (value,) = _buffers(1, self.value_size)
        src[:] = os.urandom(len(src))
        self._register(backend, src)
        assert backend.batch_put_parts([key], [[value[:cut], value[cut:]]]) == [True]
        dst, (out,) = _buffers(1, self.value_size)
        self._register(backend, dst)
        assert backend.batch_get_into([key], [out]) == [self.value_size]
        assert dst == src
        parts, (into,) = _buffers(1, self.value_size)
        self._register(backend, parts)
        assert backend.batch_get_parts([key, _key("missing")], [[into[: 2 * cut], into[2 * cut :]], [out]]) == [
            self.value_size, -1]
        assert parts == src

    def test_get_into_too_small_buffer_is_a_miss_not_an_overrun(self, backend: Backend) -> None:
        key = _key("big")
        src, (buf,) = _buffers(1, self.value_size)
        self._register(backend, src)
        assert backend.batch_put([key], [buf]) == [True]
        dst = bytearray(self.value_size)  # one registered region, a guard after the target
        self._register(backend, dst)
        small = memoryview(dst)[: self.value_size // 2]
        assert backend.batch_get_into([key], [small]) == [-1]
        assert dst[self.value_size // 2 :] == bytes(self.value_size // 2)

    def test_empty_batches(self, backend: Backend) -> None:
        assert backend.batch_exists([]) == []
        assert backend.batch_put([], []) == []
        assert backend.batch_get_into([], []) == []

    def test_remove_when_supported(self, backend: Backend) -> None:
        key = _key("rm")
        src, (buf,) = _buffers(1, self.value_size)
        self._register(backend, src)
        backend.batch_put([key], [buf])
        backend.batch_remove([key])
        # Optional operation: either gone or (for backends without removal) still intact.
        if backend.batch_exists([key]) == [True]:
            dst, (out,) = _buffers(1, self.value_size)
            self._register(backend, dst)
            assert backend.batch_get_into([key], [out]) == [self.value_size]
