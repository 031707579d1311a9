"""The Mooncake TransferEngine wrapper, its per-peer budgets and first contact, and pacing."""
