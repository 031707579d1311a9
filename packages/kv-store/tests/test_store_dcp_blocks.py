"""Decode context parallelism (issue 23 §2): vLLM 0.32 hashes and aligns prefixes in blocks of
``block_size * dcp`` tokens (``resolve_kv_cache_block_sizes``: one ``Request.block_hashes`` entry
and one scheduler block id per ``block_size * dcp`` tokens; each DCP rank holds its share of those
tokens in its own cache block of ``block_size`` rows). The store's scheduler side must count tokens
in those blocks: counted in cache blocks, it told vLLM half the tokens it loaded (DCP 2) and
loaded later blocks than vLLM marked as loaded. Also, on the same scheduler-side connector: the
value format is part of the derived namespace (issue 23 §3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from kv_common.embedded_backend import EmbeddedBackend  # noqa: E402
from kv_common.testing.fake_vllm_config import fake_vllm_config  # noqa: E402
from kv_common.vllm_compat import base_module  # noqa: E402
from kv_store import keys  # noqa: E402
from kv_store.connector_base import StoreConnectorBase  # noqa: E402
from test_store_scheduler_worker import FakeBlocks, FakeRequest, chain, new_req_output  # noqa: E402

CACHE_BLOCK = 4  # cache_config.block_size: rows of one cache block on each DCP rank
DCP = 2
HASH_BLOCK = CACHE_BLOCK * DCP  # tokens per block hash and per scheduler block id


class EmbeddedStoreConnector(StoreConnectorBase):
    """The store connector over an embedded backend of its own."""

    connector_name = "EmbeddedStoreConnector"

    def make_backend(self, config, role):
        return EmbeddedBackend(16 << 20)


def scheduler_connector(kv_cache_config):
    config = fake_vllm_config(block_size=CACHE_BLOCK, tp=DCP, dcp=DCP)
    config.kv_transfer_config = SimpleNamespace(
        kv_connector_extra_config={"lookup_timeout_s": 10.0}, is_kv_consumer=True, is_kv_producer=True,
        kv_load_failure_policy="recompute",
    )
    return EmbeddedStoreConnector(config, base_module().KVConnectorRole.SCHEDULER, kv_cache_config)


def dcp_request(req_id: str) -> FakeRequest:
    req = FakeRequest(req_id, list(range(2 * HASH_BLOCK + 1)))  # 2 hash blocks + 1 token
    req.block_hashes = chain(req.tokens, bs=HASH_BLOCK)  # as vLLM hashes them under DCP 2
    return req


# vLLM 0.32 sets hash_block_size on the scheduler's KV-cache config before it builds the connector;
# without it (older vLLM) the connector derives block_size * dcp itself.
@pytest.mark.parametrize("kv_cache_config", [
    SimpleNamespace(num_blocks=16, kv_cache_groups=[], hash_block_size=HASH_BLOCK),
    SimpleNamespace(num_blocks=16, kv_cache_groups=[]),
], ids=["hash_block_size", "derived"])
def test_store_hits_count_tokens_in_dcp_hash_blocks(kv_cache_config):
    connector = scheduler_connector(kv_cache_config)
    req = dcp_request("a")
    tags = keys.all_rank_tags(tp_size=DCP, dcp_size=DCP, total_kv_heads=4)
    assert len(tags) == DCP
    stored = [key for tag in tags for key in keys.block_keys(connector.namespace, tag, req.block_hashes)]
    assert connector.backend.batch_put(stored, [b"v"] * len(stored)) == [True] * len(stored)
    try:
        # Both hash blocks are stored: 16 tokens from the store, not 8.
        assert connector.get_num_new_matched_tokens(req, 0) == (2 * HASH_BLOCK, False)
        connector.update_state_after_alloc(req, FakeBlocks([5, 6, 7]), 2 * HASH_BLOCK)
        plan = connector.build_connector_meta(new_req_output(req, [5, 6, 7], 2 * HASH_BLOCK, 1)).plan
        assert [(t.block_hashes, t.block_ids) for t in plan.loads] == [(req.block_hashes, [[5, 6]])]
        # The first hash block is in vLLM's own prefix cache: the store adds the second one only,
        # into the second block id.
        local = dcp_request("b")
        assert connector.get_num_new_matched_tokens(local, HASH_BLOCK) == (HASH_BLOCK, False)
        connector.update_state_after_alloc(local, FakeBlocks([8, 9, 10]), HASH_BLOCK)
        plan = connector.build_connector_meta(new_req_output(local, [8, 9, 10], 2 * HASH_BLOCK, 1)).plan
        assert [(t.block_hashes, t.block_ids) for t in plan.loads] == [(local.block_hashes[1:], [[9]])]
    finally:
        connector.shutdown()


def test_a_chunked_prefill_saves_only_hash_blocks_it_has_computed():
    """12 of 17 tokens computed: one hash block (8 tokens) is complete, the second is not. Counted
    in cache blocks (3 of 4 tokens), the second hash block's KV was saved half computed."""
    connector = scheduler_connector(SimpleNamespace(num_blocks=16, kv_cache_groups=[], hash_block_size=HASH_BLOCK))
    req = dcp_request("c")
    try:
        assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
        connector.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 0)
        plan = connector.build_connector_meta(new_req_output(req, [1, 2, 3], 0, 12)).plan
        assert [(t.block_hashes, t.block_ids) for t in plan.saves] == [(req.block_hashes[:1], [[1]])]
    finally:
        connector.shutdown()


def test_the_value_format_is_part_of_the_derived_namespace(monkeypatch):
    """After an upgrade of the value format the old blocks are in another namespace (misses), not
    behind a manifest whose ``value_format`` differs (which refuses to start)."""
    from kv_store import codec

    kv_cache_config = SimpleNamespace(num_blocks=16, kv_cache_groups=[])
    connectors = [scheduler_connector(kv_cache_config)]
    monkeypatch.setattr(codec, "VALUE_FORMAT", "an older format")
    connectors.append(scheduler_connector(kv_cache_config))
    try:
        assert connectors[0].namespace != connectors[1].namespace
    finally:
        for connector in connectors:
            connector.shutdown()


def test_dcp_instances_with_other_interleave_sizes_never_share_a_namespace():
    """With DCP > 1 the interleave size decides which rank holds which tokens of a block: the same
    rank tag and block hash hold other tokens' KV, so the namespaces must differ."""
    from kv_store import keys
    from kv_store.connector_base import store_fingerprint

    def namespace(**kw):
        return keys.namespace(store_fingerprint(fake_vllm_config(**kw)))

    assert namespace(dcp=2, interleave=1) != namespace(dcp=2, interleave=16)
    # With one DCP rank every interleave lays tokens out alike: one namespace.
    assert namespace(dcp=1, interleave=1) == namespace(dcp=1, interleave=16)
