"""Whether ``import ucm`` can give real UCM, checked from the installed distributions alone.

UCM ships one code-less selector (``uc-manager``) and per-device backend wheels that all install
the same top-level ``ucm``; an unrelated ``ucm-sdk`` installs a ``ucm`` too. Importing the wrong one
fails far from the cause, so ``UcmStore.from_config`` and the backend factory check first and
name the fix. Nothing here imports ``ucm``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import Any

__all__ = ["UcmInstallationError", "check_ucm_installation"]


class UcmInstallationError(ImportError):
    """``ucm`` is missing, ambiguous or shadowed by an unrelated package."""


def _dist_name(dist: Any) -> str:
    try:
        name = dist.metadata["Name"]
    except (KeyError, TypeError):
        name = None
    return (name or "").lower().replace("_", "-").replace(".", "-")


def _provides_top_level_ucm(dist: Any) -> bool:
    try:
        top = dist.read_text("top_level.txt")
    except Exception:  # noqa: BLE001 - broken metadata reads as "unknown"
        top = None
    if top and "ucm" in top.split():
        return True
    try:
        record = dist.read_text("RECORD")
    except Exception:  # noqa: BLE001
        record = None
    if record is not None:  # its text, not ``dist.files``: parsing torch's or vLLM's ~1 s a check
        return any(line.lstrip('"').startswith("ucm/") for line in record.splitlines())
    try:
        files = dist.files or []
    except Exception:  # noqa: BLE001
        files = []
    return any(getattr(f, "parts", (None,))[:1] == ("ucm",) for f in files)


def _is_backend_name(name: str) -> bool:
    # uc-manager itself is the code-less selector; uc-manager-cuda-cu130, uc-manager-cann910-a2,
    # ... are the backend wheels that all install the same top-level ``ucm``.
    return name.startswith("uc-manager-")


def check_ucm_installation() -> None:
    """Raise ``UcmInstallationError`` with a fix when ``import ucm`` cannot give real UCM.

    Checked, without importing ``ucm``: the unrelated ``ucm-sdk`` distribution (it also installs
    a top-level ``ucm``), more than one UCM backend wheel at once, any other distribution
    providing ``ucm``, and no ``ucm`` at all.
    """
    names: dict[str, Any] = {}
    for dist in importlib.metadata.distributions():
        name = _dist_name(dist)
        if name:
            names.setdefault(name, dist)

    hint = (
        "install exactly one UCM backend in a Python 3.12 environment, e.g. "
        "pip install 'uc-manager[cu130]' (kv-ucm/scripts/make_py312_env.sh builds one)"
    )
    if "ucm-sdk" in names:
        raise UcmInstallationError(
            "the 'ucm-sdk' distribution is installed: it is unrelated to Unified Cache "
            "Management but installs a top-level 'ucm' package that shadows UCM's. "
            f"pip uninstall ucm-sdk, then {hint}"
        )
    backends = sorted(n for n in names if _is_backend_name(n))
    if len(backends) > 1:
        raise UcmInstallationError(
            f"several UCM backend distributions are installed at once: {', '.join(backends)}. "
            "They overwrite each other's 'ucm' package files; create a fresh environment and "
            f"{hint}"
        )
    others = sorted(
        n
        for n, d in names.items()
        if not _is_backend_name(n) and n != "uc-manager" and _provides_top_level_ucm(d)
    )
    if others:
        raise UcmInstallationError(
            f"distribution(s) {', '.join(others)} provide a top-level 'ucm' package that is "
            f"not UCM's; uninstall them, then {hint}"
        )
    if not backends and importlib.util.find_spec("ucm") is None:
        # (an importable 'ucm' without a distribution is a source checkout on sys.path: fine)
        py = (
            ""
            if sys.version_info[:2] == (3, 12)
            else (
                f" (UCM wheels exist only for CPython 3.12; this is {sys.version_info[0]}."
                f"{sys.version_info[1]})"
            )
        )
        raise UcmInstallationError(f"UCM is not installed{py}: {hint}")
