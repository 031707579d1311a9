"""``model_identity.weights_identity``: a model changed in place gets another identity, the same
bytes keep theirs wherever and whenever they were written."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import pytest
from kv_common.model_identity import (
    FILE_SAMPLE_BYTES,
    TENSOR_SAMPLE_BUDGET,
    TENSOR_SAMPLE_BYTES,
    UNVERIFIED,
    weights_identity,
)
from kv_common.testing.fake_vllm_config import fake_vllm_config
from kv_common.testing.model_weights import copy_model, rewrite_weights_in_place, write_safetensors
from kv_common.vllm_compat import kv_byte_settings

PINNED_DIGEST = "sha256:ebe881ff1c2ccb50"


@pytest.fixture(scope="module")
def tiny_model():
    for module in ("torch", "transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module)
    from kv_common.testing.tiny_model import cached_tiny_model

    return cached_tiny_model()


@pytest.fixture
def model(tiny_model, tmp_path):
    return copy_model(tiny_model, tmp_path / "model")


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[: 8 + n]


def test_new_weights_in_place_get_a_new_identity(model):
    weights = model / "model.safetensors"
    before, header, size = weights_identity(str(model)), _header(weights), weights.stat().st_size
    assert before.startswith("sha256:") and len(before) == len("sha256:") + 16
    rewrite_weights_in_place(model, seed=1)
    # what a fingerprint of names, shapes and sizes sees is unchanged ...
    assert (_header(weights), weights.stat().st_size) == (header, size)
    assert (model / "config.json").read_bytes() == (copy_model(model, model.parent / "again") / "config.json").read_bytes()
    # ... the weights are not
    after = weights_identity(str(model))
    assert after != before
    rewrite_weights_in_place(model, seed=2)
    assert weights_identity(str(model)) not in (before, after)


def test_the_same_bytes_keep_their_identity(tiny_model, model, tmp_path):
    identity = weights_identity(str(model))
    assert weights_identity(str(tiny_model)) == identity  # another path, another inode, same bytes
    rewrite_weights_in_place(model, seed=1)
    shutil.copyfile(tiny_model / "model.safetensors", model / "model.safetensors")  # the old bytes back
    assert weights_identity(str(model)) == identity
    moved = shutil.move(str(model), str(tmp_path / "moved"))
    assert weights_identity(moved) == identity


def test_only_the_mtime_changed_keeps_the_identity(model):
    identity = weights_identity(str(model))
    for name in ("model.safetensors", "config.json"):
        os.utime(model / name, ns=(time.time_ns(), time.time_ns() + 10**12))
    assert weights_identity(str(model)) == identity


def test_new_weights_under_the_old_mtime_are_still_seen(model):
    # cp -p / rsync -t copy a new checkpoint over the old one and keep its times
    weights = model / "model.safetensors"
    st = weights.stat()
    identity = weights_identity(str(model))
    rewrite_weights_in_place(model, seed=3)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    assert weights_identity(str(model)) != identity


def test_config_and_other_weight_files_count(model):
    identity = weights_identity(str(model))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    changed = weights_identity(str(model))
    assert changed != identity
    (model / "README.md").write_text("tokenizer and docs do not change the KV of given token ids")
    (model / "tokenizer.json").write_text("{}")
    assert weights_identity(str(model)) == changed
    (model / "pytorch_model.bin").write_bytes(b"\0" * 100)
    with_bin = weights_identity(str(model))
    (model / "pytorch_model.bin").write_bytes(b"\1" * 100)
    assert len({changed, with_bin, weights_identity(str(model))}) == 3


def _tensor(i: int, value: int) -> tuple[str, list[int], bytes]:
    return ("F32", [4], struct.pack("<4f", value, i, 0, 0))


def test_sharded_safetensors_each_shard_and_the_index(tmp_path):
    for shard in (1, 2):
        write_safetensors(tmp_path / f"model-0000{shard}-of-00002.safetensors",
                          {f"layers.{shard}.{i}": _tensor(i, 1) for i in range(3)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    identity = weights_identity(str(tmp_path))
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                      {f"layers.2.{i}": _tensor(i, 1 if i < 2 else 2) for i in range(3)})
    changed = weights_identity(str(tmp_path))
    assert changed != identity
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "y"}}))
    assert weights_identity(str(tmp_path)) != changed


def test_only_samples_are_read_and_many_tensors_are_spread(tmp_path):
    # A tensor is sampled at its start: a change behind the sample is not seen (documented).
    big = bytes(4 * 1024)
    write_safetensors(tmp_path / "m.safetensors", {"w": ("F32", [1024], big)})
    identity = weights_identity(str(tmp_path))
    write_safetensors(tmp_path / "m.safetensors", {"w": ("F32", [1024], big[:-4] + b"\1\1\1\1")})
    assert weights_identity(str(tmp_path)) == identity
    write_safetensors(tmp_path / "m.safetensors", {"w": ("F32", [1024], b"\1" + big[1:])})
    assert weights_identity(str(tmp_path)) != identity
    assert TENSOR_SAMPLE_BYTES <= 64
    # Over the budget, a spread subset: a model of many tensors still takes bounded time.
    n = 3 * TENSOR_SAMPLE_BUDGET
    write_safetensors(tmp_path / "m.safetensors", {f"t{i:06d}": ("F32", [1], b"\0\0\0\0") for i in range(n)})
    t0 = time.monotonic()
    assert weights_identity(str(tmp_path)).startswith("sha256:")
    assert time.monotonic() - t0 < 5


def test_unreadable_or_foreign_files_do_not_raise(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")  # header past the end
    (tmp_path / "broken.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0[]")  # not a dict
    first = weights_identity(str(tmp_path))
    assert first.startswith("sha256:") and weights_identity(str(tmp_path)) == first
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{!")
    assert weights_identity(str(tmp_path)) != first


def test_a_single_weights_file_gguf(tmp_path):
    gguf = tmp_path / "m.gguf"
    body = os.urandom(3 * FILE_SAMPLE_BYTES)
    gguf.write_bytes(body)
    identity = weights_identity(str(gguf))
    gguf.write_bytes(body[:-1] + bytes([body[-1] ^ 1]))  # the tail sample holds the last tensors
    assert weights_identity(str(gguf)) != identity


def _hub_cache(root, repo="org/m", commit="c" * 40, ref="main"):
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(commit)
    return commit


def test_hub_ids_by_the_commit_the_local_cache_resolves(tmp_path):
    pytest.importorskip("huggingface_hub")
    commit = _hub_cache(tmp_path)
    assert weights_identity("org/m", download_dir=str(tmp_path)) == f"hub:{commit[:16]}"
    assert weights_identity("org/m", revision="main", download_dir=str(tmp_path)) == f"hub:{commit[:16]}"
    # not in the cache: a pinned commit names the weights, a branch does not
    assert weights_identity("org/other", revision="d" * 40, download_dir=str(tmp_path)) == f"hub:{'d' * 16}"
    assert weights_identity("org/other", revision="main", download_dir=str(tmp_path)) == UNVERIFIED
    assert weights_identity("/models/absent", download_dir=str(tmp_path)) == UNVERIFIED
    assert weights_identity("") == UNVERIFIED


def test_kv_byte_settings_carry_the_identity(model):
    settings = kv_byte_settings(fake_vllm_config(model=str(model)))
    assert settings.model_weights == weights_identity(str(model))
    rewrite_weights_in_place(model, seed=4)
    assert kv_byte_settings(fake_vllm_config(model=str(model))).model_weights != settings.model_weights
    assert kv_byte_settings(fake_vllm_config()).model_weights == UNVERIFIED  # "org/m", not cached here


def test_the_digest_is_pinned(tmp_path):
    """Store namespaces and handshakes carry this digest: a refactor that changes it orphans every
    store written before it and makes peers of two releases refuse each other."""
    write_safetensors(tmp_path / "model.safetensors", {f"w{i}": _tensor(i, 7) for i in range(3)})
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert weights_identity(str(tmp_path)) == PINNED_DIGEST
