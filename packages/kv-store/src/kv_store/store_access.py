"""What the saver and the loader share of the worker: the backend, the keys of this worker's
namespace and rank tag, how its values are sealed, its stats and its report to the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_common.backend import Backend

from kv_store.report import BlockReport
from kv_store.seal import ValueSeal
from kv_store.stats import StoreStats


@dataclass(frozen=True)
class StoreAccess:
    backend: Backend
    keys: Callable[[Sequence[bytes]], list[str]]
    seal: ValueSeal
    stats: StoreStats
    report: BlockReport
