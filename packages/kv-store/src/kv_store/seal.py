"""How this worker seals its values and checks the ones it loads: the checksum setting, the
deployment's MAC key and the layout tag, held once for the saver and the loader (the format
itself is ``codec``'s). Each value is sealed for, and checked against, the store key it is stored
under: a value copied to another key fails its check."""

from __future__ import annotations

from collections.abc import Sequence

from kv_store import codec


class ValueSeal:
    def __init__(self, checksum: bool, mac_key: bytes | None) -> None:
        self.checksum = checksum
        self.mac_key = mac_key
        # 64-bit digest of this worker's layout (``manifest.layout_tag``), set by the connector
        # before the first step: sealed into every value and checked on every load (``codec``).
        self.layout_tag = 0

    def write(self, value: memoryview, payload_size: int, store_key: str) -> None:
        codec.write_trailer(value, payload_size, self.checksum, self.mac_key, self.layout_tag, store_key.encode())

    def check(self, value: memoryview, payload_size: int, nbytes: int, store_key: str) -> str | None:
        return codec.check_value(value, payload_size, nbytes, self.mac_key, self.layout_tag, store_key.encode())

    def seal_parts(self, parts: Sequence[memoryview], store_key: str) -> None:
        """``parts``: a value's payload slices, then its trailer."""
        codec.seal_parts(parts[:-1], parts[-1], self.checksum, self.mac_key, self.layout_tag, store_key.encode())

    def check_parts(self, parts: Sequence[memoryview], nbytes: int, store_key: str) -> str | None:
        return codec.check_parts(parts[:-1], parts[-1], nbytes, self.mac_key, self.layout_tag, store_key.encode())

    @property
    def detects_stale_bytes(self) -> bool:
        """Whether a load can tell a value from bytes that changed under its put (any check)."""
        return self.checksum or self.mac_key is not None
