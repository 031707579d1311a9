"""The decode side: the pure plan, byte ranges, peers, the lease, the messenger, the puller."""
