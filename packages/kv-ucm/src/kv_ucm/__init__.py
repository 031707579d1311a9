"""kv-ucm: KV offload and reuse for vLLM through UCM (Unified Cache Management)."""

from importlib import metadata as _metadata

try:  # the one version source is pyproject.toml, read from the installed distribution's metadata
    __version__ = _metadata.version("kv-ucm")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
