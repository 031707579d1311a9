"""Entry point of the ``kv-mooncake-proxy`` console script."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kv_mooncake.proxy.config import open_operations_warning, parse_args


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    import uvicorn

    from kv_mooncake.proxy.app import build_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kv_mooncake.proxy").info(
        "kv-mooncake-proxy on %s:%d, prefill %s, decode %s, fallback %s",
        config.host, config.port, list(config.prefill_urls), list(config.decode_urls), config.fallback)
    warning = open_operations_warning(config)
    if warning:
        logging.getLogger("kv_mooncake.proxy").warning(warning)
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
