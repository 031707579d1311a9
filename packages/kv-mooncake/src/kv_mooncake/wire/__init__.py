"""What decode, prefill and proxy say to each other: messages, framing, the seal, connections."""
