"""The prefill side: the hold ledger and the responder that answers readers."""
