"""P2P sections: raw TransferEngine ceilings, MooncakeConnectorV1 pulls (alone, with verify_kv, many
in flight) and what a producer pays while it holds blocks."""
