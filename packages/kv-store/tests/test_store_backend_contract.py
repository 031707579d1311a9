import pytest
from kv_common.embedded_backend import EmbeddedBackend
from kv_common.testing.backend_contract import BackendContract
from kv_store.embedded import EmbeddedStoreBackend


class TestEmbeddedMemory(BackendContract):
    @pytest.fixture
    def backend(self):
        with EmbeddedBackend(64 << 20) as b:
            yield b


class TestEmbeddedSpill(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path):
        with EmbeddedBackend(64 << 20, spill_dir=tmp_path, write_through=True) as b:
            yield b


class TestEmbeddedStore(BackendContract):
    """kv-store's embedded backend: the contract's zero-copy parts checks run on it."""

    @pytest.fixture
    def backend(self):
        with EmbeddedStoreBackend(64 << 20) as b:
            yield b
