"""``python -m kv_common list``: the installed kv-* connectors and their package versions."""

from __future__ import annotations

import argparse
import sys

from kv_common.registry import discover_connectors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_common")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list installed connectors")
    args = parser.parse_args(argv)
    if args.command == "list":
        specs = discover_connectors()
        if not specs:
            print("no kv-* connectors installed")
            return 0
        width = max(len(s.name) for s in specs)
        for s in specs:
            print(f"{s.name:<{width}}  {s.package} {s.package_version}  ({s.module}.{s.class_name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
