"""kv-common: what every kv-* vLLM KV connector shares."""

from importlib import metadata as _metadata

try:  # the one version source is pyproject.toml, read from the installed distribution's metadata
    __version__ = _metadata.version("kv-common")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
