"""Which of Mooncake's per-device builds is installed, and whether it fits the device vLLM runs on.

Mooncake ships one wheel per device; each provides the same top-level ``mooncake`` module, so two
installed together overwrite each other's files (whichever came last wins, silently). The build must
match the device: the non-CUDA wheel is built without CUDA (a GPU user gets TCP only), a CUDA
wheel does not import without ``libcuda.so.1``, the Ascend wheel needs torch_npu and CANN.

Import-light (no torch, no mooncake): ``python -m kv_common doctor`` and the connectors'
preflights call it. The device facts are gathered by :func:`device_facts` through
``kv_common.device``; :func:`findings` is pure, so tests feed it fake metadata and facts.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

MODULE = "mooncake"

# Mooncake's distributions (PyPI) -> the device each is built for. The extras `cpu`, `cuda`,
# `cuda13` and `npu` of kv-mooncake and kv-store name the first four (tests/test_packaging.py).
BUILDS: dict[str, str] = {
    "mooncake-transfer-engine-non-cuda": "cpu",
    "mooncake-transfer-engine": "cuda",  # CUDA 12
    "mooncake-transfer-engine-cuda13": "cuda13",
    "mooncake-transfer-engine-npu": "npu",
    "mooncake-transfer-engine-efa": "cuda",  # CUDA with AWS EFA transport
    "mooncake-transfer-engine-musa": "musa",  # Moore Threads GPUs: no vLLM device here
}
# The extra of kv-mooncake / kv-store that installs the build for each device vLLM runs on.
EXTRA_FOR_DEVICE = {"cpu": "cpu", "cuda": "cuda", "cuda13": "cuda13", "npu": "npu"}


def canonical(name: str) -> str:
    """PEP 503's normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class MooncakeBuild:
    distribution: str  # canonical name
    version: str

    @property
    def device(self) -> str:
        """What the build is for: cpu, cuda, cuda13, npu, musa, or unknown (a build not in BUILDS)."""
        return BUILDS.get(self.distribution, "unknown")

    def describe(self) -> str:
        return f"{self.distribution} {self.version} ({self.device} build)"


@dataclass(frozen=True)
class DeviceFacts:
    """What vLLM would run on here, as ``kv_common.device`` sees it."""

    device: str  # cpu / cuda / npu (kv_common.device.device_type())
    torch_cuda: str | None = None  # torch.version.cuda ("12.8", "13.0"), None for a CPU or NPU torch
    torch_npu: bool = False  # torch_npu imports
    torch: bool = True  # torch imports at all (without it the device is a guess)


def _top_level_modules(dist: metadata.Distribution) -> set[str]:
    text = dist.read_text("top_level.txt")
    if text:
        return {line.strip() for line in text.splitlines() if line.strip()}
    modules = set()
    for path in dist.files or ():
        first = path.parts[0] if path.parts else ""
        if first and first != ".." and not first.endswith((".dist-info", ".egg-info", ".libs", ".data")):
            modules.add(first.removesuffix(".py"))
    return modules


def installed_distributions() -> Iterable[metadata.Distribution]:
    """Every distribution installed in this environment (one place, so tests can stand in fakes)."""
    return metadata.distributions()


def installed_builds(distributions: Iterable[metadata.Distribution] | None = None) -> list[MooncakeBuild]:
    """Every installed distribution that provides the ``mooncake`` module (a Mooncake build we do
    not know by name included), sorted by name."""
    found = {}
    for dist in installed_distributions() if distributions is None else distributions:
        name = dist.metadata["Name"] if dist.metadata else None
        if not name:
            continue
        if canonical(name) in BUILDS or MODULE in _top_level_modules(dist):
            found[canonical(name)] = MooncakeBuild(canonical(name), dist.version or "?")
    return [found[name] for name in sorted(found)]


def device_facts() -> DeviceFacts:
    """The device vLLM would run on (``kv_common.device``), torch's CUDA version, torch_npu."""
    from kv_common import device as device_mod

    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return DeviceFacts(device="cpu", torch=False)
    kind = device_mod.device_type()
    try:
        importlib.import_module("torch_npu")
        has_npu = True
    except Exception:  # noqa: BLE001 - ImportError, or a CANN runtime that fails to load
        has_npu = False
    cuda: Any = getattr(getattr(torch, "version", None), "cuda", None)
    return DeviceFacts(device=kind, torch_cuda=str(cuda) if cuda else None, torch_npu=has_npu)


def wanted_device(facts: DeviceFacts) -> str:
    """The build this device wants, as a key of EXTRA_FOR_DEVICE."""
    if facts.device == "cuda" and (facts.torch_cuda or "").split(".")[0] == "13":
        return "cuda13"
    return facts.device if facts.device in EXTRA_FOR_DEVICE else "cpu"


def check(distributions: Iterable[metadata.Distribution] | None = None,
          facts: DeviceFacts | None = None) -> list[tuple[str, str]]:
    """:func:`findings` for this installation and this machine (``facts`` and ``distributions``
    given: for tests)."""
    builds = installed_builds(distributions)
    return findings(builds, facts if facts is not None else device_facts())


def findings(builds: list[MooncakeBuild], facts: DeviceFacts) -> list[tuple[str, str]]:
    """(status, text) lines: ``ok`` / ``info`` naming the build, ``warning`` when it does not fit
    the device, ``problem`` when two builds are installed together. Status strings are those of
    ``kv_common.doctor``."""
    wanted = wanted_device(facts)
    fix = f"install the build for this device: pip install 'kv-mooncake[{EXTRA_FOR_DEVICE[wanted]}]'"
    on = f"vLLM runs on {facts.device}" + (f" (torch CUDA {facts.torch_cuda})" if facts.torch_cuda else "") \
        + ("" if facts.torch else " (torch not installed: assumed)")
    if not builds:
        return [("info", f"no Mooncake build installed ({on}); for Mooncake: pip install "
                         f"'kv-mooncake[{EXTRA_FOR_DEVICE[wanted]}]'")]
    if len(builds) > 1:
        names = " and ".join(b.describe() for b in builds)
        return [("problem", f"{names} are installed together: each provides the '{MODULE}' module, so one "
                            f"overwrote the other's files; pip uninstall every one of them, then {fix}")]
    build = builds[0]
    named = f"{build.describe()} provides '{MODULE}'; {on}"
    mismatch = _mismatch(build, facts, wanted)
    if mismatch is None:
        return [("ok", named)]
    return [("warning", f"{named}: {mismatch}; {fix}")]


def _mismatch(build: MooncakeBuild, facts: DeviceFacts, wanted: str) -> str | None:
    """Why ``build`` does not fit the device, or None."""
    kind = build.device
    if kind == "unknown":
        return "a Mooncake build this doctor does not know: its device is not checked"
    if kind == "npu" and not facts.torch_npu:
        return "the Ascend build needs torch_npu and the CANN runtime, and torch_npu does not import here"
    if facts.device == "cuda" and kind == "cpu":
        return ("the non-CUDA build is built without CUDA (TCP only), and vLLM's KV cache lives in GPU memory "
                "here")
    if facts.device != "cuda" and kind in ("cuda", "cuda13"):
        return f"a CUDA build needs libcuda.so.1 and a GPU, and vLLM runs on {facts.device} here"
    if kind in ("cuda", "cuda13") and kind != wanted:
        return f"built for {'CUDA 13' if kind == 'cuda13' else 'CUDA 12'}, torch runs CUDA {facts.torch_cuda}"
    if kind != wanted:
        return f"built for {kind}, and vLLM runs on {facts.device} here"
    return None
