"""``python -m kv_common list``: the installed kv-* connectors, their names and who owns each name.
``python -m kv_common doctor``: checks before serving (``kv_common.doctor``)."""

from __future__ import annotations

import argparse
import sys

from kv_common.registry import discover_connectors, name_owners


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_common")
    sub = parser.add_subparsers(dest="command", required=True)
    list_parser = sub.add_parser("list", help="list installed connectors and who owns each name in vLLM")
    list_parser.add_argument(
        "--no-vllm", action="store_true", help="do not import vLLM: show what registering would do"
    )
    doctor_parser = sub.add_parser("doctor", help="check an installation and a --kv-transfer-config before serving")
    doctor_parser.add_argument("--kv-transfer-config", help="vLLM's --kv-transfer-config JSON (or a file holding it)")
    doctor_parser.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                               help="a peer that must accept TCP (e.g. a prefill's side channel); repeatable")
    doctor_parser.add_argument("--timeout", type=float, default=2.0, help="TCP connect deadline, seconds")
    doctor_parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    doctor_parser.add_argument("--no-vllm", action="store_true", help="do not import vLLM (name owners not read)")
    args = parser.parse_args(argv)
    if args.command == "list":
        return list_connectors(no_vllm=args.no_vllm)
    if args.command == "doctor":
        return doctor(args)
    return 0


def doctor(args: argparse.Namespace) -> int:
    import json

    from kv_common import doctor as doctor_mod

    registry, heading, plugins_ok = _vllm_registry(args.no_vllm)
    report = doctor_mod.run(args.kv_transfer_config, peers=args.peer, timeout_s=args.timeout, registry=registry,
                            registry_heading=heading, plugins_ok=plugins_ok)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.to_text())
    return 0 if report.ok else 1


def _vllm_registry(no_vllm: bool) -> tuple[dict | None, str, bool]:
    """(vLLM's connector registry after the general plugins ran, a heading, plugins ok)."""
    if no_vllm:
        return None, "vLLM not imported (--no-vllm): what registering would do", True
    from kv_common import vllm_compat

    try:
        factory = vllm_compat.connector_factory()
    except vllm_compat.VllmNotInstalledError:
        return None, "vLLM not installed: what registering would do", True
    heading = f"vLLM {vllm_compat.vllm_version()}: owners after vLLM's general plugins ran"
    try:
        vllm_compat.load_general_plugins()
    except Exception as exc:  # noqa: BLE001 - report it: this is what would stop vLLM starting
        print(f"vLLM's general plugins failed, vLLM would not start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return factory._registry, heading, False  # noqa: SLF001
    return factory._registry, heading, True  # noqa: SLF001


def list_connectors(no_vllm: bool = False) -> int:
    specs = discover_connectors()
    if not specs:
        print("no kv-* connectors installed")
        return 0
    registry, heading, plugins_ok = _vllm_registry(no_vllm)
    rows = [
        (o.name + (" (shared)" if o.shared else ""), f"{o.spec.package} {o.spec.package_version}".strip(), o.owner)
        for o in name_owners(specs, registry)
    ]
    print(heading)
    header = ("name", "package", "owner")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(2)]
    for r in [header, *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}")
    print(
        "Own names (Kv + the vllm-ascend name) always select ours; shared names are vllm-ascend's and ours\n"
        "only while free. KVCommonProbeConnector is test code: registered with KV_COMMON_ENABLE_PROBE=1."
    )
    return 0 if plugins_ok else 1


if __name__ == "__main__":
    sys.exit(main())
