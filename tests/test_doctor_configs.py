"""``python -m kv_common doctor`` with every connector installed: each problem it reports, and a clean pass."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from kv_common.__main__ import main
from kv_common.testing.ports import free_port


def _doctor(capsys, config: dict, *extra: str) -> tuple[int, list[dict]]:
    rc = main(["doctor", "--no-vllm", "--json", "--timeout", "1", "--kv-transfer-config", json.dumps(config), *extra])
    return rc, json.loads(capsys.readouterr().out)["checks"]


def _problems(checks: list[dict]) -> list[str]:
    return [c["detail"] for c in checks if c["status"] == "problem"]


def _p2p(kv_port: int, role: str = "kv_producer") -> dict:
    # vllm-ascend's documented P2P config (pd_disaggregation_mooncake_single_node.md), its port swapped.
    return {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": str(kv_port), "engine_id": "0",
            "kv_connector_extra_config": {"use_ascend_direct": True, "prefill": {"dp_size": 1, "tp_size": 2},
                                          "decode": {"dp_size": 1, "tp_size": 1}}}


def _pool(**extra) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_rpc_port": "0", **extra}}


def test_clean_pass_multiconnector_p2p_plus_pool(capsys, tmp_path):
    config = {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
        "connectors": [_p2p(free_port()), _pool(backend="embedded", embedded={"spill_dir": str(tmp_path / "spill")})]}}
    rc, checks = _doctor(capsys, config)
    assert rc == 0, _problems(checks)
    details = [c["detail"] for c in checks]
    assert any("connectors[0]: kv_connector_extra_config parses (MooncakeConfig)" in d for d in details)
    assert any("connectors[1]: kv_connector_extra_config parses (StoreConfig)" in d for d in details)
    assert sum("side channel of worker rank" in d and "is free" in d for d in details) == 2  # prefill.tp_size 2
    assert any("spill_dir" in d and "is writable" in d for d in details)


def test_port_in_use(capsys):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        rc, checks = _doctor(capsys, _p2p(port))
    assert rc == 1
    assert _problems(checks) == [f"side channel of worker rank 0: 127.0.0.1:{port} cannot be bound: in use"]


def test_decode_binds_nothing(capsys):
    with socket.socket() as listener:  # the decode does not listen: a busy kv_port is no problem for it
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        rc, checks = _doctor(capsys, _p2p(listener.getsockname()[1], role="kv_consumer"))
    assert rc == 0, _problems(checks)


def test_master_unreachable(capsys):
    port = free_port()
    rc, checks = _doctor(capsys, _pool(backend="mooncake", mooncake={"master_server_address": f"127.0.0.1:{port}"}))
    assert rc == 1
    (problem,) = _problems(checks)
    assert problem.startswith(f"Mooncake master: 127.0.0.1:{port} unreachable")


def test_master_address_missing(capsys, monkeypatch):
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    rc, checks = _doctor(capsys, _pool(backend="mooncake"))
    assert rc == 1 and "no master address" in _problems(checks)[0]


def test_unwritable_store_directory(capsys, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    rc, checks = _doctor(capsys, _pool(backend="embedded", embedded={"spill_dir": str(blocker / "spill")}))
    assert rc == 1
    (problem,) = _problems(checks)
    assert "embedded backend spill_dir" in problem and "is not writable" in problem


def test_bad_key_is_named(capsys):
    config = _p2p(free_port())
    config["kv_connector_extra_config"]["prefil"] = {"tp_size": 1}
    rc, checks = _doctor(capsys, config)
    assert rc == 1
    (problem,) = _problems(checks)
    assert "MooncakeConnectorV1: kv_connector_extra_config key 'prefil': unknown key" in problem


def test_backend_not_installed_names_the_installed_ones(capsys):
    rc, checks = _doctor(capsys, _pool(backend="memcache"))
    assert rc == 1
    (problem,) = _problems(checks)
    assert "key 'backend': 'memcache' is not installed here; installed backends: embedded, mooncake" in problem


def test_peer_unreachable(capsys):
    port = free_port()
    rc, checks = _doctor(capsys, _p2p(free_port(), role="kv_consumer"), "--peer", f"127.0.0.1:{port}")
    assert rc == 1 and _problems(checks)[0].startswith(f"peer 127.0.0.1:{port} unreachable")


def test_engine_missing_for_a_backend_whose_module_is_absent(tmp_path):
    # A third-party backend registered through the kv_store.backends entry point group, its module gone.
    dist = tmp_path / "kv_ghost_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kv-ghost-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [kv_store.backends]
        ghost = kv_ghost_backend_module:make
        """))
    config = _pool(backend="ghost")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "kv_common", "doctor", "--no-vllm", "--json", "--kv-transfer-config", json.dumps(config)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 1, out.stderr
    problems = _problems(json.loads(out.stdout)["checks"])
    assert len(problems) == 1 and "backend 'ghost' (kv_ghost_backend_module:make)" in problems[0]
    assert "does not import: ModuleNotFoundError" in problems[0]


def test_backend_named_as_module_factory_is_checked_for_import(capsys):
    rc, checks = _doctor(capsys, _pool(backend="kv_no_such_backend_module:make"))
    assert rc == 1
    (problem,) = _problems(checks)
    assert "backend 'kv_no_such_backend_module:make'" in problem and "does not import" in problem


def test_pipeline_parallel_prefill_checks_a_port_per_stage_rank(capsys):
    # vllm-ascend's pipeline_parallel.md topology: a PP 2 x TP 2 prefill, a PP 1 decode.
    extra = {"prefill": {"dp_size": 1, "tp_size": 2, "pp_size": 2, "pp_layer_partition": "32,29"},
             "decode": {"dp_size": 1, "tp_size": 1, "pp_size": 1}}
    config = {**_p2p(free_port(), role="kv_consumer"), "kv_connector_extra_config": extra}
    rc, checks = _doctor(capsys, config)
    assert rc == 0, _problems(checks)
    config = {**_p2p(free_port()), "kv_connector_extra_config": extra}
    rc, checks = _doctor(capsys, config)
    assert rc == 0, _problems(checks)
    assert sum("side channel of worker rank" in c["detail"] and "is free" in c["detail"] for c in checks) == 4
