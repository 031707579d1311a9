"""Every connector side by side in vLLM engines: scheduler overhead with no hits, time to first
token with a hit (the kv-ucm row from its own Python 3.12 session)."""
