"""Every exception kv-mooncake raises, in one place (urllib3's ``exceptions.py``).

Grouped by the room that raises them: the side channel (``wire``), the TransferEngine (``engine``),
the pull (``pull``) and the plans. Nothing here imports anything of the package.
"""

from __future__ import annotations

# The side channel (wire/)

class SideChannelError(RuntimeError):
    """The peer answered with an error, or its reply could not be decoded."""


class SideChannelTimeout(SideChannelError):
    """No reply before the deadline (also when nothing at the address would take the connection)."""


class ProtocolMismatch(SideChannelError):
    """A message in another side-channel protocol version's envelope, or in none (``peer_version``
    None: a release from before the envelope)."""

    def __init__(self, peer_version: int | None):
        super().__init__(f"side-channel protocol {peer_version if peer_version is not None else 'without envelope'}")
        self.peer_version = peer_version


class SideChannelRefused(SideChannelError):
    """The peer refuses us for good (the side-channel secrets differ, or one side has none): a
    retry, sealed afresh, would be refused the same way."""


class WireError(ValueError):
    """The peer's bytes are not side-channel frames we accept."""


class NotASideChannel(WireError):
    """The connection did not open with our greeting: another protocol or another version."""


class FrameTooLarge(WireError):
    """A frame declared larger than the limit (its body is never buffered)."""

    def __init__(self, length: int, limit: int):
        super().__init__(f"a {length}-byte message (limit {limit})")
        self.length, self.limit = length, limit


class AuthError(Exception):
    """Why a sealed message was refused (for this side's log only, never sent to the peer)."""


# The TransferEngine (engine/)

class TransferError(RuntimeError):
    def __init__(self, op: str, code: int, detail: str = "", batches_done: int = 0):
        self.op, self.code = op, code
        self.batches_done = batches_done  # read_batches: batches read in full, in order, before the failure
        super().__init__(f"Mooncake TransferEngine {op} failed (code {code})" + (f": {detail}" if detail else ""))


# A decode rank's pull (pull/): its blocks not read become load errors

class PullFailed(RuntimeError):
    pass


class PeerDown(PullFailed):
    """The prefill rank is presumed down: failed without waiting for it."""


class PeerUnreachable(PeerDown):
    """Nothing at the prefill rank's address can answer (connection refused, no route): failed at once."""


class ReadBeforeLease(Exception):
    """The read may have begun before these blocks were held for the request: read them again."""


# Plans and pipeline stages

class PlanError(ValueError):
    """The two layouts cannot exchange KV blocks (for example heads that do not divide)."""


class StageError(ValueError):
    """A partition or a stage's layers that cannot be read right."""
