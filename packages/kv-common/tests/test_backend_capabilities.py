"""A backend declares its optional calls (``Backend.capabilities``); callers never probe for them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kv_common.backend import BackendCapabilities, calls_lacking
from kv_common.embedded_backend import EmbeddedBackend


def test_a_backend_offers_no_optional_call_unless_it_declares_it():
    backend = EmbeddedBackend(1 << 20)
    assert backend.capabilities == BackendCapabilities()
    assert calls_lacking(backend) == []
    with pytest.raises(NotImplementedError, match=r"does not offer batch_put_parts \(capabilities.zero_copy_parts"):
        backend.batch_put_parts(["k"], [[memoryview(b"x")]])


def test_declaring_a_capability_without_its_calls_fails_at_the_class():
    with pytest.raises(TypeError, match="does not define batch_get_parts"):

        class HalfParts(EmbeddedBackend):
            capabilities = BackendCapabilities(zero_copy_parts=True)

            def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
                return self.batch_put(keys, [b"".join(p) for p in parts])


def test_a_capability_declared_by_an_instance_without_its_call_is_a_clear_error():
    backend = EmbeddedBackend(1 << 20)
    backend.capabilities = BackendCapabilities(owned_puts=True)
    assert calls_lacking(backend) == ["batch_put_owned"]
    with pytest.raises(NotImplementedError, match="declares capabilities.owned_puts but does not define"):
        backend.batch_put_owned(["k"], [bytearray(b"x")])


def test_each_capability_promises_its_calls():
    assert BackendCapabilities(zero_copy_parts=True, parts_at_address=True, owned_puts=True).calls() == (
        "batch_put_parts", "batch_get_parts", "batch_put_parts_at", "batch_get_parts_at", "batch_put_owned")
