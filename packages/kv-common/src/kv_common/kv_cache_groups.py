"""vLLM's KV-cache groups as plain values, and the block rules of each group kind.

With the hybrid KV-cache manager on, vLLM hands a connector one block table per KV-cache group:
full-attention layers in one group, sliding-window layers in another, state-space layers (Mamba,
GDN) in a third. A connector that moves bytes must know, per group, which layers it covers, how
many tokens a block holds and which of a request's blocks still hold KV. This module reads that
from vLLM's ``KVCacheConfig`` by duck typing (no vLLM import: the doctor and unit tests run
without it) and keeps the rules as pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL = "full"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"
STATE = "state"
OTHER = "other"

NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block: windows' skipped blocks point at it

# vLLM spec class names by kind. Subclasses are matched through the class's MRO names, so a
# SlidingWindowMLASpec is a sliding-window group and an MLAAttentionSpec a full one.
_KIND_BY_SPEC = (
    ("MambaSpec", STATE),
    ("SlidingWindowSpec", SLIDING_WINDOW),
    ("ChunkedLocalAttentionSpec", CHUNKED_LOCAL),
    ("FullAttentionSpec", FULL),
)


class UnsupportedKVGroup(ValueError):
    """A KV-cache group whose contents a connector cannot move; raised at start-up."""


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: which layers share one block table, and how blocks map to tokens."""

    index: int
    kind: str
    spec_name: str
    block_size: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    # Trailing tokens a sliding window keeps beyond the window (vLLM's extra_retained_tokens).
    extra_retained_tokens: int = 0

    def describe(self) -> dict[str, Any]:
        """What two instances must agree on before one reads the other's blocks of this group."""
        return {
            "kind": self.kind,
            "spec": self.spec_name,
            "block_size": self.block_size,
            "sliding_window": self.sliding_window,
            "attention_chunk_size": self.attention_chunk_size,
            "extra_retained_tokens": self.extra_retained_tokens,
            "layers": list(self.layer_names),
        }


def spec_kind(spec: Any) -> str:
    names = {cls.__name__ for cls in type(spec).__mro__}
    for spec_name, kind in _KIND_BY_SPEC:
        if spec_name in names:
            return kind
    return OTHER


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def kv_groups(kv_cache_config: Any) -> tuple[KVGroup, ...]:
    """The transferable groups of ``kv_cache_config`` (vLLM's ``KVCacheConfig``), in vLLM's order.

    Groups vLLM marks ``enable_kv_transfer=False`` (accelerator-side replicas rebuilt after a load)
    are left out, as vLLM leaves them out of the block ids it hands connectors for transfer.
    A config without groups (HMA off in old vLLM, unit fakes) yields ().
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    out: list[KVGroup] = []
    for index, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        out.append(KVGroup(
            index=index,
            kind=spec_kind(spec),
            spec_name=type(spec).__name__,
            block_size=int(getattr(spec, "block_size", 0) or 0),
            layer_names=tuple(group.layer_names),
            sliding_window=_optional_int(getattr(spec, "sliding_window", None)),
            attention_chunk_size=_optional_int(getattr(spec, "attention_chunk_size", None)),
            extra_retained_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0),
        ))
    return tuple(out)


def refuse_state_groups(groups: tuple[KVGroup, ...], connector_name: str) -> None:
    """Refuse, at start-up, groups whose KV is not per token block (state-space / linear attention).

    Their state is one page per request, rewritten in place as tokens arrive: a block-addressed
    pull or store would move a state that belongs to another point of the prompt.
    """
    for group in groups:
        if group.kind in (STATE, OTHER):
            raise UnsupportedKVGroup(
                f"{connector_name} does not move KV-cache group {group.index} ({group.kind}: vLLM "
                f"{group.spec_name}, layers {', '.join(group.layer_names[:4])}"
                f"{' ...' if len(group.layer_names) > 4 else ''}): its state is kept per request, "
                "not per token block. Supported: full-attention, sliding-window and chunked-local "
                "attention groups. Serve this model without this connector."
            )


def skipped_tokens(num_computed_tokens: int, group: KVGroup) -> int:
    """Tokens at the start of a request whose KV this group no longer keeps (vLLM's rule)."""
    n = max(0, int(num_computed_tokens))
    if group.kind == SLIDING_WINDOW and group.sliding_window:
        return max(0, n - group.sliding_window + 1 - group.extra_retained_tokens)
    if group.kind == CHUNKED_LOCAL and group.attention_chunk_size:
        return (n // group.attention_chunk_size) * group.attention_chunk_size
    return 0


def first_needed_block(num_computed_tokens: int, group: KVGroup) -> int:
    """Index of the first block of a request this group still holds after ``num_computed_tokens``.

    Blocks before it are vLLM's null block: never read into nor from them.
    """
    if group.block_size <= 0:
        return 0
    return skipped_tokens(num_computed_tokens, group) // group.block_size
