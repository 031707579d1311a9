"""A prefill and a decode serving different weights from the same path refuse the pull, naming the
model weights and both short digests (the path, revision and shapes all agree)."""

from __future__ import annotations

import msgspec
import pytest

torch = pytest.importorskip("torch")
for _module in ("transformers", "tokenizers", "safetensors"):
    pytest.importorskip(_module)

from conftest import FakeTransferEngine  # noqa: E402
from kv_common.kv_byte_settings import KVByteSettings  # noqa: E402
from kv_common.testing.fake_vllm_config import fake_vllm_config  # noqa: E402
from kv_common.testing.model_weights import copy_model, rewrite_weights_in_place  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402
from kv_mooncake.config import MooncakeConfig  # noqa: E402
from kv_mooncake.identity import config_fingerprint
from kv_mooncake.rank_layout import PrefillLayout
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import MooncakeWorker, RankContext

HEADS, HEAD = 4, 32


@pytest.fixture
def model(tmp_path):
    return copy_model(cached_tiny_model(), tmp_path / "model")


def _worker(fingerprint: KVByteSettings) -> MooncakeWorker:
    # as MooncakeConnectorV1 builds it: the config fingerprint plus this rank's KV shape
    context = RankContext(engine_id="P", is_producer=False, is_consumer=False, side_channel_port=1,
                          total_kv_heads=HEADS, prefill_layout=PrefillLayout(tp_size=1, total_kv_heads=HEADS),
                          kv_byte_settings=fingerprint, kv_shape=(HEADS, HEAD))
    w = MooncakeWorker(MooncakeConfig(), context, engine_factory=FakeTransferEngine)
    w.register_kv_caches({f"l{i}": torch.zeros(4, HEADS, 16, 2 * HEAD) for i in range(2)})
    return w


def _handshake(prefill: MooncakeWorker, decode: MooncakeWorker):
    return prefill.handle(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))


def test_config_fingerprint_names_the_weights(model):
    before = config_fingerprint(fake_vllm_config(model=str(model)))
    rewrite_weights_in_place(model, seed=1)
    after = config_fingerprint(fake_vllm_config(model=str(model)))
    assert before.model_weights != after.model_weights
    assert msgspec.structs.replace(before, model_weights="") == msgspec.structs.replace(after, model_weights="")


def test_prefill_and_decode_with_other_weights_at_the_same_path_refuse_the_pull(model):
    prefill = _worker(config_fingerprint(fake_vllm_config(model=str(model))))
    same = _worker(config_fingerprint(fake_vllm_config(model=str(model))))
    assert isinstance(_handshake(prefill, same), P.HandshakeReply)

    rewrite_weights_in_place(model, seed=1)  # the decode starts after the model was replaced
    decode = _worker(config_fingerprint(fake_vllm_config(model=str(model))))
    reply = _handshake(prefill, decode)
    assert isinstance(reply, P.Refused), f"not refused: {reply}"
    mine, theirs = decode.compatibility.model_weights, prefill.compatibility.model_weights
    assert mine.startswith("sha256:") and len(mine) == len("sha256:") + 16 and mine != theirs
    assert f"model_weights: decode {mine!r}, prefill {theirs!r}" in reply.reason
