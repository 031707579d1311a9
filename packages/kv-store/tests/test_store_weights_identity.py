"""A model changed in place starts clean: the namespace and the layout tag name the weights, so the
old model's blocks, kept by a store that outlives the engine, are never read by the new one."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")  # kv_store.connector_base subclasses vLLM's connector base

from kv_common.embedded_backend import EmbeddedBackend  # noqa: E402
from kv_common.testing.fake_vllm_config import fake_vllm_config  # noqa: E402
from kv_common.testing.model_weights import copy_model, rewrite_weights_in_place  # noqa: E402
from kv_store import keys  # noqa: E402
from kv_store import manifest as mf  # noqa: E402
from kv_store.config import StoreConnectorConfig  # noqa: E402
from kv_store.connector_base import manifest_settings, store_fingerprint  # noqa: E402
from kv_store.metadata import BlockTransfer, StorePlan  # noqa: E402
from kv_store.scheduler import StoreScheduler  # noqa: E402
from kv_store.worker import StoreWorker  # noqa: E402

TAG = "hg0of1.pcp0of1.dcp0of1"
BS = 16


@pytest.fixture(scope="module")
def tiny_model():
    for module in ("transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module)
    from kv_common.testing.tiny_model import cached_tiny_model

    return cached_tiny_model()


@pytest.fixture
def model(tiny_model, tmp_path):
    return copy_model(tiny_model, tmp_path / "model")


def _namespace(model) -> str:
    return keys.namespace(store_fingerprint(fake_vllm_config(model=str(model))))


def _layout_tag(model) -> int:
    settings = manifest_settings(store_fingerprint(fake_vllm_config(model=str(model))), rank_tag=TAG,
                                 value_size=1024, layout={"layers": "2"})
    return mf.layout_tag(mf.make_manifest(settings))


def test_namespace_and_layout_tag_change_with_the_weights(model):
    namespace, tag = _namespace(model), _layout_tag(model)
    rewrite_weights_in_place(model, seed=1)  # same config, headers and sizes; new values
    assert _namespace(model) != namespace
    assert _layout_tag(model) != tag


def test_same_bytes_or_a_new_mtime_keep_the_namespace(tiny_model, model):
    namespace = _namespace(model)
    assert _namespace(tiny_model) != namespace  # the path is in the namespace, as before
    os.utime(model / "model.safetensors", ns=(time.time_ns(), time.time_ns() + 10**12))
    assert _namespace(model) == namespace
    model_weights = store_fingerprint(fake_vllm_config(model=str(model)))["model_weights"]
    assert model_weights == store_fingerprint(fake_vllm_config(model=str(tiny_model)))["model_weights"]


def test_the_manifest_names_the_weights():
    settings = manifest_settings({"model": "/m/tiny", "model_weights": "sha256:1111"}, rank_tag=TAG,
                                 value_size=1024, layout={})
    stored = mf.make_manifest(settings)
    mine = mf.make_manifest({**settings, "model_weights": "sha256:2222"})
    assert mf.differences(stored, mine) == [("model_weights", "sha256:1111", "sha256:2222")]


class _Request:
    def __init__(self, hashes):
        self.request_id, self.block_hashes, self.num_tokens = "r", hashes, (len(hashes) + 1) * BS


def test_restart_over_a_kept_embedded_store_misses_after_the_weights_changed(model, tmp_path):
    spill = tmp_path / "store"
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    caches = {f"model.layers.{i}.attn": torch.randn(8, 4, BS, 64) for i in range(2)}
    writer = StoreWorker(backend=EmbeddedBackend(16 << 20, spill_dir=spill, write_through=True),
                         namespace=_namespace(model), rank_tag=TAG, config=StoreConnectorConfig(staging_bytes=1 << 20))
    writer.register_kv_caches(caches)
    writer.submit_saves(StorePlan(saves=[BlockTransfer(request_id="w", block_hashes=hashes, block_ids=[[1, 2, 3]])]))
    writer.close(10)

    def lookup() -> int:
        """A restarted engine's scheduler over the store directory the old one left."""
        scheduler = StoreScheduler(
            backend=EmbeddedBackend(16 << 20, spill_dir=spill, write_through=True), namespace=_namespace(model),
            rank_tags=[TAG], block_size=BS, config=StoreConnectorConfig(lookup_timeout_s=30),
            load_enabled=True, save_enabled=False)
        try:
            matched, _ = scheduler.get_num_new_matched_tokens(_Request(hashes), 0)
            return int(matched or 0)
        finally:
            scheduler.close()

    assert lookup() == 3 * BS  # same weights: the restart finds what it stored
    rewrite_weights_in_place(model, seed=1)
    assert lookup() == 0  # new weights at the same path: the old model's blocks are not read
