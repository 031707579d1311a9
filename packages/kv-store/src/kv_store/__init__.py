"""kv-store: KV-cache pool connector for vLLM (prefix reuse through pluggable backends)."""

from importlib import metadata as _metadata

try:  # the one version source is pyproject.toml, read from the installed distribution's metadata
    __version__ = _metadata.version("kv-store")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
