"""Which prompt prefix each instance holds, from vLLM's KV events: a bounded index per instance.

vLLM (``--kv-events-config``, publisher ``zmq``) announces every block it caches (``BlockStored``:
its hash, its parent's hash, its token ids) and every block it evicts (``BlockRemoved``), or that
it dropped them all (``AllBlocksCleared``). vLLM's block hashes depend on a per-process seed, so
the proxy cannot recompute them from a prompt; it keys each block by its own chain key instead:
a hash of (parent's chain key, the block's token ids), computed alike from the events and from a
prompt's token ids. Pure bookkeeping, no I/O: :mod:`.kv_events` feeds it.

Tier-aware: each event names its medium in vLLM's values (``GPU`` for vLLM's prefix cache, ``CPU`` /
``STORAGE`` for a connector's store, kv-store's included). A block stays matched while any medium
of the instance holds it: a ``BlockRemoved`` from the GPU leaves the copy the store announced. An
event without a medium counts as ``GPU``.

Bounded: at most ``max_blocks`` per instance (the oldest go first). An event about a block whose
parent the index never saw (missed or evicted here) is dropped: a prefix is only ever matched
from its first block. A gap in the event sequence clears the instance's index (a missed
``BlockRemoved`` would leave a block the instance no longer has).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

ROOT = 0  # the chain key before a prompt's first block
DEFAULT_MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: what an event without a medium is about


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """The proxy's key of a block: deterministic across processes (ints and tuples of ints only)."""
    return hash((parent, tuple(tokens)))


def prompt_keys(token_ids: Sequence[int], block_size: int, limit: int = 1 << 16) -> list[int]:
    """Chain keys of a prompt's full blocks, in order (at most ``limit``)."""
    keys, parent = [], ROOT
    for start in range(0, min(len(token_ids) // block_size, limit) * block_size, block_size):
        parent = chain_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


class PrefixIndex:
    """One instance's cached blocks as chain keys."""

    def __init__(self, max_blocks: int = 200_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self._keys: OrderedDict[int, Hashable] = OrderedDict()  # chain key -> vLLM's hash
        self._by_hash: dict[Hashable, int] = {}  # vLLM's hash -> chain key
        self._media: dict[int, set[str]] = {}  # chain key -> the media holding it

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()
        self._by_hash.clear()
        self._media.clear()

    def media(self, key: int) -> frozenset[str]:
        """The media holding the block of chain key ``key`` (empty: not held)."""
        return frozenset(self._media.get(key, ()))

    def stored(self, block_hashes: Sequence[Hashable], parent_hash: Hashable | None, token_ids: Sequence[int],
               block_size: int, medium: str | None = None) -> int:
        """A ``BlockStored`` (in ``medium``); returns how many blocks were indexed."""
        if block_size < 1 or len(token_ids) != len(block_hashes) * block_size:
            return 0  # not a run of full blocks of this shape: ignore rather than guess
        if self.block_size != block_size:
            self.clear()
            self.block_size = block_size
        if parent_hash is None:
            parent = ROOT
        elif parent_hash in self._by_hash:
            parent = self._by_hash[parent_hash]
        else:
            return 0
        for i, vllm_hash in enumerate(block_hashes):
            parent = chain_key(parent, token_ids[i * block_size:(i + 1) * block_size])
            self._keys[parent] = vllm_hash
            self._keys.move_to_end(parent)
            self._by_hash[vllm_hash] = parent
            self._media.setdefault(parent, set()).add(medium or DEFAULT_MEDIUM)
        while len(self._keys) > self.max_blocks:
            old_key, old_hash = self._keys.popitem(last=False)
            self._by_hash.pop(old_hash, None)
            self._media.pop(old_key, None)
        return len(block_hashes)

    def removed(self, block_hashes: Sequence[Hashable], medium: str | None = None) -> None:
        """A ``BlockRemoved`` from ``medium``: a block leaves the index once no medium holds it."""
        for vllm_hash in block_hashes:
            key = self._by_hash.get(vllm_hash)
            if key is None:
                continue
            media = self._media.get(key, set())
            media.discard(medium or DEFAULT_MEDIUM)
            if not media:
                self._by_hash.pop(vllm_hash, None)
                self._keys.pop(key, None)
                self._media.pop(key, None)

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its :func:`prompt_keys`) this instance holds."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n


class PromptKeys:
    """One request's prompt and its chain keys per block size, each computed at most once (a
    prompt is walked whole: the prefills' and the decodes' indexes share one walk)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._by_size: dict[int, list[int]] = {}

    def for_block_size(self, block_size: int) -> list[int]:
        keys = self._by_size.get(block_size)
        if keys is None:
            keys = self._by_size[block_size] = prompt_keys(self.token_ids, block_size)
        return keys


def prefill_credit(indexes: dict[str, PrefixIndex], prompt: PromptKeys | None) -> dict[str, int]:
    """Per instance URL: prompt tokens it holds already (its longest cached prefix), for the
    balancer to subtract from its load. Empty without token ids or without any index."""
    if prompt is None:
        return {}
    credit: dict[str, int] = {}
    for url, index in indexes.items():
        if index.block_size is None or not len(index):
            continue
        blocks = index.matched_blocks(prompt.for_block_size(index.block_size))
        if blocks:
            credit[url] = blocks * index.block_size
    return credit
