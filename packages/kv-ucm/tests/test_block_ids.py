"""ucm_block_id: 16 bytes, deterministic, separates what stores different bytes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kv_ucm.block_ids import UCM_BLOCK_ID_SIZE, ucm_block_id, ucm_block_ids

BASE = dict(model="tiny-llama", tp_size=2, dtype="float32", rank=0, use_mla=False)


def bid(block_hash=b"\x01" * 32, **overrides):
    return ucm_block_id(block_hash, **{**BASE, **overrides})


def test_sixteen_bytes():
    for h in (b"", b"\x00", b"\xff" * 32, 0, 1, -1, 2**255, -(2**200)):
        out = bid(h)
        assert isinstance(out, bytes)
        assert len(out) == UCM_BLOCK_ID_SIZE == 16


def test_deterministic_in_process():
    assert bid() == bid()
    assert bid(12345) == bid(12345)


def test_deterministic_across_processes():
    # hash randomisation (PYTHONHASHSEED) must not leak into the id
    code = (
        "from kv_ucm.block_ids import ucm_block_id;"
        "print(ucm_block_id(b'\\x01'*32, model='tiny-llama', tp_size=2, dtype='float32',"
        " rank=0, use_mla=False).hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={**_env(), "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {bid().hex()}


def _env():
    import os

    import kv_ucm

    src = os.path.dirname(os.path.dirname(kv_ucm.__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def test_rank_separates_without_mla():
    ids = {bid(rank=r, tp_size=4) for r in range(4)}
    assert len(ids) == 4


def test_rank_ignored_with_mla():
    ids = {bid(rank=r, tp_size=4, use_mla=True) for r in range(4)}
    assert len(ids) == 1
    # MLA and MHA never share an id, even on rank 0
    assert bid(rank=0, tp_size=4, use_mla=True) != bid(rank=0, tp_size=4, use_mla=False)


@pytest.mark.parametrize(
    "field,value",
    [("model", "other-model"), ("tp_size", 4), ("dtype", "bfloat16")],
)
def test_every_field_separates(field, value):
    assert bid(**{field: value}) != bid()


def test_hash_separates_and_int_bytes_differ():
    assert bid(b"\x01" * 32) != bid(b"\x02" * 32)
    assert bid(1) != bid(2)
    assert bid(-1) != bid(1)
    # an int and the bytes of the same value are distinct hash kinds
    assert bid(1) != bid(b"\x01")
    # no length-extension style ambiguity between empty and zero bytes
    assert bid(b"") != bid(b"\x00")


def test_dtype_spelling_is_canonical():
    assert bid(dtype="torch.float32") == bid(dtype="float32") == bid(dtype="Float32")
    torch = pytest.importorskip("torch")
    assert bid(dtype=torch.float32) == bid(dtype="float32")


def test_bytes_like_hashes_agree():
    raw = bytes(range(32))
    assert bid(raw) == bid(bytearray(raw)) == bid(memoryview(raw))


@pytest.mark.parametrize(
    "overrides,exc",
    [
        (dict(rank=2), ValueError),
        (dict(rank=-1), ValueError),
        (dict(tp_size=0), ValueError),
        (dict(model=""), ValueError),
        (dict(dtype=""), ValueError),
        (dict(use_mla=1), TypeError),
    ],
)
def test_invalid_arguments(overrides, exc):
    with pytest.raises(exc):
        bid(**overrides)


@pytest.mark.parametrize("bad", [None, 1.5, "abc", True])
def test_invalid_hash_type(bad):
    with pytest.raises(TypeError):
        bid(bad)


def test_mla_rank_must_still_be_valid():
    # MLA ignores the rank for the id but still rejects nonsense
    with pytest.raises(ValueError):
        bid(rank=5, tp_size=2, use_mla=True)


def test_batch_helper():
    hashes = [b"a", b"b", 3]
    assert ucm_block_ids(hashes, **BASE) == [ucm_block_id(h, **BASE) for h in hashes]


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    pass
else:

    @settings(deadline=None)
    @given(st.one_of(st.binary(max_size=64), st.integers()), st.integers(1, 16), st.data())
    def test_property_size_and_mla_sharing(block_hash, tp_size, data):
        rank = data.draw(st.integers(0, tp_size - 1))
        common = dict(model="m", tp_size=tp_size, dtype="float16")
        mha = ucm_block_id(block_hash, rank=rank, use_mla=False, **common)
        mla = ucm_block_id(block_hash, rank=rank, use_mla=True, **common)
        assert len(mha) == len(mla) == 16
        assert mla == ucm_block_id(block_hash, rank=0, use_mla=True, **common)
