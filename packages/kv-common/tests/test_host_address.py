"""The address a connector tells its peers: vLLM's own host-IP helper (``VLLM_HOST_IP`` first), and
what ``python -m kv_common doctor`` says about it."""

from __future__ import annotations

import socket

import pytest
from kv_common import doctor, vllm_compat


def test_host_ip_is_vllms_own_and_follows_vllm_host_ip(monkeypatch):
    network_utils = pytest.importorskip("vllm.utils.network_utils")
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    assert vllm_compat.host_ip() == network_utils.get_ip()
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    assert vllm_compat.host_ip() == "10.1.2.3" == network_utils.get_ip()


def test_without_vllm_the_same_rule_is_applied_here(monkeypatch):
    network_utils = pytest.importorskip("vllm.utils.network_utils")
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    assert vllm_compat.host_ip_without_vllm() == network_utils.get_ip()
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    assert vllm_compat.host_ip_without_vllm() == "10.1.2.3"


def test_local_addresses_include_loopback_and_the_default_route_address(monkeypatch):
    addresses = doctor.local_addresses()
    assert "127.0.0.1" in addresses
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    outward = vllm_compat.host_ip_without_vllm()
    if outward != "0.0.0.0":  # a machine with no route at all has no outward address
        assert outward in addresses


def _advertised(host: str, what: str = "side channel") -> list[doctor.Check]:
    report = doctor.Report()
    doctor.run_preflight(report, "config X", doctor.Preflight(advertise=[(host, what, "side_channel_host")]), 1.0)
    return report.checks


def test_doctor_warns_when_loopback_is_advertised():
    (check,) = _advertised("127.0.0.1")
    assert check.status == doctor.WARN
    assert "side channel: peers are told 127.0.0.1" in check.detail
    assert "loopback" in check.detail and "VLLM_HOST_IP" in check.detail and "side_channel_host" in check.detail
    assert doctor.Report(checks=[check]).ok  # a warning, not a problem: one machine is a valid deployment


def test_doctor_warns_when_the_advertised_address_is_not_this_machines():
    (check,) = _advertised("192.0.2.213")  # TEST-NET-1: no machine here has it
    assert check.status == doctor.WARN
    assert "192.0.2.213 is not an address of this machine" in check.detail
    assert "127.0.0.1" in check.detail  # names this machine's addresses


def test_doctor_warns_about_an_address_nobody_can_connect_to():
    (check,) = _advertised("0.0.0.0")
    assert check.status == doctor.WARN and "0.0.0.0" in check.detail


def test_doctor_accepts_an_address_of_this_machine():
    outward = [a for a in doctor.local_addresses() if not a.startswith("127.") and ":" not in a]
    assert outward, "CI machines have an IPv4 address besides loopback"
    (check,) = _advertised(outward[0])
    assert check.status == doctor.OK, check
    assert f"peers are told {outward[0]}" in check.detail


def test_doctor_resolves_a_host_name():
    (check,) = _advertised(socket.gethostname())
    assert check.status in (doctor.OK, doctor.WARN)
    assert socket.gethostname() in check.detail
