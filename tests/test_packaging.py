"""Ecosystem habits of every distribution: one version source, py.typed, a LICENSE."""

from __future__ import annotations

import importlib
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kv-common": "kv_common", "kv-mooncake": "kv_mooncake", "kv-store": "kv_store", "kv-ucm": "kv_ucm"}


@pytest.mark.parametrize("dist,module", sorted(PACKAGES.items()))
def test_version_has_one_source(dist, module):
    pyproject = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"].get("dynamic", [])
    mod = importlib.import_module(module)
    assert mod.__version__ == metadata.version(dist) == pyproject["project"]["version"]
    # The version is written in pyproject only, never a second time in the code.
    init = (ROOT / "packages" / dist / "src" / module / "__init__.py").read_text()
    assert pyproject["project"]["version"] not in init


@pytest.mark.parametrize("dist,module", sorted(PACKAGES.items()))
def test_typed_and_licensed(dist, module):
    pkg = ROOT / "packages" / dist
    assert (pkg / "src" / module / "py.typed").is_file()
    pyproject = tomllib.loads((pkg / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    for license_file in (pkg / "LICENSE", ROOT / "LICENSE"):
        text = license_file.read_text()
        assert "Apache License" in text and "Version 2.0, January 2004" in text


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0]


@pytest.mark.parametrize("dist", ["kv-mooncake", "kv-store"])
def test_one_extra_per_device_names_mooncakes_build_for_it(dist):
    """`cpu`, `cuda`, `cuda13`, `npu`: each names exactly one Mooncake build, the one the doctor
    (kv_common.mooncake_build) says fits that device; no other extra names a build, so no install
    line brings two (they overwrite each other's `mooncake` module)."""
    from kv_common.mooncake_build import BUILDS, EXTRA_FOR_DEVICE, canonical

    extras = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for device, extra in EXTRA_FOR_DEVICE.items():
        builds = [canonical(_requirement_name(r)) for r in extras[extra] if canonical(_requirement_name(r)) in BUILDS]
        assert len(builds) == 1 and BUILDS[builds[0]] == device, (extra, extras[extra])
        assert not any(";" in r for r in extras[extra]), "a device's build is never limited to one platform"
    for extra, requirements in extras.items():
        if extra not in EXTRA_FOR_DEVICE.values():
            assert not [r for r in requirements if canonical(_requirement_name(r)) in BUILDS], (extra, requirements)


def test_this_venv_holds_one_mooncake_build_and_it_fits():
    """What the doctor says about the test venv itself: the CPU build alone (nox installs it)."""
    from kv_common import mooncake_build

    if not mooncake_build.installed_builds():
        pytest.skip("needs Mooncake installed")
    [(status, detail)] = mooncake_build.check()
    assert status == "ok", detail
    assert detail.startswith("mooncake-transfer-engine-non-cuda ")
