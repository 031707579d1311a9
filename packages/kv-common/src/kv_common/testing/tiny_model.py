"""A tiny random float32 Llama and a locally trained byte-level BPE tokenizer. Nothing is downloaded.

``build_tiny_llama(out_dir)`` writes a Hugging Face model directory that vLLM can serve;
``cached_tiny_model(**params)`` keeps one per parameter set under a shared cache directory,
guarded by a file lock so parallel test processes build it once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PARAMS_FILE = "params.json"
_FORMAT_VERSION = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

DEFAULT_PARAMS: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 128,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "seed": 1234,
}

# Head sizes the vLLM CPU attention kernels support.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128)


def _normalize(params: dict[str, Any]) -> dict[str, Any]:
    unknown = set(params) - set(DEFAULT_PARAMS)
    if unknown:
        raise TypeError(f"unknown tiny-model parameters: {sorted(unknown)}")
    merged = {**DEFAULT_PARAMS, **params}
    merged = {k: int(v) for k, v in merged.items()}
    if merged["head_dim"] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS} for the vLLM CPU kernels")
    if merged["num_heads"] % merged["num_kv_heads"]:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if merged["vocab_size"] < 300:
        raise ValueError("vocab_size must be >= 300 (256 byte tokens + merges + special tokens)")
    return {"format": _FORMAT_VERSION, **merged}


def _is_complete(out_dir: Path, params: dict[str, Any]) -> bool:
    try:
        stored = json.loads((out_dir / PARAMS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return stored == params and all((out_dir / f).is_file() for f in _REQUIRED_FILES)


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    """Deterministic pseudo-English text to train the BPE merges on."""
    rng = random.Random(seed)
    syllables = [
        "ka",
        "ve",
        "lo",
        "mi",
        "tra",
        "sen",
        "dor",
        "qui",
        "bel",
        "nu",
        "ox",
        "ar",
        "es",
        "ion",
        "th",
        "ing",
        "pre",
        "con",
        "al",
        "ur",
        "zy",
        "wh",
        "st",
        "re",
        "de",
        "an",
    ]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(800)]
    words += [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "cache",
        "block",
        "token",
        "prefill",
        "decode",
        "key",
        "value",
        "layer",
        "engine",
        "request",
        "0",
        "1",
        "2",
        "42",
        "128",
        "256",
    ]
    lines = []
    for _ in range(n_lines):
        ws = [rng.choice(words) for _ in range(rng.randint(4, 16))]
        sep = rng.choice([" ", " ", " ", ", ", ". "])
        lines.append(sep.join(ws) + rng.choice([".", "!", "?", ""]))
    return lines


def _build_tokenizer(out_dir: Path, vocab_size: int, seed: int, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=max_len,
    )
    fast.save_pretrained(str(out_dir))


def build_tiny_llama(
    out_dir: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    intermediate_size: int = 256,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    seed: int = 1234,
) -> Path:
    """Write a random float32 Llama + byte-level BPE tokenizer to ``out_dir`` and return it.

    Returns at once when ``out_dir`` already holds a complete model built with the same
    parameters (recorded in ``params.json``, written last).
    """
    params = _normalize(
        dict(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings,
            seed=seed,
        )
    )
    out = Path(out_dir)
    if _is_complete(out, params):
        return out

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (out / PARAMS_FILE).unlink()  # mark incomplete while rebuilding

    config = LlamaConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        head_dim=params["head_dim"],
        max_position_embeddings=params["max_position_embeddings"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        torch_dtype="float32",
    )
    # Deterministic weights without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    if not (out / "model.safetensors").is_file():
        raise RuntimeError(f"transformers did not write {out / 'model.safetensors'}")

    _build_tokenizer(out, params["vocab_size"], params["seed"], params["max_position_embeddings"])

    # Written last: its presence (with matching content) means the directory is complete.
    tmp = out / (PARAMS_FILE + ".tmp")
    tmp.write_text(json.dumps(params, indent=1, sort_keys=True))
    os.replace(tmp, out / PARAMS_FILE)
    return out


def params_hash(**params: Any) -> str:
    norm = _normalize(params)
    return hashlib.sha256(json.dumps(norm, sort_keys=True).encode()).hexdigest()[:16]


def model_cache_root() -> Path:
    root = os.environ.get("KV_TEST_MODEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kv-connectors" / "models"


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = 600.0) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX: no locking, builds are idempotent anyway
            yield
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not lock {path} within {timeout_s} s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def cached_tiny_model(**params: Any) -> Path:
    """The tiny model for ``params`` (see ``build_tiny_llama``), built once per cache directory.

    Cache: ``$KV_TEST_MODEL_CACHE/<hash>`` or ``~/.cache/kv-connectors/models/<hash>``.
    """
    norm = _normalize(params)
    kwargs = {k: v for k, v in norm.items() if k != "format"}
    target = model_cache_root() / params_hash(**kwargs)
    if _is_complete(target, norm):
        return target
    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_complete(target, norm):
            return target
        # Build next to the target and rename, so readers never see a half-written directory.
        staging = target.with_name(f"{target.name}.build-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            build_tiny_llama(staging, **kwargs)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
