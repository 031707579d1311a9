"""The prompt digest is one value on every host and the decode trusts only an equal one. Written
against the survivors of the mutation run (docs/mutation-report.md)."""

from __future__ import annotations

import hashlib
import re

import msgspec
from kv_mooncake.identity import prompt_digest, same_prompt


def test_the_digest_is_128_bits_of_blake2b_over_framed_little_endian_int64_ids():
    # Pinned so a prefill and a decode on hosts of another byte order (or version) agree.
    ids = [1, 2, 70000, -5]
    data = b"".join(i.to_bytes(8, "little", signed=True) for i in ids)
    identity = [("cache_salt", "s")]
    digest = prompt_digest(ids, identity)
    assert re.fullmatch(r"t2:[0-9a-f]{32}", digest)
    framed = msgspec.msgpack.encode(["t2", data, [["cache_salt", "s"]]])
    assert digest == "t2:" + hashlib.blake2b(framed, digest_size=16).hexdigest()
    assert prompt_digest(ids) != digest  # the identity keys count


def test_only_an_equal_digest_of_the_same_prompt_is_trusted():
    ids = [5, 6, 7]
    assert same_prompt(prompt_digest(ids), prompt_digest(ids)) is True
    assert same_prompt(prompt_digest(ids), prompt_digest(iter(ids))) is True
    assert same_prompt(prompt_digest(ids), prompt_digest([5, 7, 6])) is False
    assert same_prompt(None, prompt_digest(ids)) is False
    assert same_prompt("", "") is False
    assert same_prompt(prompt_digest(ids), None) is False
    assert same_prompt(123, prompt_digest(ids)) is False  # type: ignore[arg-type]


def test_a_lora_adapter_is_named_by_its_path_too():
    from types import SimpleNamespace

    from kv_mooncake.identity import request_digest

    def request(path: str) -> SimpleNamespace:
        lora = SimpleNamespace(lora_name="adapter", lora_path=path)
        return SimpleNamespace(prompt_token_ids=[1, 2, 3], lora_request=lora, mm_features=None, cache_salt=None)

    assert request_digest(request("/adapters/v1")) != request_digest(request("/adapters/v2"))
    assert request_digest(request("/adapters/v1")) == request_digest(request("/adapters/v1"))


def test_a_prompt_given_as_embeddings_has_no_digest():
    from types import SimpleNamespace

    from kv_mooncake.identity import request_digest

    # Embeddings beside token ids (placeholders) or instead of them: never pulled.
    assert request_digest(SimpleNamespace(prompt_token_ids=[1, 2], prompt_embeds=object())) is None
    assert request_digest(SimpleNamespace(prompt_token_ids=None, prompt_embeds=object())) is None
    assert request_digest(SimpleNamespace(prompt_token_ids=None)) is None
    assert request_digest(SimpleNamespace(prompt_token_ids=[1, 2])) == prompt_digest([1, 2])
