"""Who the ranks of a prefill and a decode instance are (TP, PCP, DCP, PP) and how they are laid out:
the model the plan, the hold, the worker and the connector share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class PrefillRank(NamedTuple):
    tp_rank: int
    pcp_rank: int = 0
    pp_rank: int = 0  # pipeline stage (kv_mooncake.pipeline_stages)

    def index(self, layout: PrefillLayout) -> int:  # type: ignore[override]  # not tuple.index
        """Offset of this rank's side-channel port from the instance's base port: its rank in vLLM's
        (PP, PCP, TP) order, TP fastest."""
        return (self.pp_rank * layout.pcp_size + self.pcp_rank) * layout.tp_size + self.tp_rank


class DecodeRank(NamedTuple):
    tp_rank: int

    def index(self, layout: DecodeLayout) -> int:  # type: ignore[override]
        return self.tp_rank


@dataclass(frozen=True)
class PrefillLayout:
    tp_size: int
    total_kv_heads: int
    pcp_size: int = 1
    dcp_size: int = 1
    dp_size: int = 1
    use_mla: bool = False
    pp_size: int = 1  # stages: each holds its own layers, laid out like the others

    @property
    def cp_size(self) -> int:
        """Token shards: the DCP ranks (PCP ranks are full replicas in vLLM 0.32)."""
        return self.dcp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pcp_size * self.pp_size

    def ranks(self) -> list[PrefillRank]:
        return [PrefillRank(t, p, s) for s in range(self.pp_size) for p in range(self.pcp_size)
                for t in range(self.tp_size)]

    def shard_of(self, rank: PrefillRank) -> int:
        return rank.tp_rank % self.dcp_size


@dataclass(frozen=True)
class DecodeLayout:
    tp_size: int
    dcp_size: int = 1
    dp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size

    def ranks(self) -> list[DecodeRank]:
        return [DecodeRank(t) for t in range(self.tp_size)]

    def dcp_rank_of(self, rank: DecodeRank) -> int:
        return rank.tp_rank % self.dcp_size
