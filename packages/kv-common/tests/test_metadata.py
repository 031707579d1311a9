from __future__ import annotations

import msgspec
import pytest
from kv_common.metadata import KVTransferParams


def test_kv_transfer_params_dict_round_trip():
    params = KVTransferParams(
        do_remote_prefill=True, remote_host="127.0.0.1", remote_port=1234, remote_block_ids=[3, 4]
    )
    data = params.to_dict()
    assert "do_remote_decode" not in data  # defaults omitted: small on the wire
    assert KVTransferParams.from_dict(data) == params
    assert KVTransferParams.from_dict(None) is None
    assert KVTransferParams.from_dict({}) is None


def test_kv_transfer_params_validates_on_arrival():
    with pytest.raises(msgspec.ValidationError):
        KVTransferParams.from_dict({"remote_port": "not a port"})
    # Unknown keys from other connectors' params are tolerated.
    assert KVTransferParams.from_dict({"remote_port": 1, "extra": 1}).remote_port == 1

