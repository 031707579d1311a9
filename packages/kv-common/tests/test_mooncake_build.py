"""The installed Mooncake build and whether it fits the device (``kv_common.mooncake_build``), and
how ``python -m kv_common doctor`` reports it. Distributions are fakes (this machine holds one
build, the non-CUDA one); devices are fakes for absent CUDA / Ascend hardware."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from kv_common import doctor, mooncake_build
from kv_common.__main__ import main
from kv_common.mooncake_build import DeviceFacts, MooncakeBuild, findings


class FakeDistribution(metadata.Distribution):
    """Installed-distribution metadata as pip leaves it: METADATA and top_level.txt."""

    def __init__(self, name: str, version: str, top_level: str | None = "mooncake") -> None:
        self._files = {"METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"}
        if top_level is not None:
            self._files["top_level.txt"] = top_level + "\n"

    def read_text(self, filename: str) -> str | None:
        return self._files.get(filename)

    def locate_file(self, path: str | Path) -> Path:
        raise NotImplementedError("a fake has no files on disk")


FAKE_CPU = DeviceFacts(device="cpu")
FAKE_CUDA12 = DeviceFacts(device="cuda", torch_cuda="12.8")
FAKE_CUDA13 = DeviceFacts(device="cuda", torch_cuda="13.0")
FAKE_NPU = DeviceFacts(device="npu", torch_npu=True)


def _build(name: str) -> MooncakeBuild:
    return MooncakeBuild(name, "0.3.13.post1")


def test_the_distribution_that_provides_mooncake_is_found_by_metadata():
    dists = [
        FakeDistribution("numpy", "2.1.0", top_level="numpy"),
        FakeDistribution("Mooncake_Transfer_Engine_Non_CUDA", "0.3.13.post1"),
        FakeDistribution("kv-mooncake", "0.1.0", top_level="kv_mooncake"),
    ]
    assert mooncake_build.installed_builds(dists) == [_build("mooncake-transfer-engine-non-cuda")]
    # A build this module does not know by name (a source build) still counts: it provides 'mooncake'.
    assert mooncake_build.installed_builds([FakeDistribution("mooncake-from-source", "0.4.0")]) == [
        MooncakeBuild("mooncake-from-source", "0.4.0")]
    assert mooncake_build.installed_builds([FakeDistribution("numpy", "2.1.0", top_level="numpy")]) == []


def test_two_builds_installed_together_is_a_problem_naming_both():
    dists = [FakeDistribution("mooncake-transfer-engine-non-cuda", "0.3.13.post1"),
             FakeDistribution("mooncake-transfer-engine", "0.3.13.post1")]
    [(status, text)] = mooncake_build.check(dists, FAKE_CUDA12)
    assert status == doctor.PROBLEM
    assert "mooncake-transfer-engine 0.3.13.post1 (cuda build)" in text
    assert "mooncake-transfer-engine-non-cuda 0.3.13.post1 (cpu build)" in text
    assert "installed together" in text and "pip uninstall" in text


@pytest.mark.parametrize("facts,build", [
    (FAKE_CPU, "mooncake-transfer-engine-non-cuda"),
    (FAKE_CUDA12, "mooncake-transfer-engine"),
    (FAKE_CUDA13, "mooncake-transfer-engine-cuda13"),
    (FAKE_NPU, "mooncake-transfer-engine-npu"),
    (FAKE_CUDA12, "mooncake-transfer-engine-efa"),
])
def test_the_build_for_the_device_is_named_and_fits(facts, build):
    [(status, text)] = findings([_build(build)], facts)
    assert status == doctor.OK
    assert text.startswith(f"{build} 0.3.13.post1 (") and f"vLLM runs on {facts.device}" in text


@pytest.mark.parametrize("facts,build,why,extra", [
    (FAKE_CUDA12, "mooncake-transfer-engine-non-cuda", "(TCP only)", "cuda"),
    (FAKE_CUDA13, "mooncake-transfer-engine-non-cuda", "(TCP only)", "cuda13"),
    (FAKE_CPU, "mooncake-transfer-engine", "needs libcuda.so.1", "cpu"),
    (FAKE_CPU, "mooncake-transfer-engine-cuda13", "needs libcuda.so.1", "cpu"),
    (FAKE_CPU, "mooncake-transfer-engine-npu", "torch_npu does not import", "cpu"),
    (DeviceFacts(device="cuda", torch_cuda="12.8"), "mooncake-transfer-engine-npu", "torch_npu", "cuda"),
    (FAKE_NPU, "mooncake-transfer-engine-non-cuda", "built for cpu", "npu"),
    (FAKE_NPU, "mooncake-transfer-engine", "needs libcuda.so.1", "npu"),
    (FAKE_CUDA13, "mooncake-transfer-engine", "built for CUDA 12, torch runs CUDA 13.0", "cuda13"),
    (FAKE_CUDA12, "mooncake-transfer-engine-cuda13", "built for CUDA 13, torch runs CUDA 12.8", "cuda"),
    (FAKE_CUDA12, "mooncake-transfer-engine-musa", "built for musa", "cuda"),
    (FAKE_CPU, "mooncake-from-source", "does not know", "cpu"),
])
def test_a_build_that_does_not_fit_the_device_is_a_warning_with_the_fix(facts, build, why, extra):
    [(status, text)] = findings([_build(build)], facts)
    assert status == doctor.WARN
    assert build in text and why in text
    assert text.endswith(f"pip install 'kv-mooncake[{extra}]'")


def test_no_build_is_information_with_the_extra_for_the_device():
    [(status, text)] = findings([], FAKE_CUDA13)
    assert status == doctor.INFO and "no Mooncake build installed" in text and "kv-mooncake[cuda13]" in text
    [(_, text)] = findings([], DeviceFacts(device="cpu", torch=False))
    assert "torch not installed" in text and "kv-mooncake[cpu]" in text


def test_device_facts_come_from_kv_common_device():
    facts = mooncake_build.device_facts()
    assert facts.device == "cpu"  # no accelerator on these machines
    assert facts.torch_npu is False


@pytest.fixture
def fake_cuda_machine_with_two_builds(monkeypatch):
    dists = [FakeDistribution("mooncake-transfer-engine-non-cuda", "0.3.13.post1"),
             FakeDistribution("mooncake-transfer-engine-cuda13", "0.3.14")]
    monkeypatch.setattr(mooncake_build, "installed_distributions", lambda: dists)
    monkeypatch.setattr(mooncake_build, "device_facts", lambda: FAKE_CUDA13)


def test_doctor_fails_naming_both_builds(capsys, fake_cuda_machine_with_two_builds):
    assert main(["doctor", "--no-vllm", "--json"]) == 1
    checks = json.loads(capsys.readouterr().out)["checks"]
    [problem] = [c for c in checks if c["status"] == doctor.PROBLEM]
    assert problem["section"] == "mooncake build"
    assert "mooncake-transfer-engine-non-cuda" in problem["detail"]
    assert "mooncake-transfer-engine-cuda13 0.3.14" in problem["detail"]


def test_a_config_on_mooncake_names_the_build_in_its_section(monkeypatch):
    dists = [FakeDistribution("mooncake-transfer-engine-non-cuda", "0.3.13.post1")]
    monkeypatch.setattr(mooncake_build, "installed_distributions", lambda: dists)
    monkeypatch.setattr(mooncake_build, "device_facts", lambda: FAKE_CUDA12)
    report = doctor.Report()
    doctor.run_preflight(report, "config X", doctor.Preflight(mooncake_build="Mooncake TransferEngine"), 1.0)
    [check] = report.checks
    assert (check.section, check.status) == ("config X", doctor.WARN)
    assert check.detail.startswith("Mooncake TransferEngine: mooncake-transfer-engine-non-cuda 0.3.13.post1")
    assert "(TCP only)" in check.detail and "kv-mooncake[cuda]" in check.detail
    assert report.ok  # a warning: the instance still starts (over TCP)
    quiet = doctor.Report()
    doctor.run_preflight(quiet, "config X", doctor.Preflight(), 1.0)
    assert quiet.checks == []  # configs that do not run on Mooncake say nothing about it
