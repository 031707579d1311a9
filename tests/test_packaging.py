"""Ecosystem habits of every distribution: one version source, py.typed, a LICENSE."""

from __future__ import annotations

import importlib
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
