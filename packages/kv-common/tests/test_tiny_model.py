import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from kv_common.testing.tiny_model import build_tiny_llama, cached_tiny_model, params_hash  # noqa: E402


def test_build_is_sane_and_cached(tmp_path):
    out = tmp_path / "m"
    path = build_tiny_llama(out)
    assert path == out

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 2
    assert cfg["hidden_size"] == 128
    assert cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 4
    assert cfg["head_dim"] == 32
    assert cfg["vocab_size"] == 1024
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        assert tuple(emb.shape) == (1024, 128)
        assert str(emb.dtype) == "torch.float32"
        assert float(emb.std()) > 0

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert 256 < len(tok) <= 1024
    ids = tok("the cache block", add_special_tokens=False).input_ids
    assert ids and max(ids) < 1024
    assert tok.decode(ids) == "the cache block"

    # Second call: nothing rebuilt (params.json matches).
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_llama(out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime

    # Different parameters in the same directory: rebuilt.
    build_tiny_llama(out, num_layers=1)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


def test_build_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = load_file(str(build_tiny_llama(tmp_path / "a", num_layers=1) / "model.safetensors"))
    b = load_file(str(build_tiny_llama(tmp_path / "b", num_layers=1) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(bool((a[k] == b[k]).all()) for k in a)


def test_cached_tiny_model_uses_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_TEST_MODEL_CACHE", str(tmp_path / "cache"))
    p1 = cached_tiny_model(num_layers=1)
    assert p1.parent == tmp_path / "cache"
    assert p1.name == params_hash(num_layers=1)
    assert (p1 / "params.json").is_file()
    mtime = (p1 / "model.safetensors").stat().st_mtime_ns
    assert cached_tiny_model(num_layers=1) == p1
    assert (p1 / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert not list((tmp_path / "cache").glob("*.build-*"))


def test_rejects_bad_params(tmp_path):
    with pytest.raises(ValueError):
        build_tiny_llama(tmp_path / "x", head_dim=48)
    with pytest.raises(TypeError):
        cached_tiny_model(bogus=1)
    with pytest.raises(TypeError):
        cached_tiny_model(sliding_window=64)  # a Llama has no window
    with pytest.raises(ValueError):
        cached_tiny_model(arch="mamba")


def test_hybrid_gemma2_alternates_sliding_and_full(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_TEST_MODEL_CACHE", str(tmp_path / "cache"))
    path = cached_tiny_model(arch="gemma2", sliding_window=64)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] == 64 and config["tie_word_embeddings"] is True
    assert params_hash(arch="gemma2", sliding_window=64) != params_hash(arch="gemma2")
    assert params_hash() == params_hash(arch="llama")  # a Llama's cache key is unchanged
