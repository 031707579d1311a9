"""A real Mooncake TransferEngine with some calls overridden: tests count or slow those calls."""

from __future__ import annotations

from typing import Any


class WrappedEngine:
    """The real engine, every call passed on; subclasses count or slow the calls they override."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
