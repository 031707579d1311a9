"""``python -m kv_common doctor``: each probe it runs, and the command without a config."""

from __future__ import annotations

import json
import os
import socket

import pytest
from kv_common import doctor
from kv_common.__main__ import main
from kv_common.testing.ports import free_port


def test_port_in_use_is_reported_and_a_free_port_is_not():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert doctor.port_free("127.0.0.1", port) == "in use"
    assert doctor.port_free("127.0.0.1", port) is None


def test_unreachable_peer_within_the_deadline():
    port = free_port()  # nothing listens there
    why = doctor.reachable("127.0.0.1", port, timeout_s=1.0)
    assert why is not None and "refused" in why.lower()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert doctor.reachable("127.0.0.1", listener.getsockname()[1], timeout_s=1.0) is None


def test_directory_writable_or_not(tmp_path):
    assert doctor.dir_writable(str(tmp_path)) is None
    assert doctor.dir_writable(str(tmp_path / "to" / "be" / "created")) is None  # parent is writable
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert "not a directory" in doctor.dir_writable(str(blocker / "spill"))
    if os.getuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "cannot create a file" in doctor.dir_writable(str(locked))
    assert doctor.dir_writable("/proc/kv-doctor-spill") is not None  # procfs takes no files, even from root


def test_importable():
    assert doctor.importable("json", "dumps") is None
    assert "ModuleNotFoundError" in doctor.importable("no_such_engine_module_xyz")
    assert "has no" in doctor.importable("json", "NoSuchThing")


def test_parse_peer():
    assert doctor.parse_peer("10.0.0.1:30000") == ("10.0.0.1", 30000)
    assert doctor.parse_peer("[::1]:8000") == ("::1", 8000)
    with pytest.raises(ValueError, match="HOST:PORT"):
        doctor.parse_peer("nohost")


def test_cli_without_config_lists_and_passes(capsys):
    assert main(["doctor", "--no-vllm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True
    assert any(c["section"] == "installed" and "kv_common.testing" not in c["detail"] for c in out["checks"])
    assert any(c["section"] == "engines" for c in out["checks"])


def test_cli_reports_a_bad_json_and_an_unreachable_peer(capsys):
    port = free_port()
    assert main(["doctor", "--no-vllm", "--kv-transfer-config", "{not json"]) == 1
    assert "not a JSON object" in capsys.readouterr().out
    assert main(["doctor", "--no-vllm", "--peer", f"127.0.0.1:{port}", "--timeout", "1"]) == 1
    assert f"peer 127.0.0.1:{port} unreachable" in capsys.readouterr().out


def test_unknown_connector_is_information_not_a_problem():
    report = doctor.run('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert report.ok
    assert any("not a kv-* connector" in c.detail for c in report.checks)
    bad_role = doctor.run('{"kv_connector": "NixlConnector", "kv_role": "prefill"}')
    assert not bad_role.ok


def test_a_listener_without_a_secret_beyond_loopback_is_a_warning():
    """A side channel that answers any peer (no shared secret) is fine on loopback only: beyond it,
    whoever reaches the port gets the KV addresses. A warning, not a problem: private networks exist."""
    plan = doctor.Preflight(unauthenticated_binds=[
        ("0.0.0.0", free_port(), "side channel of worker rank 0"),
        ("::", free_port(), "side channel of worker rank 1"),
        ("127.0.0.1", free_port(), "side channel of worker rank 2"),
        ("localhost", free_port(), "side channel of worker rank 3"),
        ("::1", free_port(), "side channel of worker rank 4"),
    ])
    report = doctor.Report()
    doctor.run_preflight(report, "config X", plan, timeout_s=1.0)
    warned = [c.detail for c in report.checks if c.status == doctor.WARN]
    assert [w.split(":", 1)[0] for w in warned] == ["side channel of worker rank 0", "side channel of worker rank 1"]
    assert all("beyond loopback" in w and "secret" in w for w in warned)
    assert report.ok  # a warning does not fail the doctor
    assert "WARNING" in report.to_text()
