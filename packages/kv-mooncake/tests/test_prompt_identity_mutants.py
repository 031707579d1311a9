"""The prompt digest is one value on every host and the decode trusts only an equal one. Written
against the survivors of the mutation run (docs/mutation-report.md)."""

from __future__ import annotations

import hashlib
import re

from kv_mooncake.prompt_identity import prompt_digest, same_prompt


def test_the_digest_is_128_bits_of_blake2b_over_little_endian_int64_ids():
    # Pinned so a prefill and a decode on hosts of another byte order (or version) agree.
    ids = [1, 2, 70000, -5]
    data = b"".join(i.to_bytes(8, "little", signed=True) for i in ids)
    digest = prompt_digest(ids)
    assert re.fullmatch(r"t1:[0-9a-f]{32}", digest)
    assert digest == "t1:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def test_only_an_equal_digest_of_the_same_prompt_is_trusted():
    ids = [5, 6, 7]
    assert same_prompt(prompt_digest(ids), ids) is True
    assert same_prompt(prompt_digest(ids), iter(ids)) is True
    assert same_prompt(prompt_digest(ids), [5, 7, 6]) is False
    assert same_prompt(None, ids) is False
    assert same_prompt(prompt_digest(ids), None) is False
    assert same_prompt(123, ids) is False  # type: ignore[arg-type]
