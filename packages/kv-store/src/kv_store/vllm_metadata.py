"""vLLM's metadata types wrapping the store plan and report (the only vLLM-bound part of them)."""

from __future__ import annotations

import msgspec
from kv_common.vllm_compat import base_module

from kv_store.metadata import StorePlan, StoreReport

_base = base_module()


class StoreConnectorMetadata(_base.KVConnectorMetadata):  # type: ignore[name-defined]
    """vLLM's metadata type wrapping the msgspec plan (vLLM pickles it between processes; the
    payload itself is msgpack bytes so nothing but plain data crosses)."""

    def __init__(self, plan: StorePlan) -> None:
        self._wire = msgspec.msgpack.encode(plan)
        self._plan: StorePlan | None = plan

    @property
    def plan(self) -> StorePlan:
        if self._plan is None:
            self._plan = msgspec.msgpack.decode(self._wire, type=StorePlan)
        return self._plan

    def __getstate__(self) -> dict:
        return {"wire": self._wire}

    def __setstate__(self, state: dict) -> None:
        self._wire = state["wire"]
        self._plan = None


class StoreWorkerMetadata(_base.KVConnectorWorkerMetadata):  # type: ignore[name-defined]
    def __init__(self, report: StoreReport) -> None:
        self.report = report

    def aggregate(self, other: StoreWorkerMetadata) -> StoreWorkerMetadata:
        # Union per rank tag: the scheduler decides when every tag has stored a block (a rank whose
        # save lands a step later, or that reports nothing this step, must not lose or fake it).
        by_tag: dict[str, list[bytes]] = {t: list(hs) for t, hs in self.report.stored_by_tag.items()}
        for tag, hashes in other.report.stored_by_tag.items():
            by_tag[tag] = list(dict.fromkeys(by_tag.get(tag, []) + list(hashes)))
        mine = set(self.report.stored)
        stored = [h for h in other.report.stored if h in mine]
        removed = list(dict.fromkeys(self.report.removed + other.report.removed))
        return StoreWorkerMetadata(StoreReport(stored=stored, stored_by_tag=by_tag, removed=removed))

    def __getstate__(self) -> dict:
        return {"wire": msgspec.msgpack.encode(self.report)}

    def __setstate__(self, state: dict) -> None:
        self.report = msgspec.msgpack.decode(state["wire"], type=StoreReport)
