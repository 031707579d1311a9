import pytest
from kv_common.embedded_backend import EmbeddedBackend
from kv_common.testing.backend_contract import BackendContract


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
