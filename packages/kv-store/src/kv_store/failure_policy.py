"""Which ``kv_transfer_config`` vLLM's scheduler reads ``kv_load_failure_policy`` from.

A store is a cache: a block that fails to load must cost a recompute, never the request. vLLM's
default policy is "fail", and its scheduler reads the policy from the engine's own
``kv_transfer_config`` right after it built the connector (``Scheduler.__init__``). Alone, our
connector gets that very object. Under vLLM's ``MultiConnector`` (and vllm-ascend's replacement)
each child gets a *copy* of the ``VllmConfig`` with a fresh ``KVTransferConfig`` built from its
entry in ``connectors``: changing the child's policy changes nothing, the scheduler still reads
the outer "fail". The wrapper passes no reference to the outer config, so we find it on the call
stack: the frames that are constructing us (``MultiConnector.__init__``, the factory) hold it.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

_MAX_FRAMES = 40  # the wrapper's __init__ is a handful of frames above ours


def _fields(value: Any) -> Any:
    return getattr(type(value), "__dataclass_fields__", None) or ()


def _as_transfer_config(value: Any) -> Any:
    """``value`` itself when it is a KVTransferConfig (a dataclass with the policy field), its
    ``kv_transfer_config`` when it is a VllmConfig, else None. Only dataclass fields are read: no
    property of an unknown local is ever evaluated."""
    fields = _fields(value)
    if "kv_load_failure_policy" in fields and "kv_connector_extra_config" in fields:
        return value
    if "kv_transfer_config" in fields:
        inner = getattr(value, "kv_transfer_config", None)
        if "kv_load_failure_policy" in _fields(inner):
            return inner
    return None


def _names_child(transfer_config: Any, class_name: str) -> bool:
    extra = getattr(transfer_config, "kv_connector_extra_config", None) or {}
    children = extra.get("connectors") if isinstance(extra, dict) else None
    if not isinstance(children, list):
        return False
    for child in children:
        name = str(child.get("kv_connector", "")) if isinstance(child, dict) else ""
        if name == class_name or name.endswith("." + class_name):
            return True
    return False


def enclosing_transfer_configs(own: Any, class_name: str, start_depth: int = 1) -> list[Any]:
    """The ``kv_transfer_config`` of every connector wrapper (MultiConnector) on the call stack
    whose ``connectors`` name ``class_name``: innermost first, ``own`` excluded."""
    found: list[Any] = []
    seen = {id(own)}
    try:
        frame: FrameType | None = sys._getframe(start_depth + 1)
    except ValueError:
        return found
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            ktc = _as_transfer_config(value)
            if ktc is None or id(ktc) in seen:
                continue
            seen.add(id(ktc))
            if _names_child(ktc, class_name):
                found.append(ktc)
        frame = frame.f_back
    return found


def apply_recompute_policy(own: Any, class_name: str) -> list[Any]:
    """Set ``kv_load_failure_policy = "recompute"`` on our own transfer config and on every
    enclosing wrapper's (the one vLLM's scheduler reads). Returns the configs it changed."""
    changed = []
    for ktc in [own, *enclosing_transfer_configs(own, class_name, start_depth=2)]:
        if getattr(ktc, "kv_load_failure_policy", None) != "recompute":
            ktc.kv_load_failure_policy = "recompute"
            changed.append(ktc)
    return changed
