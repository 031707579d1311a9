"""Why a decode rank's pull of a request failed: its blocks not read become load errors."""

from __future__ import annotations


class PullFailed(RuntimeError):
    pass


class PeerDown(PullFailed):
    """The prefill rank is presumed down: failed without waiting for it."""


class PeerUnreachable(PeerDown):
    """Nothing at the prefill rank's address can answer (connection refused, no route): failed at once."""
