"""Tiny random float32 models and a locally trained byte-level BPE tokenizer. Nothing is downloaded.

``build_tiny_llama(out_dir)`` writes a Hugging Face model directory that vLLM can serve;
``cached_tiny_model(**params)`` keeps one per parameter set under a shared cache directory,
guarded by a file lock so parallel test processes build it once. ``arch="gemma2"`` builds a
hybrid model instead: layers alternate sliding-window and full attention (``sliding_window``
tokens), so vLLM runs it with its hybrid KV-cache manager (two KV-cache groups).
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

# Only a hybrid architecture takes these; they stay out of a Llama's parameters (and its cache hash).
HYBRID_ARCHS = ("gemma2",)
DEFAULT_SLIDING_WINDOW = 128

# Head sizes the vLLM CPU attention kernels support.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128)


def _normalize(params: dict[str, Any]) -> dict[str, Any]:
    params = dict(params)
    arch = str(params.pop("arch", "llama"))
    window = params.pop("sliding_window", None)
    unknown = set(params) - set(DEFAULT_PARAMS)
    if unknown:
        raise TypeError(f"unknown tiny-model parameters: {sorted(unknown)}")
    if arch not in ("llama", *HYBRID_ARCHS):
        raise ValueError(f"arch must be 'llama' or one of {HYBRID_ARCHS}, not {arch!r}")
    if arch == "llama" and window is not None:
        raise TypeError("sliding_window applies to a hybrid arch only")
    hybrid_defaults = {"num_layers": 4} if arch != "llama" else {}
    merged = {**DEFAULT_PARAMS, **hybrid_defaults, **params}
    merged = {k: int(v) for k, v in merged.items()}
    if arch != "llama":
        merged["arch"] = arch
        merged["sliding_window"] = int(window if window is not None else DEFAULT_SLIDING_WINDOW)
        if merged["num_layers"] < 2 or merged["sliding_window"] < 1:
            raise ValueError("a hybrid tiny model needs >= 2 layers and a sliding_window >= 1")
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
    arch: str = "llama",
    sliding_window: int | None = None,
) -> Path:
    """Write a random float32 model (Llama, or ``arch="gemma2"``) + byte-level BPE tokenizer to
    ``out_dir`` and return it.

    Returns at once when ``out_dir`` already holds a complete model built with the same
    parameters (recorded in ``params.json``, written last).
    """
    hybrid = {} if arch == "llama" else {"arch": arch, "sliding_window": sliding_window}
    params = _normalize(
        dict(
            **hybrid,
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

    out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (out / PARAMS_FILE).unlink()  # mark incomplete while rebuilding

    model = _random_gemma2(params) if params.get("arch") == "gemma2" else _random_llama(params)
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


def _shape_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config arguments every tiny architecture shares."""
    return dict(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        head_dim=params["head_dim"],
        max_position_embeddings=params["max_position_embeddings"],
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        torch_dtype="float32",
    )


def _random_llama(params: dict[str, Any]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_shape_kwargs(params), rms_norm_eps=1e-5, tie_word_embeddings=False)
    # Deterministic weights without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        return LlamaForCausalLM(config).to(torch.float32)


def _random_gemma2(params: dict[str, Any]) -> Any:
    """Gemma2 with ``layer_types`` alternating sliding / full attention, random weights.

    Gemma2 ties its output to the embedding and scales the embedding up by sqrt(hidden): with
    random weights the logits then echo the last input token. A small embedding and larger
    projections let the attention (and so the KV under test) decide the next token.
    """
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    n = params["num_layers"]
    config = Gemma2Config(
        **_shape_kwargs(params),
        sliding_window=params["sliding_window"],
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        query_pre_attn_scalar=params["head_dim"],
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = Gemma2ForCausalLM(config).to(torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.05)
            for name, weight in model.named_parameters():
                if name.endswith("proj.weight"):
                    weight.mul_(4.0)
    return model


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
